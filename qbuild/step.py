"""A step: one pure function of hashed inputs, and what its worker process receives."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from qbuild.fingerprint import hardware, toolchain
from qbuild.hashing import step_key


@dataclass(eq=False)
class Step:
    kind: str                                 # e.g. calibrate, quantize, perplexity
    name: str                                 # display name, unique in a plan: quantize[q4km]
    params: dict                              # canonical params (resolved recipe section)
    runner: str | None                        # "module:function" run in a worker; None for sources
    inputs: dict[str, "Step"] = field(default_factory=dict)
    tools: tuple[str, ...] = ()               # distributions whose versions enter the key
    threads: int = 1
    per_hardware: bool = False                # timings: the machine is part of the key
    variant: str | None = None                # set on steps whose output is a variant artifact
    format: str = ""                          # output format: hf, gguf, calibration, tokens, metrics, ...
    source_path: Path | None = None           # external input (local model dir): not built, fingerprinted
    source_digest: str | None = None
    runtime_args: dict = field(default_factory=dict)  # absolute paths etc.: given to the runner, not hashed
    requires_gpu: bool = False                # e.g. TensorRT-LLM engines: plan shows 'needs-gpu' where it cannot run
    unavailable: str = ""                     # why this machine cannot run the step (set at plan time); "" = it can
    on_unavailable: str = "fail"              # fail: `run` exits 2 before any work; skip: the step is skipped
    impl_version: int = 1                     # bump when the runner's output changes for the same inputs
    key: str = ""

    def toolchain(self) -> dict[str, str]:
        tc = toolchain(self.tools)
        if self.per_hardware:
            tc.update({f"hw.{k}": v for k, v in hardware(self.threads).items()})
        return tc

    def input_keys(self) -> dict[str, str]:
        return {role: s.key for role, s in self.inputs.items()}

    def compute_key(self) -> str:
        if self.source_digest is not None:
            self.key = self.source_digest
        else:
            params = self.params if self.impl_version == 1 else {**self.params, "_impl": self.impl_version}
            self.key = step_key(self.kind, params, self.input_keys(), self.toolchain())
        return self.key

    @property
    def short(self) -> str:
        return self.key[:12]


@dataclass
class StepContext:
    """What a runner function gets. It writes its files into `out` and returns its metrics."""

    params: dict
    inputs: dict[str, Path]
    input_manifests: dict[str, dict]
    out: Path
    threads: int
    device: str
    step_name: str
    runtime_args: dict = field(default_factory=dict)
    progress_fd: int | None = None

    def progress(self, done: int, total: int, desc: str = "") -> None:
        if self.progress_fd is None:
            return
        line = json.dumps({"done": done, "total": total, "desc": desc}) + "\n"
        try:
            os.write(self.progress_fd, line.encode())
        except OSError:
            pass

    def log(self, msg: str) -> None:
        print(f"[{self.step_name}] {msg}", flush=True)
