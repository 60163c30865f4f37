"""The TensorRT-LLM environment: cheap probes of the two facts a TensorRT-LLM engine depends on, the GPU
(qbuild.base.hardware) and the TensorRT-LLM install, and the check, where a step runs, that they are still the ones
its key was computed for. What the `tensorrt-llm` target (qbuild/targets/tensorrt_llm.py, which builds engines) and
the `tensorrt-llm` runtime (qbuild/runtimes/tensorrt_llm.py, which evaluates them) both need, exported to them by
qbuild.plugin_services as `trtllm_env`.

Neither probe imports tensorrt_llm (its import needs libcuda and takes seconds):
  gpu()        qbuild.base.hardware.gpu(): `nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader`
  trtllm(py)   versions read from package metadata, in qbuild's own Python (find_spec) or in a
               configured one (recipe `python:` or QBUILD_TRTLLM_PYTHON, e.g. a wrapper that runs
               python inside NVIDIA's release container with the same paths mounted)
Both are memoized per process, so planning stays fast.

Test hooks (tests only; documented in docs/tensorrt-llm.md):
  QBUILD_FAKE_GPU="NAME:SM:DRIVER" (e.g. "NVIDIA H100 80GB HBM3:9.0:550.54.15") or "none"
  QBUILD_FAKE_TRTLLM="TRTLLM:TENSORRT:CUDA" (e.g. "1.2.1:10.13.3.9:13.0", "1.2.1::13.0" for a TensorRT
                     whose version cannot be read) or "none"
  QBUILD_FAKE_ARCH="aarch64" (the host's CPU architecture; default platform.machine())
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache

from qbuild.base import hardware
from qbuild.envs import interpreter

# the machine facts an engine is keyed on come from the core's probe (one nvidia-smi call per process), under the
# names the TensorRT-LLM modules (and their tests) use
FAKE_ARCH, FAKE_GPU, GPU = hardware.FAKE_ARCH, hardware.FAKE_GPU, hardware.GPU
gpu, host_arch, sm_tag = hardware.gpu, hardware.host_arch, hardware.sm_tag

ENV_PYTHON = "QBUILD_TRTLLM_PYTHON"
FAKE_TRTLLM = "QBUILD_FAKE_TRTLLM"


@dataclass(frozen=True)
class TrtllmEnv:
    python: str      # the interpreter that has tensorrt_llm ("" = qbuild's own)
    tensorrt_llm: str | None   # None: installed, but the version is not in its package metadata
    tensorrt: str | None
    cuda: str | None

    def as_dict(self) -> dict:
        return asdict(self)


# Runs in the TensorRT-LLM environment's interpreter: stdlib only, never imports tensorrt_llm or torch.
PROBE_SCRIPT = r"""
import importlib.util, json, re
from importlib import metadata
def ver(*names):
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return None
out = {"found": importlib.util.find_spec("tensorrt_llm") is not None}
out["tensorrt_llm"] = ver("tensorrt_llm", "tensorrt-llm")
out["tensorrt"] = ver("tensorrt", "tensorrt-cu13", "tensorrt_cu13", "tensorrt-cu12", "tensorrt_cu12", "tensorrt-libs")
cuda = None
spec = importlib.util.find_spec("torch")
if spec and spec.origin:
    try:
        src = open(spec.origin.rsplit("/", 1)[0] + "/version.py").read()
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", src, re.M)
        cuda = m.group(1) if m else None
    except OSError:
        pass
out["cuda"] = cuda or ver("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12")
print(json.dumps(out))
"""


def configured_python(recipe_python: str | None = None) -> str | None:
    return recipe_python or os.environ.get(ENV_PYTHON) or None


def trtllm(python: str | None = None) -> TrtllmEnv | None:
    """The TensorRT-LLM install to build with, or None. python=None: qbuild's own interpreter."""
    fake = os.environ.get(FAKE_TRTLLM)
    if fake is not None:
        if fake.strip().lower() in ("", "none"):
            return None
        t, trt, cuda = (part or None for part in fake.split(":"))
        return TrtllmEnv(python or "", t, trt, cuda)
    return _probe_trtllm(python or "")


@lru_cache(maxsize=8)
def _probe_trtllm(python: str) -> TrtllmEnv | None:
    if not python:
        import importlib.util

        if importlib.util.find_spec("tensorrt_llm") is None:
            return None
        cmd = [sys.executable, "-c", PROBE_SCRIPT]
    else:
        cmd = [*interpreter(python), "-c", PROBE_SCRIPT]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    if not data.get("found"):
        return None
    # an unreadable version stays None: the engine target then plans needs-gpu, never keys on a placeholder
    return TrtllmEnv(python, data.get("tensorrt_llm") or None, data.get("tensorrt") or None, data.get("cuda") or None)


def clear_cache() -> None:
    hardware.clear_cache()
    _probe_trtllm.cache_clear()


# --- the facts an engine is keyed by, as this machine has them ----------------------------------------------------
# what enters an engine's key besides its settings (qbuild/targets/trtllm_select.py: the pull-time match)
ENV_KEYS = ("gpu.sm", "gpu.name", "host.arch", "tensorrt_llm", "tensorrt", "cuda")


def probed_facts(gpu, env) -> dict:
    """The key facts as this machine has them (None where there is no GPU / TensorRT-LLM or a fact is unreadable)."""
    return {"gpu.sm": gpu.sm if gpu else None, "gpu.name": gpu.name if gpu else None,
            "host.arch": host_arch(),
            "tensorrt_llm": env.tensorrt_llm if env else None, "tensorrt": env.tensorrt if env else None,
            "cuda": env.cuda if env else None}


def current_environment(runtime_args: dict) -> tuple:
    """(GPU, TensorRT-LLM env) of this machine; refuses to run where they differ from the planned key."""
    gpu_now, env = gpu(), trtllm(runtime_args.get("python"))
    now = probed_facts(gpu_now, env)
    expected = runtime_args["expected"]
    changed = [f"{k}: planned {expected.get(k)}, found {now[k]}" for k in ENV_KEYS if now[k] != expected.get(k)]
    if changed:
        raise RuntimeError("the TensorRT-LLM environment is not the one the key was computed for: " + "; ".join(changed))
    return gpu_now, env
