"""A backend environment as a step carries it (Step.backend_env, PlanningContext.backend_env): where the step's
worker runs and what of it enters the step's key. Declarations only: resolving, creating, listing and removing
environments (uv, run as a subprocess) is qbuild/envs/ (docs/backend-envs.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MARKER = ".qbuild-env.json"          # written last: an environment without it is incomplete


def canonical_name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


@dataclass(frozen=True)
class BackendEnv:
    """Where a step runs: a uv-created environment (packages + lock) or an existing interpreter (python)."""

    name: str                                   # built-in backend name, "custom", or "python"
    python: str                                 # the interpreter a worker runs (created on first use for uv envs)
    lock_hash: str                              # sha256 of the resolved lock (or of the interpreter's versions)
    versions: dict[str, str] = field(default_factory=dict, hash=False, compare=False)  # canonical name → version
    packages: tuple[str, ...] = ()              # requirements (uv environments only)
    lock: str = field(default="", hash=False, compare=False, repr=False)
    external: bool = False                      # an existing interpreter: never created or removed by qbuild

    @property
    def label(self) -> str:
        return f"{self.name}@{self.lock_hash[:12]}"

    @property
    def directory(self) -> Path:
        return Path(self.python).parent.parent

    def toolchain(self, tools: tuple[str, ...]) -> dict[str, str]:
        """What enters a step's key: the tools' versions in this environment, and the whole lock's hash."""
        tc = {t: self.versions.get(canonical_name(t), "absent") for t in tools}
        tc["env"] = self.label
        return tc

    def exists(self) -> bool:
        return self.external or (self.directory / MARKER).is_file()
