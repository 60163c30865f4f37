"""A step: one pure function of hashed inputs, and what its worker process receives.

A Step is frozen: everything the planner, the executor, the summary and the store need is a
declared field, fixed when the step is created, and its key is computed then. Steps are shared
between variants by key (PlanContext.add), so nothing may change one after it is made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.base.fingerprint import hardware, toolchain
from qbuild.base.hashing import step_key

if TYPE_CHECKING:
    from qbuild.contract.envs import BackendEnv


class PlanStatus(StrEnum):
    """What planning found for a step."""

    HIT = "hit"                  # stored: nothing runs
    REMOTE_HIT = "hit-remote"    # stored in a remote tier: only its action record was read
    MISS = "miss"                # must be built
    SOURCE = "source"            # an external input (local model dir): fingerprinted, never built
    NEEDS_GPU = "needs-gpu"      # a miss this machine cannot build (no GPU / GPU toolchain)
    UNAVAILABLE = "unavailable"  # a miss this machine cannot build for another reason


class Outcome(StrEnum):
    """What running a plan did with a step."""

    CACHED = "cached"
    BUILT = "built"
    FAILED = "failed"
    SKIPPED = "skipped"
    SOURCE = "source"


class OnUnavailable(StrEnum):
    FAIL = "fail"   # `run` exits 2 before any work
    SKIP = "skip"   # the step (and what needs it) is skipped, the rest is built


# what a worker that loads transformers imports (tokenization_auto pulls in torch and modeling_auto anyway)
HF_PRELOAD = ("torch", "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto")


@dataclass(frozen=True, eq=False)
class Step:
    kind: str                                 # e.g. calibrate, quantize, perplexity
    name: str                                 # display name, unique in a plan: quantize[q4km]
    params: Mapping                           # canonical params (resolved recipe section)
    runner: str | None                        # "package.module:function" (a module-level function); None for sources
    inputs: Mapping[str, Step] = field(default_factory=dict)
    tools: tuple[str, ...] = ()               # distributions whose versions enter the key
    threads: int = 1
    elastic_threads: bool = False             # may take idle cores while it runs (its result is thread-count free)
    preload: tuple[str, ...] = ()             # modules its worker imports: a standby worker imports them ahead
    per_hardware: bool = False                # timings: the machine is part of the key
    variant: str | None = None                # set on steps whose output is a named artifact (ref)
    format: str = ""                          # output format (qbuild.contract.formats): gguf, compressed-tensors, metrics ...
    scheme: str = ""                          # quantization scheme of a model artifact: Q4_K_M, w4a16, fp8-dynamic ...
    source_path: Path | None = None           # external input (local model dir): not built, fingerprinted
    source_digest: str | None = None
    runtime_args: Mapping = field(default_factory=dict)   # absolute paths etc.: given to the runner, not hashed
    env_toolchain: Mapping[str, str] = field(default_factory=dict)  # facts from outside qbuild's Python (GPU SM, ...)
    requires_gpu: bool = False                # plan shows 'needs-gpu' where it cannot run
    unavailable: str = ""                     # why this machine cannot run the step; "" = it can
    on_unavailable: OnUnavailable = OnUnavailable.FAIL
    impl_version: int = 1                     # bump when the runner's output changes for the same inputs
    backend_env: BackendEnv | None = None     # runs in this interpreter (qbuild.contract.envs); its versions enter the key
    after: tuple[Step, ...] = ()              # must succeed first (a check of what it reads); not hashed, not read
    memory: str = ""                          # how it holds the model: "whole-model" ("-fp32"), "offloads-to-disk" (what
                                              # does not fit), "layer-streamed", "shard-streamed" (one safetensors
                                              # file at a time), "dequantizes-gguf" (a GGUF's import), "" (a file
                                              # map, another machine);
                                              # for the plan-time memory check (qbuild.pipeline.memory_fit), not hashed
    gpu_capable: bool = False                 # runs on the GPU where the recipe's device gives one (cuda, or auto
                                              # on a machine with one); False: CPU only. The plan shows it; not hashed
    scratch: float = 0.0                      # bytes it writes into its scratch while it runs, as a share of the
                                              # model it reads (a search's probe GGUF); for disk scheduling, not hashed
    at_once: tuple[str, int] | None = None    # (group, n): at most n steps of the group run at the same time (a
                                              # search's probes, so their scratch files stay within its disk bound);
                                              # for scheduling, not hashed
    key: str = field(init=False)

    def __post_init__(self) -> None:
        if self.source_digest is not None:
            key = self.source_digest
        else:
            params = self.params if self.impl_version == 1 else {**self.params, "_impl": self.impl_version}
            key = step_key(self.kind, params, self.input_keys(), self.toolchain())
        object.__setattr__(self, "key", key)

    def toolchain(self) -> dict[str, str]:
        return dict(self._toolchain)

    @cached_property
    def _toolchain(self) -> dict[str, str]:
        # in a backend environment the tools' versions are that environment's, and its whole lock counts too
        tc = self.backend_env.toolchain(self.tools) if self.backend_env else toolchain(self.tools)
        if self.per_hardware:
            tc.update({f"hw.{k}": v for k, v in hardware(self.threads).items()})
        tc.update(self.env_toolchain)
        return tc

    def input_keys(self) -> dict[str, str]:
        return {role: s.key for role, s in self.inputs.items()}

    def prerequisites(self) -> list[Step]:
        """What must be done before this step starts: its inputs, then the checks it waits for (`after`)."""
        return [*self.inputs.values(), *self.after]

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
    threads_file: Path | None = None   # an elastic step's current thread allowance, rewritten by the executor
    store_root: Path | None = None     # the store whose tmp/ holds `out`: the root a runner's deletes are checked against

    def owned(self):
        """The step's store as a root qbuild owns (its marker checked): a runner deletes or moves files only through
        it, confined to its own output (`root.remove(p, within=ctx.out)`)."""
        from qbuild.base.owned import NotOurs, owned_root

        if self.store_root is None:
            raise NotOurs(f"step {self.step_name} has no store: refusing to delete or move files under {self.out}")
        return owned_root(self.store_root, "store")

    def torch_device(self) -> str:
        """Where a torch step computes: "cuda" when the recipe's device allows a GPU (auto or cuda) and torch sees
        one, else "cpu" (runtime.device: cpu keeps a GPU machine's steps on its CPU)."""
        if self.device == "cpu":
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def threads_now(self) -> int:
        """The threads this step may use now: `threads`, or more while the executor has idle cores for it."""
        if self.threads_file is None:
            return self.threads
        try:
            return max(1, int(self.threads_file.read_text()))
        except (OSError, ValueError):   # not written yet, or being replaced
            return self.threads

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
