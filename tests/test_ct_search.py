"""`search:` on an rtn variant (qbuild/quantize/llmcompressor/search.py): per-layer W4A16 / W8A16 mixes for
compressed-tensors, the schema, the plan's steps and keys, and a real search on the 2-layer SmolLM2 through
llm-compressor."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from qbuild.artifacts.store import Store
from qbuild.errors import RecipeError
from qbuild.pipeline.plan import build_steps
from qbuild.planning.recipe import parse_recipe
from qbuild.quantize.llmcompressor.rtn import RTNVariant
from qbuild.quantize.llmcompressor.search import assignment, module_groups

from helpers import rerun_then_another_budget, run_api, write_recipe

needs_lc = pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None, reason="needs qbuild[llmcompressor]")


def variant(**kw):
    return RTNVariant.model_validate({"name": "v", "method": "rtn", "group_size": 64, **kw})


def test_schema():
    v = variant(search={"max_bits": 6})
    assert v.search.objective == "min_kld" and v.search.schemes == ["W8A16", "W4A16"]
    assert variant(search={"max_kld": 0.01}).search.objective == "min_size"
    assert variant(search={"max_bits": 5, "schemes": ["w4a16"]}).search.schemes == ["W8A16", "W4A16"]
    assert "search" not in variant().quant_params()   # a plain rtn variant keeps its earlier key
    for bad, words in [({"search": {}}, "exactly one budget"),
                       ({"search": {"max_bits": 5, "max_kld": 0.1}}, "exactly one budget"),
                       ({"search": {"max_kld": 0.1, "objective": "min_kld"}}, "use min_size"),
                       ({"search": {"max_bits": 5, "schemes": ["W3A16"]}}, "the schemes are")]:
        with pytest.raises(ValidationError, match=words):
            variant(**bad)


def test_groups_are_vllm_fused_units():
    groups = module_groups(4, 2)
    assert [g["group"] for g in groups[:4]] == ["attn_qkv.b0-1", "attn_o.b0-1", "mlp_gate_up.b0-1", "mlp_down.b0-1"]
    qkv = groups[0]["target"].removeprefix("re:")
    hits = [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
            if re.match(qkv, f"model.layers.{i}.self_attn.{p}")]
    assert hits == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj")]
    assert not re.match(qkv, "model.layers.10.self_attn.q_proj")
    # one config group per scheme; every module in exactly one
    assign = assignment(groups, {"attn_o.b2-3": "W4A16", "mlp_down.b0-1": "W4A16"})
    assert [a["scheme"] for a in assign] == ["W8A16", "W4A16"] and sum(len(a["targets"]) for a in assign) == 8


def allocate_ctx(tmp_path, budget: dict, candidates=2):
    """An allocation step's context over made-up measurements: 4 groups, W4A16 saves 100-400 bytes and adds KLD."""
    from qbuild.contract.step import StepContext

    groups = module_groups(2, 1)
    saved = {"attn_qkv": 300, "attn_o": 100, "mlp_gate_up": 400, "mlp_down": 200}
    dkld = {"attn_qkv": 0.03, "attn_o": 0.001, "mlp_gate_up": 0.01, "mlp_down": 0.02}
    manifests = {"base": {"metrics": {"quantized_weight_bytes": 2000, "quantized_weights": 2000}},
                 "base_kld": {"metrics": {"kld": 0.001}}}
    for g in groups:
        manifests[f"q:{g['group']}@W4A16"] = {"metrics": {"quantized_weight_bytes": 2000 - saved[g["group"]]}}
        manifests[f"m:{g['group']}@W4A16"] = {"metrics": {"kld": 0.001 + dkld[g["group"]]}}
    params = {"budget": budget, "objective": "min_size" if "max_kld" in budget else "min_kld",
              "groups": [{"group": g["group"], "target": g["target"], "schemes": ["W4A16"]} for g in groups],
              "base_scheme": "W8A16", "candidates": candidates}
    return StepContext(params=params, inputs={}, input_manifests=manifests, out=tmp_path, threads=1, device="cpu",
                       step_name="ct-search-allocate[v]")


def w4(candidate) -> set:
    return {g for g, s in candidate["groups"].items() if s == "W4A16"}


def test_allocation_meets_the_budget(tmp_path):
    from qbuild.quantize.llmcompressor.search import ALLOCATION_FILE, run_allocate

    run_allocate(allocate_ctx(tmp_path, {"max_bits": 6.0}))   # 1500 bytes of 2000: save ≥ 500
    record = json.loads((tmp_path / ALLOCATION_FILE).read_text())
    best = record["candidates"][0]
    # the exact optimum: gate_up (400, 0.01) + o (100, 0.001) saves 500 bytes for ΔKLD 0.011
    assert w4(best) == {"attn_o", "mlp_gate_up"}
    assert best["predicted_weight_bits"] <= 6.0 and best["predicted_kld"] == pytest.approx(0.012)
    assert all(c["predicted_weight_bits"] <= 6.0 for c in record["candidates"])
    run_allocate(allocate_ctx(tmp_path, {"max_kld": 0.025}))  # least bits with ΔKLD ≤ 0.024
    best = json.loads((tmp_path / ALLOCATION_FILE).read_text())["candidates"][0]
    assert w4(best) == {"attn_o", "mlp_gate_up"} and best["predicted_kld"] <= 0.025
    with pytest.raises(RuntimeError, match=r"no allocation meets max_bits 3.0: the smallest mix .* averages 4.000 bits"):
        run_allocate(allocate_ctx(tmp_path, {"max_bits": 3.0}))


def recipe_for(model: Path, store: Path, search: dict, **extra) -> dict:
    return {"name": "ctsearch", "model": {"source": "local", "path": str(model)},
            "variants": [{"name": "w4", "method": "rtn", "bits": 4, "group_size": 64},
                         {"name": "w8", "method": "rtn", "bits": 8, "group_size": 64},
                         {"name": "mix", "method": "rtn", "group_size": 64, "search": search, **extra}],
            "evaluation": {"baseline": True, "kld": True, "perplexity": {"context_length": 256, "max_windows": 2}},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


def plan_steps(tmp_path, data) -> dict:
    return {s.name: s for s in build_steps(parse_recipe(data), tmp_path).steps}


@needs_lc
def test_plan_shape_and_keys(tiny_model_dir, tmp_path):
    search = {"max_bits": 6, "max_candidates": 2}
    a = plan_steps(tmp_path, recipe_for(tiny_model_dir, tmp_path / "s", search))
    b = plan_steps(tmp_path, recipe_for(tiny_model_dir, tmp_path / "s", {**search, "max_bits": 5}))
    sens = sorted(n for n in a if n.startswith("quantize[mix~") and "cand" not in n and "base" not in n)
    assert sens == [f"quantize[mix~{g}@W4A16]" for g in ("attn_o", "attn_qkv", "mlp_down", "mlp_gate_up")]
    for name in sens + [n.replace("quantize", "perplexity") for n in sens] + ["quantize[mix~base]",
                                                                              "perplexity[mix~base]"]:
        assert a[name].key == b[name].key, name          # a second budget reuses every measurement
    for name in ("ct-search-allocate[mix]", "quantize[mix~cand0]", "quantize[mix]"):
        assert a[name].key != b[name].key
    final = a["quantize[mix]"]
    assert final.variant == "mix" and final.format == "compressed-tensors" and final.kind == "ct-search-select"
    assert sorted(final.inputs) == ["allocation", "m:0", "m:1", "q:0", "q:1"]
    assert a["perplexity[mix~attn_o@W4A16]"].params["max_windows"] == 2 == a["perplexity[mix~cand0]"].params["max_windows"]
    assert "perplexity[mix]" in a   # the artifact is evaluated like any variant
    base = a["quantize[mix~base]"].params["assign"]
    assert [x["scheme"] for x in base] == ["W8A16"] and len(base[0]["targets"]) == 4
    assert "search" not in a["quantize[w4]"].params   # plain rtn variants keep their keys


@needs_lc
def test_planning_a_search_imports_no_torch(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    recipe = write_recipe(tmp_path / "r.yaml", recipe_for(tiny_model_dir, tmp_path / "s", {"max_bits": 6}))
    code = ("import sys, pathlib; from qbuild.pipeline.plan import build_steps; from qbuild.planning.recipe import load_recipe; "
            f"steps = build_steps(load_recipe({str(recipe)!r}), pathlib.Path({str(tmp_path)!r})).steps; "
            "print(len(steps), sorted(m for m in ('torch', 'transformers', 'llmcompressor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, imported = out.stdout.split(" ", 1)
    assert int(count) > 20 and imported.strip() == "[]", out.stdout


@needs_lc
def test_plan_refusals(tiny_model_dir, tmp_path):
    data = recipe_for(tiny_model_dir, tmp_path / "s", {"max_bits": 6})
    data["evaluation"]["kld"] = False
    with pytest.raises(RecipeError, match="evaluation.kld: true"):
        plan_steps(tmp_path, data)
    with pytest.raises(RecipeError, match="remove bits"):
        plan_steps(tmp_path, recipe_for(tiny_model_dir, tmp_path / "s", {"max_bits": 6}, bits=4))
    with pytest.raises(RecipeError, match="sym: true"):
        plan_steps(tmp_path, recipe_for(tiny_model_dir, tmp_path / "s", {"max_bits": 6}, sym=False))


@needs_lc
def test_more_layer_bands_than_layers_is_a_recipe_error(tiny_model_dir, tmp_path):
    """layer_bands above the model's layer count: one line naming the field and what is allowed, exit 2 (it was an
    IndexError while planning; 3 bands of 2 layers quietly planned 2)."""
    from helpers import qbuild

    for bands in (5, 3):
        recipe = write_recipe(tmp_path / "r.yaml", recipe_for(tiny_model_dir, tmp_path / "s",
                                                              {"max_bits": 6, "layer_bands": bands}))
        res = qbuild("plan", recipe)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert f"variants[2].search.layer_bands: {bands} bands of a model with 2 layers: give 1 to 2" in res.stderr
    two = plan_steps(tmp_path, recipe_for(tiny_model_dir, tmp_path / "s", {"max_bits": 6, "layer_bands": 2}))
    assert "quantize[mix~attn_o.b1-1@W4A16]" in two
    with pytest.raises(ValueError, match="a band needs at least one layer"):
        module_groups(2, 5)


# --- a real search ---------------------------------------------------------------------------------------------
@needs_lc
@pytest.mark.slow
def test_search_meets_the_budget_and_gives_a_mixed_checkpoint(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    search = {"max_bits": 6.3, "max_candidates": 2}
    recipe = write_recipe(tmp_path / "r.yaml", recipe_for(tiny_model_dir, store, search))
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    rows = {v["variant"]: v for v in summary["variants"]}
    mix, w4, w8 = rows["mix"], rows["w4"], rows["w8"]
    obj = Store(store).object_dir(mix["digest"])
    manifest = json.loads((obj / "manifest.json").read_text())
    record = manifest["info"]["search"]
    assert manifest["metrics"]["weight_bits"] <= 6.3 and record["weight_bits"] <= 6.3
    assert record["kld"] == pytest.approx(mix["kld"], abs=1e-9)   # the finalist's measurement is the variant's
    # an honest property: more bits than all-W4A16 buy a lower KLD, and W8A16 (more bits again) is lower still
    assert w8["kld"] <= mix["kld"] < w4["kld"], (w8["kld"], mix["kld"], w4["kld"])
    # the checkpoint: one config group per chosen scheme, targets as module regexes, every Linear in exactly one
    qc = json.loads((obj / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and len(qc["config_groups"]) == 2
    assert sorted(g["weights"]["num_bits"] for g in qc["config_groups"].values()) == [4, 8]
    modules = [f"model.layers.{i}.{leaf}" for i in range(2) for leaf in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")]
    for m in modules:
        hits = [name for name, g in qc["config_groups"].items()
                if any(re.match(t.removeprefix("re:"), m) for t in g["targets"])]
        assert len(hits) == 1, (m, hits)
    assert json.loads((obj / "search.json").read_text())["groups"] == record["groups"]
    assert manifest["loads_in"] and "vllm" in manifest["loads_in"]
    # the same recipe again: nothing runs; another budget reuses the sensitivity
    rerun_then_another_budget(recipe, recipe_for(tiny_model_dir, store, {**search, "max_bits": 5.5}))
    # a budget nothing can meet (below all-W4A16) fails with one line naming it
    recipe = write_recipe(tmp_path / "r.yaml", recipe_for(tiny_model_dir, store, {**search, "max_bits": 3.0}))
    rc, failed = run_api(recipe)
    assert rc == 1
    bad = [s for s in failed["steps"] if s["status"] == "failed"]
    assert [s["name"] for s in bad] == ["ct-search-allocate[mix]"]
    assert "no allocation meets max_bits 3.0" in json.dumps(bad[0])
