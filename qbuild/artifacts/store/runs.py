"""Runs: run ids, run records, the last good run (regression gates) and step logs."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

from qbuild.artifacts.store.files import read_json
from qbuild.base.names import check_name


class RunsMixin:
    """Store methods: runs: run ids, run records, the last good run (regression gates) and step logs."""

    def log_path(self, run_id: str, step_name: str) -> Path:
        """Where a step's log goes (written by the caller: the store is claimed here)."""
        self.owned  # noqa: B018 (claims the root before its first write)
        safe = re.sub(r"[^\w.\-\[\]]", "_", step_name)
        return self.root / "logs" / run_id / f"{safe}.log"

    # --- runs ------------------------------------------------------------------------------------------
    def new_run_id(self) -> str:
        return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{uuid.uuid4().hex[:6]}"

    def write_run(self, run_id: str, record: dict) -> Path | None:
        """runs/<run_id>.json; nothing on a read-only store (a fully cached run there writes nothing)."""
        check_name(run_id, "run id")
        path = self.root / "runs" / f"{run_id}.json"
        if not self.writable:
            return None
        self.write_json(path, record)
        return path

    def runs(self, recipe: str | None = None) -> list[dict]:
        """Run records, oldest first (by when they finished), of one recipe or all."""
        out = []
        for f in (self.root / "runs").glob("*.json"):
            record = None if f.is_symlink() else read_json(f)   # unreadable or foreign records are skipped
            if isinstance(record, dict) and (recipe is None or record.get("recipe") == recipe):
                out.append(record)

        def when(r):
            finished = r.get("finished")
            return (finished if isinstance(finished, int | float) else 0, str(r.get("run_id") or ""))
        return sorted(out, key=when)

    def last_good_run(self, recipe: str, before: str | None = None) -> dict | None:
        """The latest successful run of `recipe` (no step failed, its gates passed), other than run `before`."""
        for record in reversed(self.runs(recipe)):
            if record.get("run_id") == before:
                continue
            if not record.get("counts", {}).get("failed") and (record.get("gates") or {}).get("passed", True):
                return record
        return None
