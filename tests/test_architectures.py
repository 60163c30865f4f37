"""The architecture matrix (docs/architectures.md): every family of tests/model_families.py through every cell, as a
user drives qbuild: a recipe per family with `source: local` (or `source: gguf` for the round trip), run through the
API, planned through the CLI.

Cells (architecture_matrix.CELLS): the HF import with the baseline's evaluation; the round trip through a GGUF made
by llama.cpp's converter; GGUF F16 / Q8_0 / Q4_K_M, each evaluated by llama.cpp against the baseline (sanity bounds:
F16 KLD < 1e-4, Q8_0 KLD < 0.01); RTN, GPTQ, AWQ and FP8 through llm-compressor, each evaluated by transformers
(marked slow: a family's four take about a minute and a half on one core); and `qbuild plan` of the serving steps.
A cell qbuild refuses is tested as a refusal: `qbuild validate` exits 2 with one line naming the field and reason.

With QBUILD_ARCH_RESULTS=<dir> each passing cell writes its figures there (tests/gen_architectures.py renders
docs/architectures.md from them).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import architecture_matrix as am
import model_families as mf
import pytest
import yaml

from helpers import qbuild, run_api, write_recipe

REPO = Path(__file__).resolve().parents[1]
NEEDS_GGUF = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs qbuild[gguf]")
NEEDS_CT = pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None, reason="needs qbuild[llmcompressor]")

def record(family: str, cell: str, **figures) -> None:
    """A passing cell's figures, for tests/gen_architectures.py (only when QBUILD_ARCH_RESULTS is set)."""
    out = os.environ.get("QBUILD_ARCH_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{family}__{cell}.json").write_text(json.dumps({"family": family, "cell": cell, **figures}))


# Each family's GGUF cells cost a conversion, a check and three evaluations (~20-45 s on 2 cores). CI keeps one family
# per tokenizer kind and architecture trait (Llama 3 BPE, Qwen BPE with MoE, Gemma SPM with sliding windows; Llama's
# SPM, Phi-3's and Mistral's, is checked against llama.cpp's own vectors in test_gguf_vocab_vectors.py); these repeat
# a kind already covered and run with `pytest -m slow` (CI's 45 minutes).
SLOW_IN_CI = {"qwen2.5", "qwen3", "gemma2", "mixtral", "phi3", "mistral"}


def cell_params(cells: tuple[str, ...]):
    """(family, cell) pairs as pytest params; a known failure is an xfail with its reason (a refused cell is tested
    as a refusal: refused_here)."""
    out = []
    for family in mf.FAMILIES:
        for cell in cells:
            known = am.KNOWN_FAILURES.get((family.name, cell))
            marks = [pytest.mark.xfail(reason=known, strict=True)] if known else []
            if family.name in SLOW_IN_CI:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(family.name, cell, id=f"{family.name}-{cell}", marks=marks))
    return out


# --- shared, built once per session ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def family_dir(models_cache):
    """family name → its tiny model directory (built on first use, kept in pytest's cache across sessions)."""
    return lambda name: mf.built(mf.BY_NAME[name], models_cache / "families")


@pytest.fixture(scope="session")
def converter(family_dir, tmp_path_factory):
    """family name → a llama.cpp converter that knows that family's tiny BPE vocabulary (model_families.py)."""
    root = tmp_path_factory.mktemp("converters")
    return lambda name: mf.registered_converter({name: family_dir(name)}, root)


@pytest.fixture(scope="session")
def matrix_store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("matrix") / "store"


@pytest.fixture(scope="session")
def runs(family_dir, converter, matrix_store, tmp_path_factory):
    """(family, group) → the summary of that family's recipe for one group of cells, run once per session."""
    done: dict[tuple[str, str], dict] = {}
    root = tmp_path_factory.mktemp("recipes")

    def get(family: str, group: str) -> dict:
        if (family, group) not in done:
            data = am.recipe(family, group, family_dir(family), matrix_store)
            recipe = write_recipe(root / f"{family}-{group}.yaml", data)
            env = {"QBUILD_LLAMA_CPP_DIR": str(converter(family))}
            with pytest.MonkeyPatch.context() as mp:
                for k, v in env.items():
                    mp.setenv(k, v)
                rc, summary = run_api(recipe)
            assert rc == 0, [(s["name"], s.get("error")) for s in summary["steps"] if s["status"] == "failed"]
            done[(family, group)] = summary
        return done[(family, group)]

    return get


def variant_row(summary: dict, name: str) -> dict:
    return next(v for v in summary["variants"] if v["variant"] == name)


def step_seconds(summary: dict, *names: str) -> float:
    return round(sum(s.get("seconds") or 0.0 for s in summary["steps"] if s["name"] in names), 1)


def refused_here(family_dir, tmp_path: Path, family: str, cell: str) -> bool:
    """True, once checked, when qbuild refuses this cell: `qbuild validate` of the cell's recipe exits 2 with one
    line naming the variant's method and the reason, before any step runs."""
    why = am.refusal(family, cell)
    if not why:
        return False
    data = am.recipe(family, cell, family_dir(family), tmp_path / "store")
    done = qbuild("validate", write_recipe(tmp_path / "refused.yaml", data))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "variants[0].method" in lines[0] and why in lines[0], lines
    return True


# --- the cells ---------------------------------------------------------------------------------------------------
@NEEDS_GGUF
@pytest.mark.parametrize(("family", "cell"), cell_params(("hf",) + am.GGUF_CELLS))
def test_gguf_cells(runs, family_dir, tmp_path, family, cell):
    """HF import and baseline evaluation; GGUF F16/Q8_0/Q4_K_M evaluated by llama.cpp against the baseline."""
    if refused_here(family_dir, tmp_path, family, cell):
        return
    summary = runs(family, "gguf")
    base = variant_row(summary, "baseline")
    assert base["ppl"] is not None and math.isfinite(base["ppl"]), base
    if cell == "hf":
        # the conversion every GGUF cell is built from was held to the checkpoint (tokens, KLD, perplexity) first
        [check] = [c for c in summary.get("fidelity_checks", []) if c["step"] == "convert-check[f16]"]
        assert check["kld"] < check["kld_bound"] and check["top1"] >= check["top1_bound"], check
        record(family, cell, ppl=base["ppl"], check_kld=check["kld"], check_top1=check["top1"],
               check_ppl_pct=check["ppl_delta_pct"], check_tokens=check["tokens_compared"],
               seconds=step_seconds(summary, "eval-data", "reference[baseline]", "convert-check[f16]"))
        return
    name = am.variant_name(cell)
    row = variant_row(summary, name)
    assert row["status"] == "built" and row["format"] == "gguf", row
    assert row["kld"] is not None and math.isfinite(row["kld"]) and row["ppl"] is not None, row
    bound = am.KLD_BOUNDS.get(cell)
    if bound is not None:
        assert row["kld"] < bound, f"{family} {cell}: KLD {row['kld']:.3g} is not below {bound}"
    record(family, cell, kld=row["kld"], top1=row.get("top1"), ppl=row["ppl"],
           seconds=step_seconds(summary, f"quantize[{name}]", f"perplexity[{name}]"))


@NEEDS_CT
@pytest.mark.slow
@pytest.mark.parametrize(("family", "cell"), cell_params(am.CT_CELLS))
def test_llmcompressor_cells(runs, family_dir, tmp_path, family, cell):
    """RTN, GPTQ, AWQ and FP8 through llm-compressor: a compressed-tensors checkpoint that transformers evaluates."""
    if refused_here(family_dir, tmp_path, family, cell):
        return
    summary = runs(family, "llm-compressor")
    row = variant_row(summary, cell)
    assert row["status"] == "built" and row["format"] == "compressed-tensors", row
    assert row["kld"] is not None and math.isfinite(row["kld"]) and row["ppl"] is not None, row
    assert row["kld"] < am.KLD_BOUNDS[cell], f"{family} {cell}: KLD {row['kld']:.3g} is not below {am.KLD_BOUNDS[cell]}"
    record(family, cell, kld=row["kld"], top1=row.get("top1"), ppl=row["ppl"],
           seconds=step_seconds(summary, f"quantize[{cell}]", f"perplexity[{cell}]"))


@NEEDS_GGUF
@pytest.mark.parametrize(("family", "cell"), cell_params(("gguf-import",)))
@pytest.mark.slow
def test_gguf_round_trip(runs, family_dir, converter, matrix_store, tmp_path, family, cell):
    """A GGUF made by llama.cpp's converter imported with `source: gguf`: the checkpoint qbuild makes of it has the
    source's tokenizer (the same ids for the evaluation text) and its weights (the same perplexity, to F16's
    rounding)."""
    source = family_dir(family)
    gguf = tmp_path / f"{family}.f16.gguf"
    done = subprocess.run([sys.executable, str(converter(family) / "convert_hf_to_gguf.py"), str(source),
                           "--outfile", str(gguf), "--outtype", "f16"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    data = am.recipe(family, "gguf-import", gguf, matrix_store)
    why = am.refusal(family, cell)
    if why:   # refused when the recipe is validated, in one line naming the model's path and the reason
        done = qbuild("validate", write_recipe(tmp_path / "refused.yaml", data))
        assert done.returncode == 2, done.stdout + done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "model.path" in lines[0] and why in lines[0], lines
        return
    with pytest.MonkeyPatch.context() as mp:   # the import is converted back to a GGUF: by the family's converter
        mp.setenv("QBUILD_LLAMA_CPP_DIR", str(converter(family)))
        rc, summary = run_api(write_recipe(tmp_path / "recipe.yaml", data))
    assert rc == 0, [(s["name"], s.get("error")) for s in summary["steps"] if s["status"] == "failed"]
    imported = next(s for s in summary["steps"] if s["kind"] == "import-gguf")
    from transformers import AutoTokenizer

    from qbuild.artifacts.store import Store

    out = Store(matrix_store).object_dir(imported["digest"])
    text = "def parse(self, data):\n    \"\"\"Return the 3 fields of `data` (UTF-8, or ASCII).\"\"\"\n  x = 42\n"
    want = AutoTokenizer.from_pretrained(str(source)).encode(text)
    got = AutoTokenizer.from_pretrained(str(out)).encode(text)
    assert got == want, f"{family}: the imported tokenizer gives {got[:12]}..., the source's {want[:12]}..."
    ppl, hf_ppl = variant_row(summary, "baseline")["ppl"], variant_row(runs(family, "gguf"), "baseline")["ppl"]
    assert abs(ppl - hf_ppl) < 0.01 * hf_ppl, f"{family}: perplexity {ppl:.2f} after the round trip, {hf_ppl:.2f} before"
    [check] = [c for c in summary.get("fidelity_checks", []) if c["step"] == "import-check"]
    assert check["kld"] < check["kld_bound"] and abs(check["ppl_delta_pct"]) < 2, check
    record(family, cell, ppl=ppl, check_kld=check["kld"], check_top1=check["top1"],
           check_ppl_pct=check["ppl_delta_pct"], seconds=step_seconds(summary, "import-gguf", "import-check"))


@pytest.mark.parametrize("family", [pytest.param(f.name, marks=[pytest.mark.slow] if f.name in SLOW_IN_CI else [])
                                    for f in mf.FAMILIES])   # most of each one's time is building its model
def test_plan_serving(family_dir, tmp_path, family):
    """`qbuild plan` of a family's serving: llama-server for its GGUF, the HF-format server for its
    compressed-tensors checkpoint (planned, and skipped where this machine has no GPU)."""
    data = am.recipe(family, "plan", family_dir(family), tmp_path / "store")
    recipe = write_recipe(tmp_path / "recipe.yaml", data)
    done = qbuild("plan", recipe, "--json", timeout=600)
    assert done.returncode == 0, done.stderr
    steps = {s["step"]: s for s in json.loads(done.stdout)["steps"]}
    servers = {}
    served = [v["name"] for v in data["variants"]]
    assert "q8_0" in served
    for label in served:
        step = steps.get(f"serving[{label}@default]")
        assert step is not None, f"{family}: no serving step for {label}: {sorted(steps)}"
        params = step["key_material"]["params"]
        assert params["server_args"], params
        servers[label] = params["server"]
    assert servers["q8_0"] == "llama-server", servers
    record(family, "plan", servers=servers)


def variant_of(family_dir, family: str, root: Path, **config) -> Path:
    """The family's tiny model with `config` changed in its config.json (the other files linked)."""
    source, out = family_dir(family), root / f"{family}-variant"
    out.mkdir()
    for path in source.iterdir():
        if path.name != "config.json":
            (out / path.name).symlink_to(path)
    (out / "config.json").write_text(json.dumps(json.loads((source / "config.json").read_text()) | config))
    return out


def test_qwen3_moe_without_renormalised_routing_is_refused_for_gguf(family_dir, tmp_path):
    """A Qwen3-MoE whose router does not renormalise its top-k weights (norm_topk_prob: false) is refused for GGUF
    when the recipe is validated, in one line naming the variant's method and the reason: llama.cpp's qwen3moe
    renormalises always, so the GGUF would be another function (F16 KLD 0.044 measured). The same checkpoint is
    not refused for llm-compressor, nor is the family's own (norm_topk_prob: true, as the real models have)."""
    model = variant_of(family_dir, "qwen3-moe", tmp_path, norm_topk_prob=False)
    data = am.recipe("qwen3-moe", "Q8_0", model, tmp_path / "store")
    done = qbuild("validate", write_recipe(tmp_path / "recipe.yaml", data))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "variants[0].method" in lines[0] and "norm_topk_prob is false" in lines[0], lines
    assert "renormalizes the top-k router weights" in lines[0]
    assert not (tmp_path / "store").exists()
    assert am.refusal("qwen3-moe", "Q8_0") is None and am.refusal("qwen3-moe", "rtn") is None
    from qbuild.contract.plugin import methods
    from qbuild.contract.shapes import family_refusal

    assert family_refusal(json.loads((model / "config.json").read_text()), methods.get("rtn")) is None


@pytest.mark.parametrize(("family", "adds_bos"), [("qwen2.5", False), ("llama3", True), ("mistral", True)])
def test_evaluation_follows_a_tokenizer_without_bos(family_dir, tmp_path, family, adds_bos):
    """Qwen's tokenizer has no BOS token: its windows are scored without one unless the recipe says otherwise (the
    default add_bos: true failed in the reference step before), and asking for one is refused at plan time."""
    from qbuild import api

    data = am.recipe(family, "gguf", family_dir(family), tmp_path / "store")
    steps = {s.name: s for s in (p.step for p in api.validate(data).steps)}
    assert steps["eval-data"].params["add_bos"] is adds_bos
    data["evaluation"]["perplexity"] = data["evaluation"]["perplexity"] | {"add_bos": True}
    done = qbuild("validate", write_recipe(tmp_path / "recipe.yaml", data))
    if adds_bos:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 2 and "evaluation.perplexity.add_bos" in done.stderr, done.stderr
        assert "no BOS token" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_docs_page_declares_the_matrix():
    """docs/architectures.md's status table is the one the matrix code declares (tests/gen_architectures.py writes
    it), and every measured F16 / Q8_0 KLD it shows is within the sanity bounds."""
    import gen_architectures as gen

    page = (REPO / "docs" / "architectures.md").read_text()
    assert gen.status_table() in page, "docs/architectures.md is stale: run python tests/gen_architectures.py"
    for cell, bound in am.KLD_BOUNDS.items():
        for family, kld in gen.page_klds(page, cell).items():
            assert kld < bound, f"docs/architectures.md: {family} {cell} KLD {kld} is not below {bound}"


def test_recipes_of_the_matrix_parse(tmp_path):
    """Each group's recipe parses as qbuild's schema (a cheap guard for the generator and the cells)."""
    from qbuild.planning.recipe import parse_recipe

    for group in am.GROUPS:
        parse_recipe(yaml.safe_load(yaml.safe_dump(am.recipe("llama3", group, tmp_path, tmp_path / "store"))))


def test_asymmetric_compressed_tensors_qwen3_moe_is_refused(family_dir, tmp_path):
    """AWQ (asymmetric by default) on Qwen3-MoE is refused when the recipe is validated: the checkpoint llm-compressor
    writes has zero points on the fused experts that transformers' DecompressExperts cannot load (the matrix's AWQ
    cell failed in its perplexity step before; RTN and GPTQ, symmetric, load). The same method with sym: true is not
    refused."""
    data = am.recipe("qwen3-moe", "awq", family_dir("qwen3-moe"), tmp_path / "store")
    done = qbuild("validate", write_recipe(tmp_path / "recipe.yaml", data))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "variants[0].method" in lines[0] and "sym is false" in lines[0], lines
    data["variants"][0]["sym"] = True
    done = qbuild("validate", write_recipe(tmp_path / "recipe.yaml", data))
    assert done.returncode == 0, done.stderr
