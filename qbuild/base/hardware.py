"""Cheap probes of the machine a step runs on: its NVIDIA GPU and CPU architecture.

Neither imports a GPU library: gpu() reads `nvidia-smi --query-gpu=name,compute_cap,driver_version
--format=csv,noheader` once per process. Build targets (their toolchain keys), GPU runtimes and servers
(whether this machine can run them) and the executor (which GPUs steps may use) all ask this module.

Test hooks (tests only; documented in docs/tensorrt-llm.md):
  QBUILD_FAKE_GPU="NAME:SM:DRIVER" (e.g. "NVIDIA H100 80GB HBM3:9.0:550.54.15") or "none"
  QBUILD_FAKE_ARCH="aarch64" (the host's CPU architecture; default platform.machine())
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache

FAKE_GPU = "QBUILD_FAKE_GPU"
FAKE_ARCH = "QBUILD_FAKE_ARCH"


@dataclass(frozen=True)
class GPU:
    name: str
    sm: str          # compute capability, "9.0"
    driver: str
    count: int = 1

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


def gpu_free_bytes(index: int = 0) -> int | None:
    """Free memory of GPU `index` (nvidia-smi's memory.free), or None without nvidia-smi (or a fake GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None or os.environ.get(FAKE_GPU) is not None:
        return None
    try:
        out = subprocess.run([exe, f"--id={index}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=15)
        return int(out.stdout.split()[0]) << 20 if out.returncode == 0 else None   # MiB
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def gpu_devices() -> list[str]:
    """The GPUs steps may use: CUDA_VISIBLE_DEVICES if set, else those nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip() not in ("", "-1")]
    found = gpu()
    return [str(i) for i in range(found.count)] if found else []


def host_arch() -> str:
    """The CPU architecture engines are built on and for (x86_64, aarch64 on GH200/GB200 hosts)."""
    import platform

    return os.environ.get(FAKE_ARCH) or platform.machine()


# the vector extensions CPU inference kernels are chosen by (vLLM's CPU build, oneDNN), widest first
# VNNI (AVX-512 or AVX) is named too: without it oneDNN's INT8 GEMM saturates 16-bit sums (vLLM's CPU W8A8 computes
# something else: docs/serving.md, "vLLM on a CPU")
ISA_FLAGS = (("amx_tile", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"), ("avx2", "avx2"),
             ("asimd", "neon"))
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


@lru_cache(maxsize=1)
def cpu_isa() -> str:
    """The CPU's widest vector extensions as kernels pick them, e.g. "amx+avx512bf16+avx512+vnni" ("" if unknown): CPU
    engines choose kernels by it, so numbers measured under one ISA are not another's."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            head = f.read(1 << 16).decode("ascii", "replace")   # the first processor's entry is all we need
    except OSError:
        return ""
    flags = next((line.split(":", 1)[1].split() for line in head.splitlines()
                  if line.startswith(("flags", "Features")) and ":" in line), [])
    return isa_of(flags)


def isa_of(flags) -> str:
    """cpu_isa's name for a CPU with these /proc/cpuinfo flags."""
    names = [name for flag, name in ISA_FLAGS if flag in flags]
    return "+".join(names + ["vnni"] * any(flag in flags for flag in VNNI_FLAGS))


def sm_tag(sm: str) -> str:
    """'9.0' -> 'sm90' (the usual spelling in refs and messages)."""
    return "sm" + sm.replace(".", "")


def machine_facts() -> dict:
    """Facts about the machine and environment a step ran in that its key does not hold (recorded in manifests)."""
    import platform

    from qbuild.base.fingerprint import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(), "os": platform.platform(),
            "python": platform.python_version()}


def clear_cache() -> None:
    _probe_gpu.cache_clear()
