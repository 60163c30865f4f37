"""Quality under a KV-cache type: evaluation.perplexity.kv_cache_dtype runs each GGUF artifact's llama.cpp pass with
that KV cache (type_k/type_v), against the baseline's full-precision reference. Real runs on the 2-layer SmolLM2."""

from __future__ import annotations

import importlib.util

import pytest

from qbuild.core.recipe import parse_recipe

from helpers import run_api, write_recipe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs qbuild[gguf]")


def recipe(model, store, **perplexity) -> dict:
    return {"name": "kvq", "model": {"source": "local", "path": str(model)},
            "variants": [{"name": "q8", "method": "gguf", "type": "Q8_0"}],
            "evaluation": {"kld": True, "perplexity": {"context_length": 256, "max_windows": 4, "flash_attn": True,
                                                       **perplexity}},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


def test_kv_cache_dtype_costs_show_in_kld_and_keys(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    runs = {}
    for kv in (None, "q8_0", "q4_0"):
        extra = {"kv_cache_dtype": kv} if kv else {}
        rc, summary = run_api(write_recipe(tmp_path / f"{kv}.yaml", recipe(tiny_model_dir, store, **extra)))
        assert rc == 0, summary["steps"]
        runs[kv] = ({s["name"]: s for s in summary["steps"]}, {v["variant"]: v for v in summary["variants"]})
    steps = {kv: s for kv, (s, _) in runs.items()}
    # the reference pass is the same object every time (f16 KV); only the artifact's pass changes key
    assert len({s["reference[baseline]"]["key"] for s in steps.values()}) == 1
    assert steps["q8_0"]["reference[baseline]"]["status"] == "cached"
    assert len({s["perplexity[q8]"]["key"] for s in steps.values()}) == 3
    kld = {kv: rows["q8"]["kld"] for kv, (_, rows) in runs.items()}
    assert kld[None] < kld["q4_0"] and kld["q8_0"] < kld["q4_0"], kld
    assert kld[None] != kld["q8_0"], kld
    from qbuild.artifacts.store import Store

    record = Store(store).manifest(steps["q4_0"]["perplexity[q8]"]["digest"])
    assert record["params"]["kv_cache_dtype"] == "q4_0" and "kv_cache_dtype" not in Store(store).manifest(
        steps[None]["perplexity[q8]"]["digest"])["params"]
    print("KLD of Q8_0 by KV cache type:", kld)


def test_unset_kv_cache_dtype_keeps_old_keys_and_quantized_needs_flash_attn(tiny_model_dir, tmp_path):
    plain = parse_recipe(recipe(tiny_model_dir, tmp_path / "s"))
    assert "kv_cache_dtype" not in plain.evaluation.perplexity.canonical()
    with pytest.raises(Exception, match="kv_cache_dtype q8_0 needs flash_attn: true"):
        parse_recipe(recipe(tiny_model_dir, tmp_path / "s", kv_cache_dtype="q8_0", flash_attn=False))
