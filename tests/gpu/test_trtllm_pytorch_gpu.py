"""GPU suite for the `trtllm-pytorch` target: the package (ModelOpt FP8 HF export + extra_llm_api_options.yaml)
loads in TensorRT-LLM's PyTorch backend (the current line, after 1.2.x) with those options, and generates.

Needs an NVIDIA GPU and $QBUILD_TRTLLM_PYTORCH_PYTHON: an interpreter with TensorRT-LLM 1.3 or newer
(tests/gpu/run.sh points it at qbuild's `tensorrt-llm` backend environment). pytest runs in qbuild's environment;
TensorRT-LLM only in that interpreter. Skipped, with the reason, anywhere else. NOT RUN where it was written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from qbuild.envs import tensorrt_llm as trtllm_env

ENV_PYTHON = "QBUILD_TRTLLM_PYTORCH_PYTHON"
LOAD_SCRIPT = r"""
import json, sys, yaml
from tensorrt_llm import LLM, SamplingParams
pkg = sys.argv[1]
opts = yaml.safe_load(open(f"{pkg}/extra_llm_api_options.yaml"))
llm = LLM(model=pkg, **opts)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
print(json.dumps({"text": out[0].outputs[0].text, "options": opts}))
getattr(llm, "shutdown", lambda: None)()
"""


def unavailable() -> str:
    if trtllm_env.gpu() is None:
        return "no NVIDIA GPU (nvidia-smi)"
    python = os.environ.get(ENV_PYTHON)
    env = trtllm_env.trtllm(python) if python else None
    if env is None or trtllm_env_line(env.tensorrt_llm) < (1, 3):
        return f"needs ${ENV_PYTHON}: an interpreter with TensorRT-LLM 1.3 or newer (tests/gpu/run.sh creates one)"
    return ""


def trtllm_env_line(version: str | None) -> tuple[int, int]:
    from qbuild.targets.tensorrt_llm import version_line

    return version_line(version or "") or (0, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "ready")]


def test_package_loads_in_the_pytorch_backend(tmp_path, smollm2_dir):
    from qbuild.artifacts.store import Store

    recipe = {"name": "gpu-pt", "model": {"source": "local", "path": str(smollm2_dir)},
              "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 16, "seq_len": 256},
              "variants": [{"name": "fp8-hf", "method": "modelopt", "scheme": "fp8", "export": "hf"}],
              "targets": [{"type": "trtllm-pytorch", "llm_api_options": {
                  "max_batch_size": 8, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}}],
              "evaluation": {"baseline": False, "perplexity": None}, "store": {"path": str(tmp_path / "store")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = subprocess.run([sys.executable, "-m", "qbuild", "run", str(path), "--json"], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    step = next(s for s in json.loads(out.stdout)["steps"] if s["name"] == "package[fp8-hf.trtllm-pytorch]")
    package = Store(tmp_path / "store").object_dir(step["digest"])
    run = subprocess.run([*os.environ[ENV_PYTHON].split(), "-c", LOAD_SCRIPT, str(package)], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"[gpu-report] trtllm-pytorch fp8-hf smollm2: generated {result['text']!r}")
    assert result["text"].strip()
