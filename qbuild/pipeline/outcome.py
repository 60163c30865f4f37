"""What running a plan did with each step (StepOutcome), and the recipe a step is built for (Origin)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.contract.step import Outcome, Step

if TYPE_CHECKING:
    from qbuild.artifacts.remote.cache import RemoteHit


@dataclass
class StepOutcome:
    step: Step
    status: Outcome
    path: Path | None = None
    digest: str | None = None
    seconds: float = 0.0
    record: dict = field(default_factory=dict)
    error: str | None = None
    log: str | None = None
    remote: RemoteHit | None = None   # a remote hit not (yet) fetched: path is None until materialized
    started: float | None = None      # wall-clock start/end of a build (time.time()), for `--json` and tests
    ended: float | None = None
    worker: str | None = None         # where it was built (the Ray executor: the node), None for this machine

    @property
    def metrics(self) -> dict:
        return self.record.get("metrics", {}) if self.record else {}

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.record.get("files", [])) if self.record else 0


@dataclass(frozen=True)
class Origin:
    """The recipe a step is built for: its provenance and its `plan` history."""

    recipe: str
    path: str
    sha256: str | None = None
