"""Cheap probes of the two facts a TensorRT-LLM engine depends on: the GPU and the TensorRT-LLM install.

Neither probe imports tensorrt_llm (its import needs libcuda and takes seconds):
  gpu()        `nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader`
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
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache

ENV_PYTHON = "QBUILD_TRTLLM_PYTHON"
FAKE_GPU = "QBUILD_FAKE_GPU"
FAKE_TRTLLM = "QBUILD_FAKE_TRTLLM"
FAKE_ARCH = "QBUILD_FAKE_ARCH"


@dataclass(frozen=True)
class GPU:
    name: str
    sm: str          # compute capability, "9.0"
    driver: str
    count: int = 1

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrtllmEnv:
    python: str      # the interpreter that has tensorrt_llm ("" = qbuild's own)
    tensorrt_llm: str | None   # None: installed, but the version is not in its package metadata
    tensorrt: str | None
    cuda: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def parse_nvidia_smi(text: str) -> GPU | None:
    """First GPU of `nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader`."""
    rows = [r for r in (line.strip() for line in text.splitlines()) if r]
    if not rows:
        return None
    name, sm, driver = (c.strip() for c in rows[0].rsplit(",", 2))
    return GPU(name, sm, driver, len(rows))


def gpu() -> GPU | None:
    fake = os.environ.get(FAKE_GPU)
    if fake is not None:
        if fake.strip().lower() in ("", "none"):
            return None
        name, sm, driver = fake.rsplit(":", 2)
        return GPU(name, sm, driver)
    return _probe_gpu()


@lru_cache(maxsize=1)
def _probe_gpu() -> GPU | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else None


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
        cmd = [*python.split(), "-c", PROBE_SCRIPT] if " " in python else [python, "-c", PROBE_SCRIPT]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    if not data.get("found"):
        return None
    # an unreadable version stays None: the engine target then plans needs-gpu, never keys on a placeholder
    return TrtllmEnv(python, data.get("tensorrt_llm") or None, data.get("tensorrt") or None, data.get("cuda") or None)


def host_arch() -> str:
    """The CPU architecture engines are built on and for (x86_64, aarch64 on GH200/GB200 hosts)."""
    import platform

    return os.environ.get(FAKE_ARCH) or platform.machine()


def sm_tag(sm: str) -> str:
    """'9.0' -> 'sm90' (the usual spelling in refs and messages)."""
    return "sm" + sm.replace(".", "")


def clear_cache() -> None:
    _probe_gpu.cache_clear()
    _probe_trtllm.cache_clear()
