"""Issue 47, item 3: a 16-bit GGUF is imported 16-bit (`model.dtype: auto`), so a quantized variant's untouched tensors
(embeddings, norms, head) are not widened to float32; the evaluation still runs in float32."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import model_families as mf
import pytest

from helpers import run_api, write_recipe


@pytest.mark.slow   # ~1 min: a conversion, the import with its check, RTN and two evaluations
def test_an_f16_gguf_gives_an_f16_baseline_and_a_w4a16_artifact_without_float32(models_cache, tmp_path, monkeypatch):
    from safetensors import safe_open

    from qbuild.models.llamacpp_toolchain import converter_command, converter_env

    source = mf.built(mf.BY_NAME["llama3"], models_cache / "families")
    monkeypatch.setenv("QBUILD_LLAMA_CPP_DIR", str(mf.registered_converter({"llama3": source}, tmp_path)))
    gguf = tmp_path / "model.gguf"
    subprocess.run(converter_command(source, gguf, "f16"), check=True, capture_output=True, env=converter_env(),
                   timeout=600)
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "f16imp", "model": {"source": "gguf", "path": str(gguf)},
        "variants": [{"name": "w4a16", "method": "rtn", "bits": 4, "group_size": 64}],
        "evaluation": {"perplexity": {"context_length": 128, "max_windows": 2}, "kld": True},
        "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}})
    rc, summary = run_api(recipe)
    assert rc == 0, summary
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


def _object(tmp_path: Path, variant: str) -> Path:
    """The stored object of `variant` (the baseline is the import: ref f16imp/base)."""
    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    ref = "f16imp/base:latest" if variant == "baseline" else f"f16imp/{variant}:latest"
    return store.object_dir(store.resolve(ref))
