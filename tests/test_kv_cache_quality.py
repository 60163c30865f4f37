"""Quality under a KV-cache type: evaluation.perplexity.kv_cache_dtype runs each GGUF artifact's llama.cpp pass with
that KV cache (type_k/type_v), against the baseline's full-precision reference. Real runs on the 2-layer SmolLM2."""

from __future__ import annotations

import importlib.util

import pytest

from qbuild.planning.recipe import parse_recipe

from helpers import run_api, write_recipe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs qbuild[gguf]")


def recipe(model, store, **perplexity) -> dict:
    return {"name": "kvq", "model": {"source": "local", "path": str(model)},
            "variants": [{"name": "q8", "method": "gguf", "type": "Q8_0"}],
            "evaluation": {"kld": True, "perplexity": {"context_length": 256, "max_windows": 4, "flash_attn": True,
                                                       **perplexity}},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


@pytest.mark.slow   # three runs (~50 s); CI keeps the serving config's quantized KV below, which goes the same way
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


def test_serving_config_with_quantized_kv_gets_its_own_kld_and_selection_judges_it(tiny_model_dir, tmp_path):
    """A real run: Q8_0 served by llama-server under the default config and a q4_0 KV cache; the kv4 config's quality
    is its own llama.cpp pass under that cache (against the same f16-KV reference), shown on its serving rows, and a
    max_kld between the two rejects exactly kv4, naming it."""
    from qbuild import api
    from qbuild.models.llamacpp_toolchain import cached_bin_dir

    if cached_bin_dir() is None:
        pytest.skip("llama-server is not built yet (scripts/install.sh builds it)")
    data = recipe(tiny_model_dir, tmp_path / "store", context_length=128, max_windows=2)
    data["evaluation"]["serving"] = {"concurrency": [1], "requests": 2, "warmup": 0, "input_len": 16, "output_len": 4,
                                     "variants": ["q8"], "configs": [{"name": "default"},
                                                                     {"name": "kv4", "kv_cache_dtype": "q4_0"}]}
    rc, summary = run_api(write_recipe(tmp_path / "r.yaml", data))
    assert rc == 0, summary["steps"]
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["perplexity[q8@kv4]"]["status"] == "built" and "perplexity[q8@default]" not in steps
    row = next(v for v in summary["variants"] if v["variant"] == "q8")
    quality = {p["config"]: (p["kld"], p["ppl"], p["delta_ppl_pct"], p["kv_cache_dtype"]) for p in row["serving"]}
    assert quality["default"] == (row["kld"], row["ppl"], row["delta_ppl_pct"], None)   # the variant's own pass
    kld_default, kld_kv4 = quality["default"][0], quality["kv4"][0]
    assert kld_kv4 > kld_default > 0 and quality["kv4"][3] == "q4_0"
    assert quality["kv4"][2] == pytest.approx(100 * (quality["kv4"][1] / summary["variants"][0]["ppl"] - 1))

    from rich.console import Console

    from qbuild.results.summary import render_serving

    console = Console(record=True, width=250)
    render_serving(summary, console)
    table = console.export_text()
    assert "KLD" in table and "ΔPPL %" in table and f"{kld_kv4:.4f}" in table and f"{kld_default:.4f}" in table

    data["selection"] = {"max_kld": (kld_default + kld_kv4) / 2, "objective": "min_kld"}
    out = api.select(write_recipe(tmp_path / "sel.yaml", data))   # `qbuild select --json`, from the store
    assert (out["selected"]["variant"], out["selected"]["config"]) == ("q8", "default")
    assert out["selected"]["kld"] == pytest.approx(kld_default)
    assert [(r["variant"], r["config"]) for r in out["rejected"]] == [("q8", "kv4")]
    assert out["rejected"][0]["why"].startswith(f"kld {kld_kv4:.4g} under config kv4 > ")
    print("KLD of Q8_0 by serving config:", {"default": kld_default, "kv4": kld_kv4})
