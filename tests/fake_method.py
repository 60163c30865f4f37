"""A test-only quantize method (an entry-point plugin, see conftest.py): no torch, controllable.

It writes a file derived from its params and inputs, optionally sleeps (to test locking and
interruption) or fails (to test error handling).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Literal

from qbuild.contract.step import Step, StepContext
from qbuild.contract.variant import VariantBase
from qbuild.plugins import Method

TOOLS = ("pydantic",)


class FakeVariant(VariantBase):
    method: Literal["fake"]
    level: int = 1
    calibrated: bool = False
    sleep: float = 0.0
    fail: bool = False
    timing: bool = False   # declare the step hardware-dependent, like a throughput measurement
    ppl: float | None = None           # measurements the step reports of itself (the summary shows them as a
    decode_tok_s: float | None = None  # variant's PPL / decode speed): regression gates and diffs test with them
    work: int = 0          # fixed CPU work for benchmarks: this many thousand sha256 rounds (not a sleep)
    elastic: bool = False  # its step may take idle cores (Step.elastic_threads): it records the allowances it saw
    preload: list[str] = []  # modules its worker imports (Step.preload): it records which were imported before it ran
    noise: bool = False    # also write random bytes: a step that is not bit-reproducible (verify --rebuild tests)
    at_once: int = 0       # at most this many fake steps asking it run at once (Step.at_once, group "fake"); 0: no cap

    def needs_calibration(self) -> bool:
        return self.calibrated

    def quant_params(self) -> dict:
        data = super().quant_params()
        data.pop("at_once")   # how the step is scheduled, not what it builds: not in its key
        return data

    def describe(self) -> str:
        return f"level {self.level}"


class FakeMethod(Method):
    name = "fake"
    options = FakeVariant
    extra = "dev"
    runs_in_env = True   # torch-free: the backend-environment tests run it in a bare uv environment

    def plan(self, variant: FakeVariant, ctx) -> Step:
        inputs = {"model": ctx.model()}
        if variant.calibrated:
            inputs["calibration"] = ctx.calibration()
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(), "fake_method:run",
                            inputs=inputs, tools=TOOLS, variant=variant.name, format="fake", scheme=f"l{variant.level}",
                            per_hardware=variant.timing, threads=ctx.threads,
                            elastic_threads=variant.elastic and ctx.elastic_threads, preload=tuple(variant.preload),
                            backend_env=ctx.backend_env(variant, self),
                            at_once=("fake", variant.at_once) if variant.at_once else None))


def run(ctx: StepContext) -> dict:
    p = ctx.params
    preloaded = [m for m in p.get("preload", []) if m in sys.modules]   # before this step imported anything
    seen = {ctx.threads_now()}
    standbys = _sibling_standbys() if p["timing"] else 0
    ctx.log(f"fake step, level {p['level']}")   # the step's log (executors bring it back to the driver's store)
    h = hashlib.sha256(repr(sorted(p.items())).encode())
    for role in sorted(ctx.inputs):
        h.update(str(ctx.input_manifests.get(role, {}).get("digest", role)).encode())
    out = ctx.out / "weights.bin"
    with open(out, "wb") as f:
        f.write(h.digest() * 1024)
        f.flush()
        deadline = time.time() + p["sleep"]
        while time.time() < deadline:  # a slow, partially written output
            ctx.progress(int(time.time() * 10) % 10, 10, "writing")
            seen.add(ctx.threads_now())
            if p["timing"]:
                standbys = max(standbys, _sibling_standbys())
            time.sleep(0.05)
        f.write(b"end")
    if p.get("noise"):
        (ctx.out / "noise.bin").write_bytes(os.urandom(32))
    if p.get("work"):
        _burn(p["work"])
    if p["fail"]:
        raise RuntimeError("fake failure requested by the recipe")
    metrics = {"level": p["level"], **{k: p[k] for k in ("ppl", "decode_tok_s") if p.get(k) is not None}}
    info = {"threads_seen": sorted(seen), "preloaded": preloaded, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "cwd_is_scratch": Path.cwd() == ctx.out.parent, "pid": os.getpid(), "ppid": os.getppid(),
            "standbys_beside": standbys,
            "env_names": sorted(os.environ)}   # what the worker was given (test_safety: no credential reaches it)
    return {"format": "fake", "metrics": metrics, "info": info}


def _sibling_standbys() -> int:
    """Standby workers of the same qbuild (what must not run beside a timing step). Their parent is qbuild's
    process; this worker's may be the run's fork server, so qbuild's pid comes from the environment."""
    qbuild_pid = int(os.environ.get("QBUILD_PARENT_PID") or os.getppid())
    found = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found += ppid == qbuild_pid and b"--standby" in cmd
    return found


def _burn(thousands: int) -> None:
    x = b"x"
    for _ in range(thousands * 1000):
        x = hashlib.sha256(x).digest()
