"""`search:` on a gguf variant (qbuild/quantize/gguf/search.py): the allocation against brute force, the schema, the
plan's steps and keys, and a real search on the 2-layer SmolLM2 through llama.cpp."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from qbuild.artifacts.store import Store
from qbuild.pipeline.plan import build_steps
from qbuild.planning.recipe import parse_recipe
from qbuild.plugins import allocate, smallest_within
from qbuild.quantize.gguf import GGUFVariant
from qbuild.quantize.gguf.search import probes_at_once, tensor_groups
from qbuild.quantize.gguf.search_options import GGUFSearch

from helpers import rerun_then_another_budget, run_api, write_recipe


# --- allocation ----------------------------------------------------------------------------------------------
def brute(options, ok):
    """Every choice, the best (least value, then least cost) that `ok(cost, value)` accepts."""
    best = None
    for choice in itertools.product(*(range(len(o)) for o in options)):
        cost = sum(options[g][i][0] for g, i in enumerate(choice))
        value = sum(options[g][i][1] for g, i in enumerate(choice))
        if ok(cost, value) and (best is None or (value, cost) < best[:2]):
            best = (value, cost, list(choice))
    return best


def totals(options, choice):
    return (sum(options[g][i][0] for g, i in enumerate(choice)), sum(options[g][i][1] for g, i in enumerate(choice)))


def random_options(rng, groups=4, types=3):
    """Group options like a search's: the base (0, 0) and cheaper types that add KLD (some noise below zero)."""
    return [[(0, 0.0)] + [(-rng.randint(1, 60), rng.uniform(-0.001, 0.05)) for _ in range(types)]
            for _ in range(groups)]


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_the_exact_optimum_on_small_cases(seed):
    rng = random.Random(seed)
    options = random_options(rng, groups=rng.randint(1, 5), types=rng.randint(1, 4))
    capacity = -rng.randint(0, sum(-min(c for c, _ in o) for o in options))
    found = allocate(options, capacity, unit=1)
    expected = brute(options, lambda c, v: c <= capacity)
    assert found is not None and expected is not None
    cost, value = totals(options, found)
    assert cost <= capacity
    assert value == pytest.approx(expected[0], abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_coarse_units_never_exceed_the_budget(seed):
    rng = random.Random(100 + seed)
    options = random_options(rng, groups=5, types=3)
    capacity = -rng.randint(10, 120)
    found = allocate(options, capacity, unit=7)
    exact = brute(options, lambda c, v: c <= capacity)
    if found is None:   # rounding costs up may lose a choice that fits exactly, never admit one that does not
        return
    cost, value = totals(options, found)
    assert cost <= capacity and value >= exact[0] - 1e-12


def test_no_choice_fits():
    assert allocate([[(0, 0.0), (-5, 0.1)], [(0, 0.0), (-3, 0.2)]], -9) is None


def test_upgrades_cost_bytes_and_lower_kld():
    """An option above the base (F16 over Q8_0): positive cost, negative value; taken only where room allows."""
    options = [[(0, 0.0), (10, -0.01)], [(0, 0.0), (-8, 0.002)]]
    assert allocate(options, 2, unit=1) == [1, 1]
    assert allocate(options, 1, unit=1) == [0, 0]


@pytest.mark.parametrize("seed", range(20))
def test_min_size_under_a_kld_budget(seed):
    rng = random.Random(200 + seed)
    options = random_options(rng, groups=4, types=3)
    budget = rng.uniform(0.0, 0.1)
    found = smallest_within(options, budget, unit=1)
    best = min(((totals(options, c)[0], c) for c in itertools.product(*(range(len(o)) for o in options))
                if totals(options, c)[1] <= budget), default=None)
    if best is None:
        assert found is None
        return
    cost, value = totals(options, found)
    assert value <= budget + 1e-12 and cost == best[0]


def test_groups_by_kind_and_band():
    names = [f"blk.{i}.{k}.weight" for i in range(4) for k in ("attn_q", "ffn_down")] + ["token_embd.weight"]
    cols = dict.fromkeys(names, 64) | {f"blk.{i}.ffn_down.weight": 256 for i in range(4)}
    one = tensor_groups(names, cols, 4, 1)
    assert [g.name for g in one] == ["attn_q", "ffn_down", "token_embd"]
    assert one[1].columns == (256,) * 4 and len(one[0].tensors) == 4
    two = tensor_groups(names, cols, 4, 2)
    assert [g.name for g in two] == ["attn_q.b0-1", "attn_q.b2-3", "ffn_down.b0-1", "ffn_down.b2-3", "token_embd"]
    import re

    assert [n for n in names if re.search(two[1].pattern, n)] == ["blk.2.attn_q.weight", "blk.3.attn_q.weight"]


# --- schema --------------------------------------------------------------------------------------------------
def variant(**kw):
    return GGUFVariant.model_validate({"name": "v", "method": "gguf", **kw})


def test_schema():
    v = variant(search={"max_size_mb": 100.6})
    assert v.type is None and v.search.objective == "min_kld"
    assert variant(search={"max_kld": 0.01}).search.objective == "min_size"
    assert variant(search={"max_bpw": 5, "types": ["q4_0", "Q5_0"]}).search.types == ["Q4_0", "Q5_0"]
    for bad, words in [({}, "give either type"),
                       ({"type": "Q4_0", "search": {"max_size_mb": 1}}, "not both"),
                       ({"search": {"max_size_mb": 1, "max_kld": 0.1}}, "exactly one budget"),
                       ({"search": {"objective": "min_kld"}}, "exactly one budget"),
                       ({"search": {"max_kld": 0.1, "objective": "min_kld"}}, "use min_size"),
                       ({"search": {"max_size_mb": 1, "types": ["Q9_9"]}}, "not a ggml tensor type"),
                       ({"search": {"max_size_mb": 1}, "tensor_types": [{"pattern": "x", "type": "Q8_0"}]},
                        "search chooses every tensor"),
                       ({"type": "Q4_0", "target_size_mb": 90}, "search: {max_size_mb")]:
        with pytest.raises(ValidationError, match=words):
            variant(**bad)


def test_probes_at_once_keep_their_scratch_within_three_times_the_artifact():
    """Each probe's file is about the base type's size; the artifact about the budget's. n probes at once hold
    n × base, which must stay within 3 × the artifact, and one always runs."""
    at = probes_at_once
    assert at(GGUFSearch(max_bpw=4.5), 10**9) == 1      # 2 Q8_0 probes (17 bits) would be 3.8× a 4.5-bpw artifact
    assert at(GGUFSearch(max_bpw=6.0), 10**9) == 2      # 17 bits ≤ 18
    assert at(GGUFSearch(max_bpw=8.5), 10**9) == 3
    assert at(GGUFSearch(max_bpw=12, base_type="F16"), 10**9) == 2
    # recipes/mixed-precision.yaml: Q4_K_M's 105.45 MB on SmolLM2-135M's ~134.5M weights is 6.27 bpw
    assert at(GGUFSearch(max_size_mb=105.4544), 134_515_008) == 2
    # a KLD budget's artifact size is unknown: as small as its smallest candidate type (Q2_K by default, Q5_0 here)
    assert at(GGUFSearch(max_kld=0.1), 10**9) == 1
    assert at(GGUFSearch(max_kld=0.1, types=["Q6_K", "Q5_0"]), 10**9) == 1
    assert at(GGUFSearch(max_kld=0.1, types=["Q6_K"]), 10**9) == 2


# --- plan ----------------------------------------------------------------------------------------------------
def recipe_for(model: Path, store: Path, search: dict, imatrix=True) -> dict:
    return {"name": "gsearch", "model": {"source": "local", "path": str(model)},
            "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 8, "seq_len": 128},
            "variants": [{"name": "q4km", "method": "gguf", "type": "Q4_K_M", "imatrix": imatrix},
                         {"name": "mix", "method": "gguf", "imatrix": imatrix, "search": search}],
            "evaluation": {"baseline": True, "kld": True, "perplexity": {"context_length": 256, "max_windows": 2}},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


def plan_steps(tmp_path, data) -> dict:
    return {s.name: s for s in build_steps(parse_recipe(data), tmp_path).steps}


needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs qbuild[gguf]")


@needs_llama
def test_plan_sensitivity_is_shared_across_budgets(tiny_model_dir, tmp_path):
    search = {"max_size_mb": 36, "types": ["Q4_0", "Q2_K"], "max_candidates": 2}
    a = plan_steps(tmp_path, recipe_for(tiny_model_dir, tmp_path / "s", search))
    b = plan_steps(tmp_path, recipe_for(tiny_model_dir, tmp_path / "s", {**search, "max_size_mb": 33}))
    sens = sorted(n for n in a if n.startswith("probe[mix~") and "cand" not in n and "base" not in n)
    # 2-layer SmolLM2: 8 groups (7 kinds + token_embd, tied output); Q2_K fits only ffn_down's 1536 columns
    assert len(sens) == 9 and "probe[mix~ffn_down@Q2_K]" in sens and "probe[mix~attn_q@Q2_K]" not in sens
    for name in sens + ["probe[mix~base]"]:
        assert a[name].key == b[name].key, name          # a second budget reuses every measurement
        assert a[name].kind == "gguf-probe" and a[name].format == "metrics"   # a probe stores no file
        assert a[name].scratch == 0.6   # ...but writes one while it runs: the executor holds that disk for it
        assert a[name].at_once == ("gguf-search[mix]", 2)   # two at once: 2 × 8.5 bits within 3 × 36 MB's ~8.2
    for name in ("gguf-search-allocate[mix]", "probe[mix~cand0]", "quantize[mix]"):
        assert a[name].key != b[name].key
    # the search stores one .gguf: its selection; nothing else it plans is a model file (no whole file per point)
    search_steps = [s for n, s in a.items() if "[mix" in n]
    assert [s.name for s in search_steps if s.format == "gguf"] == ["quantize[mix]"]
    assert not any(n.startswith("perplexity[mix~") or n.startswith("quantize[mix~") for n in a)
    assert a["quantize[mix]"].variant == "mix" and a["quantize[mix]"].format == "gguf"
    assert a["probe[mix~attn_q@Q4_0]"].inputs["reference"].name == "reference[baseline]"   # 2 windows: as the recipe
    assert a["probe[mix~attn_q@Q4_0]"].params["measure"]["max_windows"] == 2
    assert a["probe[mix~cand0]"].inputs["reference"].name == "reference[baseline]"
    # the variant's own evaluation is its chosen finalist's measurement (same windows): planned over the finalists'
    # probes, not as another pass; a stock variant's evaluation is the ordinary one
    own = a["perplexity[mix]"]
    assert own.runner.endswith(":perplexity_of_a_measured_file") and own.inputs["model"] is a["quantize[mix]"]
    assert {r: s.name for r, s in own.inputs.items() if r != "model"} == {
        "measured:m:0": "probe[mix~cand0]", "measured:m:1": "probe[mix~cand1]"}
    stock = a["perplexity[q4km]"]
    assert stock.runner.endswith(":perplexity") and not any(":" in r for r in stock.inputs)
    assert dict(own.params) == {**stock.params, "reuses": "candidate measurement"}
    assert dict(a["probe[mix~cand0]"].params["measure"]) == dict(stock.params)   # measured as the variant would be
    assert "reference" not in own.inputs and "data" not in own.inputs   # nothing to fetch that it does not read
    alone = recipe_for(tiny_model_dir, tmp_path / "s", search)
    alone["variants"] = alone["variants"][:1]
    assert plan_steps(tmp_path, alone)["perplexity[q4km]"].key == stock.key


@needs_llama
def test_plan_refuses_a_search_without_kld(tiny_model_dir, tmp_path):
    from qbuild.errors import RecipeError

    data = recipe_for(tiny_model_dir, tmp_path / "s", {"max_size_mb": 36})
    data["evaluation"]["kld"] = False
    with pytest.raises(RecipeError, match="evaluation.kld: true"):
        plan_steps(tmp_path, data)


@needs_llama
def test_max_minutes_refuses_a_search_estimated_longer(tiny_model_dir, tmp_path):
    """max_minutes is checked against the estimate of the search's steps still to build (an empty store: the
    model-size guess) before anything runs; it is in no key, so a search within it plans the same steps."""
    from qbuild.errors import RecipeError
    from qbuild.pipeline.plan import make_plan

    search = {"max_size_mb": 36, "types": ["Q4_0", "Q2_K"], "max_candidates": 2}
    store = Store(tmp_path / "s")

    def plan(extra):
        return make_plan(parse_recipe(recipe_for(tiny_model_dir, tmp_path / "s", {**search, **extra})), tmp_path, store)

    with pytest.raises(RecipeError, match=r"variants\[1\]\.search\.max_minutes.*the search for mix is estimated at "
                                          r"[\d.]+ min \(\d+ steps to build on \d+ cores, from the model's size\), "
                                          r"over max_minutes 0\.001: lower types, layer_bands, max_candidates or "
                                          r"sensitivity_windows, or raise max_minutes") as err:
        plan({"max_minutes": 0.001})
    assert "\n" not in str(err.value)
    within, unlimited = plan({"max_minutes": 600}), plan({})
    assert [p.step.key for p in within.steps] == [p.step.key for p in unlimited.steps]


# --- a real search ---------------------------------------------------------------------------------------------
SEARCH = {"max_size_mb": 36.6, "types": ["Q4_0", "Q5_0", "Q2_K"], "max_candidates": 2}


@pytest.fixture(scope="module")
def searched(tiny_model_dir, tmp_path_factory):
    """The search run once on the 2-layer SmolLM2 (with a stock Q4_K_M beside it), for the tests below."""
    root = tmp_path_factory.mktemp("gsearch")
    store = root / "store"
    recipe = write_recipe(root / "r.yaml", recipe_for(tiny_model_dir, store, SEARCH))
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    return {"root": root, "store": store, "recipe": recipe, "summary": summary,
            "steps": {s["name"]: s for s in summary["steps"]}, "mix": {v["variant"]: v for v in summary["variants"]}["mix"]}


def gguf_files(store: Path) -> list[Path]:
    """Every GGUF file under `store`, by its magic bytes, whatever its name."""
    def magic(p: Path) -> bytes:
        with open(p, "rb") as f:
            return f.read(4)

    return sorted(p for p in store.rglob("*") if p.is_file() and not p.is_symlink() and magic(p) == b"GGUF")


@needs_llama
@pytest.mark.slow
def test_search_meets_the_budget_and_stores_one_gguf(searched):
    store, steps, row = searched["store"], searched["steps"], searched["mix"]
    assert row["size_bytes"] <= 36.6e6 and row["kld"] is not None and row["ppl"] is not None
    st = Store(store)
    obj = st.object_dir(row["digest"])
    manifest = json.loads((obj / "manifest.json").read_text())
    record = manifest["info"]["search"]
    assert manifest["info"]["tensor_types"] == record["tensor_types"] and record["tensor_types"]
    assert manifest["metrics"]["gguf_bytes"] == (obj / "model.gguf").stat().st_size
    assert manifest["metrics"]["size_bytes"] == record["size_bytes"] == row["size_bytes"]   # .gguf + search.json
    assert sorted(f["path"] for f in manifest["files"]) == ["model.gguf", "search.json"]
    assert json.loads((obj / "search.json").read_text())["tensor_types"] == record["tensor_types"]
    assert record["kld"] == pytest.approx(row["kld"], abs=1e-9)   # the finalist's measurement is the variant's
    # ... taken, not measured again: the variant's perplexity step holds the chosen finalist probe's files and metrics
    own = st.lookup(steps["perplexity[mix]"]["key"]).record
    probe = st.lookup(steps[f"probe[mix~cand{record['chosen']}]"]["key"]).record
    assert own["info"]["measurement_of"] == f"m:{record['chosen']}" and own["digest"] == probe["digest"]
    assert own["metrics"] == {k: probe["metrics"][k] for k in ("ppl", "tokens_scored", "kld", "top1")}
    assert own["metrics"]["kld"] == row["kld"]
    # the stored file is the probed one, byte for byte (quantized again by the selection, sha256 checked)
    (probed,) = probe["info"]["probed_files"]
    assert probed["sha256"] == next(f["sha256"] for f in manifest["files"] if f["path"] == "model.gguf")
    assert probe["metrics"]["gguf_bytes"] == probed["size"] == manifest["metrics"]["gguf_bytes"]
    assert record["command"].startswith("llama-quantize --imatrix") and "--tensor-type" in record["command"]
    # the file holds the chosen types, as llama.cpp wrote them
    import re

    import gguf

    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(obj / "model.gguf")).tensors}
    for t in record["tensor_types"]:
        hit = [n for n in written if re.search(t["pattern"], n)]
        assert hit and all(written[n] == t["type"] for n in hit)
    # no probe left its file: the store's only GGUFs are the conversion, the stock variant and the search's
    # artifact (a probe stores its measurement alone), and no step's scratch is left in tmp/
    probes = [n for n in steps if n.startswith("probe[mix~")]
    assert len(probes) == 1 + 17 + 2   # base, 8 groups × (Q4_0, Q5_0) and ffn_down × Q2_K, 2 finalists
    for name in probes:
        hit = st.lookup(steps[name]["key"])
        assert sorted(f["path"] for f in hit.record["files"]) == ["divergence.json", "perplexity.json"], name
    holders = {st.lookup(steps[n]["key"]).path for n in ("gguf-convert[f16]", "quantize[q4km]", "quantize[mix]")}
    assert {p.parent for p in gguf_files(store)} == holders
    assert not [p for p in (store / "tmp").rglob("*") if p.is_file()]
    # the report plots KLD vs size with every measured candidate beside the stock type
    from qbuild import api

    page = api.report("gsearch", store=store)
    assert "KLD vs size" in page and "mix~cand0" in page and ">q4km<" in page


@needs_llama
@pytest.mark.slow
def test_the_artifact_is_the_file_the_search_stored_before_probes(searched, tiny_model_dir):
    """What the search stores is what it stored when every candidate was a whole stored file: an ordinary gguf
    variant with the chosen types (what a candidate's quantize step was) gives the same bytes, and its own
    perplexity step (what measured a finalist) the same numbers as the chosen probe."""
    store, steps = searched["store"], searched["steps"]
    st = Store(store)
    chosen = json.loads((st.object_dir(searched["mix"]["digest"]) / "manifest.json").read_text())["info"]["search"]
    data = recipe_for(tiny_model_dir, store, SEARCH)
    data["variants"] = [{"name": "plain", "method": "gguf", "type": "Q8_0", "imatrix": True,
                         "tensor_types": chosen["tensor_types"]}]
    rc, summary = run_api(write_recipe(searched["root"] / "plain.yaml", data))
    assert rc == 0, summary["steps"]
    plain = {s["name"]: s for s in summary["steps"]}
    stored = st.lookup(plain["quantize[plain]"]["key"]).record
    artifact = st.lookup(steps["quantize[mix]"]["key"]).record
    def sha256(record):
        return {f["path"]: f["sha256"] for f in record["files"]}["model.gguf"]

    assert sha256(stored) == sha256(artifact)
    probe = st.lookup(steps[f"probe[mix~cand{chosen['chosen']}]"]["key"]).record
    measured = st.lookup(plain["perplexity[plain]"]["key"]).record
    assert measured["metrics"] == {k: probe["metrics"][k] for k in measured["metrics"]}
    assert probe["metrics"]["gguf_bytes"] == stored["metrics"]["size_bytes"]


@needs_llama
@pytest.mark.slow
def test_a_probe_that_fails_leaves_no_file(searched, tiny_model_dir, monkeypatch):
    """A probe whose measurement fails (injected) after its quantization wrote the file: the step fails and its
    scratch file is gone (removed by the probe itself, before the executor drops the step's folder); one that
    succeeds leaves none either and stores its measurement only."""
    from qbuild.contract.step import StepContext
    from qbuild.evaluate import quality
    from qbuild.quantize.gguf import probe as gguf_probe

    store, steps = searched["store"], searched["steps"]
    st = Store(store)
    plan = plan_steps(searched["root"], recipe_for(tiny_model_dir, store, SEARCH))
    step = plan["probe[mix~attn_q@Q4_0]"]
    hits = {role: st.lookup(s.key) for role, s in step.inputs.items()}

    def context(name):
        build = store / "tmp" / f"probe-test-{name}"
        (build / "out").mkdir(parents=True)
        return StepContext(params=json.loads(json.dumps(step.params)), inputs={r: h.path for r, h in hits.items()},
                           input_manifests={r: h.record for r, h in hits.items()}, out=build / "out", threads=1,
                           device="cpu", step_name=step.name, store_root=store)

    seen = []

    def fails(ctx, model):
        seen.extend(Path(model).iterdir())   # the file the quantization wrote, in the scratch, not in out/
        raise RuntimeError("injected: the measurement failed")

    ctx = context("fails")
    monkeypatch.setattr(quality, "measure", fails)
    with pytest.raises(RuntimeError, match="injected"):
        gguf_probe.run_probe(ctx)
    assert [p.name for p in seen] == ["model.gguf"] and seen[0].parent == gguf_probe.scratch_dir(ctx)
    assert not seen[0].exists() and not gguf_probe.scratch_dir(ctx).exists() and not list(ctx.out.iterdir())
    monkeypatch.undo()
    ctx = context("works")
    result = gguf_probe.run_probe(ctx)
    assert not gguf_probe.scratch_dir(ctx).exists()
    assert sorted(p.name for p in ctx.out.iterdir()) == ["divergence.json", "perplexity.json"]
    stored = st.lookup(steps["probe[mix~attn_q@Q4_0]"]["key"]).record   # the same probe, built by the run
    assert result["metrics"] == stored["metrics"] and result["info"]["probed_files"] == stored["info"]["probed_files"]


@needs_llama
@pytest.mark.slow
def test_the_selection_refuses_a_file_its_probe_did_not_measure(searched, tiny_model_dir):
    """The selection quantizes the chosen candidate again and keeps it only if it has the sha256 its probe recorded
    (llama.cpp is deterministic, so it does; the run's artifact is rebuilt bit for bit here): given a record whose
    sha256 is not the file's, it fails in one line (a failed step's folder is never published)."""
    from qbuild.contract.step import StepContext
    from qbuild.quantize.gguf.search import run_select

    store = searched["store"]
    st = Store(store)
    step = plan_steps(searched["root"], recipe_for(tiny_model_dir, store, SEARCH))["quantize[mix]"]
    hits = {role: st.lookup(s.key) for role, s in step.inputs.items()}
    manifests = {r: json.loads(json.dumps(h.record)) for r, h in hits.items()}

    def select(name, manifests):
        build = store / "tmp" / f"select-test-{name}"
        (build / "out").mkdir(parents=True)
        ctx = StepContext(params=json.loads(json.dumps(step.params)), inputs={r: h.path for r, h in hits.items()},
                          input_manifests=manifests, out=build / "out", threads=1, device="cpu",
                          step_name=step.name, runtime_args={"variant": "mix"}, store_root=store)
        return ctx, run_select(ctx)

    ctx, result = select("same", manifests)   # as the run did: the stored artifact's bytes
    stored = st.lookup(step.key)
    assert result["info"] == stored.record["info"] and result["metrics"] == stored.record["metrics"]
    assert (ctx.out / "model.gguf").read_bytes() == (stored.path / "model.gguf").read_bytes()
    chosen = result["info"]["search"]["chosen"]
    manifests[f"m:{chosen}"]["info"]["probed_files"][0]["sha256"] = "0" * 64
    with pytest.raises(RuntimeError, match=r"^search for mix: the chosen candidate quantized again \(\w{12}, \d+ "
                                           r"bytes\) is not the file its probe measured \(000000000000, \d+ bytes\)"
                       ) as err:
        select("tampered", manifests)
    assert "\n" not in str(err.value)


@needs_llama
@pytest.mark.slow
def test_a_second_budget_reuses_every_probe(searched, tiny_model_dir):
    """The same recipe again builds nothing; another budget builds only the allocation, its finalists' probes, the
    selection and the variant's evaluation: no sensitivity point is probed again."""
    store = searched["store"]
    other = rerun_then_another_budget(searched["recipe"], recipe_for(tiny_model_dir, store,
                                                                     {**SEARCH, "max_size_mb": 35.5}))
    assert {v["variant"]: v for v in other["variants"]}["mix"]["size_bytes"] <= 35.5e6
    status = {s["name"]: s["status"] for s in other["steps"]}
    sensitivity = [n for n in status if n.startswith("probe[mix~") and "cand" not in n]
    assert len(sensitivity) == 18 and all(status[n] == "cached" for n in sensitivity)
    assert sorted(n for n, v in status.items() if v == "built") == [
        "gguf-search-allocate[mix]", "perplexity[mix]", "probe[mix~cand0]", "probe[mix~cand1]", "quantize[mix]"]
    from qbuild import api

    _, shown = api.show("gsearch/mix", store=store)
    assert shown["rebuild_command"].startswith("llama-quantize --imatrix imatrix.gguf --tensor-type")


@needs_llama
@pytest.mark.slow
def test_a_budget_no_mix_reaches_fails_in_one_line(tiny_model_dir, tmp_path):
    """A size budget below what the smallest candidate types reach: the run (the CLI, as a user runs it) exits
    non-zero with one line naming the variant, the budget and the smallest reachable size, and no traceback; the
    sensitivity measurements stay stored, so a larger budget reuses them."""
    import subprocess
    import sys

    store = tmp_path / "store"
    data = recipe_for(tiny_model_dir, store, {"max_size_mb": 5, "types": ["Q4_0"], "max_candidates": 1},
                      imatrix=False)
    data["variants"] = data["variants"][1:]   # the search alone
    recipe = write_recipe(tmp_path / "r.yaml", data)
    done = subprocess.run([sys.executable, "-m", "qbuild", "run", str(recipe)], capture_output=True, text=True,
                          timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in out, out
    st = Store(store)
    rc, summary = run_api(recipe)
    assert rc != 0
    steps = {s["name"]: s for s in summary["steps"]}
    error = steps["gguf-search-allocate[mix]"]["error"]
    assert "\n" not in error and " ".join(error.split()) in " ".join(out.split()), (error, out)   # what the CLI said
    import re

    m = re.search(r"search for mix: no mix of its types meets max_size_mb 5: the smallest they reach is ([\d.]+) MB "
                  r"\(([\d.]+) bpw, KLD ([\d.]+) predicted\); raise max_size_mb or add smaller types", error)
    assert m, error
    smallest = float(m.group(1))
    # every group at Q4_0 (~4.5 bpw) but the norms: well above the budget, well below the Q8_0 base
    base_mb = st.lookup(steps["probe[mix~base]"]["key"]).record["metrics"]["gguf_bytes"] / 1e6
    assert 5 < smallest < base_mb * 0.75, (smallest, base_mb)
    assert steps["probe[mix~attn_q@Q4_0]"]["status"] == "cached"   # measured once, kept


@needs_llama
def test_plan_with_a_llama_perplexity_base_file(tiny_model_dir, tmp_path):
    """With evaluation.kld_base the search measures against the file (its tokens are the windows), on its first
    sensitivity_windows chunks for the sensitivity and on all of them for the finalists."""
    import numpy as np

    from qbuild.evaluate.llamacpp_kld import write_kld_base

    n_ctx, chunks = 256, 4
    write_kld_base(tmp_path / "base.kld", np.zeros(chunks * n_ctx, dtype=np.int32), n_ctx,
                   [np.zeros((n_ctx - 1 - n_ctx // 2, 16), dtype=np.float32)] * chunks)
    data = recipe_for(tiny_model_dir, tmp_path / "s", {"max_size_mb": 36, "types": ["Q4_0"]})
    data["evaluation"] = {"baseline": True, "kld": True, "kld_base": str(tmp_path / "base.kld"),
                          "perplexity": {"protocol": "llama.cpp", "context_length": n_ctx, "max_windows": chunks}}
    steps = plan_steps(tmp_path, data)
    sens, final = steps["probe[mix~attn_q@Q4_0]"], steps["probe[mix~cand0]"]
    assert sens.inputs["kld_base"].name == final.inputs["kld_base"].name == "kld-base"
    assert sens.inputs["reference"].runner.endswith("reference_from_kld_base")
    assert sens.params["measure"]["max_windows"] == 2
    assert final.inputs["reference"].key == steps["perplexity[q4km]"].inputs["reference"].key


def test_a_variant_without_search_keeps_its_earlier_key():
    """`search:` left out is not in the step's params: stock GGUF variants built before the search existed stay hits."""
    from qbuild.quantize.gguf import GGUFVariant

    params = GGUFVariant(name="q4km", method="gguf", type="Q4_K_M").quant_params()
    assert "search" not in params and params["type"] == "Q4_K_M"
