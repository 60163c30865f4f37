"""Housekeeping: stale scratch and locks, and `qbuild gc` of the local store (only qbuild's own names are ever
removed, through the owned root)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from qbuild.artifacts.store.files import _alive, _listdir, _quiet, read_json
from qbuild.artifacts.store.layout import DIGEST_RE, FETCH_RE, LOCK_RE, QUARANTINE_RE, RUN_ID_RE, SCRATCH_RE


class HousekeepingMixin:
    """Store methods: housekeeping: stale scratch and locks, and `qbuild gc` of the local store (only qbuild's own
    names are ever removed, through the owned root)."""

    def clean_stale(self, min_age_s: float = 60.0) -> dict:
        """Remove scratch and lock files no live process holds (safe beside running builds); returns counts."""
        from filelock import FileLock, Timeout

        removed = {"tmp": 0, "locks": 0}
        if not self.writable:
            return removed
        root = self.owned   # a run starts here: the store is claimed (or refused) before anything is written
        now = time.time()
        for entry in _listdir(self.root / "tmp"):
            m = SCRATCH_RE.match(entry.name)  # only build scratch: a remote fetch's staging is kept to resume
            try:
                age = now - entry.lstat().st_mtime
            except OSError:
                continue
            if m is None or age < min_age_s:
                continue
            pid = int(m.group("pid"))
            if pid != os.getpid() and _alive(pid):
                continue
            lock_file = self.root / "locks" / f"{m.group('key')}.lock"
            try:
                with FileLock(str(lock_file), timeout=0):
                    root.remove(entry)
                    removed["tmp"] += 1
                    with _quiet():
                        root.remove(lock_file)   # held by us: a waiter re-opens it (filelock checks st_nlink)
            except (Timeout, OSError):
                continue
        for entry in _listdir(self.root / "locks"):
            if not LOCK_RE.match(entry.name):
                continue
            try:
                if now - entry.lstat().st_mtime < min_age_s:
                    continue
                with FileLock(str(entry), timeout=0):  # held by nobody: removing it cannot break a build
                    root.remove(entry)
                    removed["locks"] += 1
            except (Timeout, OSError):
                continue
        return removed

    def gc_housekeeping(self, older_than_s: float = 30 * 86400, keep_runs: int = 20, dry_run: bool = False,
                        now: float | None = None) -> list[dict]:
        """Remove what only accumulates: stale scratch and unheld locks (any age > 60 s), and logs, run records,
        stamps of gone objects and quarantined objects older than `older_than_s` (the newest `keep_runs` run
        records and their logs always stay). Objects themselves are not touched here. Returns one row per removal."""
        self.require_writable("gc")
        root = self.owned_existing()   # `qbuild gc --store /` must never clear /tmp: the root must carry the marker
        now = time.time() if now is None else now
        rows: list[dict] = []

        def size(p: Path) -> int:
            if p.is_dir() and not p.is_symlink():
                return sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() or f.is_symlink())
            return p.lstat().st_size

        def drop(kind: str, p: Path) -> None:
            rows.append({"kind": kind, "path": str(p), "bytes": size(p)})
            if not dry_run:
                root.remove(p)

        def old(p: Path, limit: float) -> bool:
            try:
                return now - p.lstat().st_mtime > limit
            except OSError:
                return False

        self._gc_scratch_and_locks(root, drop, old, older_than_s, dry_run)

        def finished(p: Path):   # the order of store.runs(): run ids of one second sort at random by name
            record = None if p.is_symlink() else read_json(p)
            when = record.get("finished") if record else None
            return (when if isinstance(when, int | float) else 0, p.name)

        runs = sorted((p for p in _listdir(self.root / "runs") if p.suffix == ".json" and RUN_ID_RE.match(p.stem)), key=finished)
        keep = {p.stem for p in runs[-keep_runs:]} if keep_runs > 0 else set()
        for entry in runs:
            if entry.stem not in keep and old(entry, older_than_s):
                drop("run", entry)
        for entry in _listdir(self.root / "logs"):
            if RUN_ID_RE.match(entry.name) and entry.name not in keep and old(entry, older_than_s):
                drop("log", entry)
        for entry in _listdir(self.root / "quarantine"):
            if QUARANTINE_RE.match(entry.name) and old(entry, older_than_s):
                drop("quarantine", entry)
        for entry in (self.root / "stamps").glob("*/*.json"):
            if DIGEST_RE.match(entry.stem) and not self.object_dir(entry.stem).is_dir():
                drop("stamp", entry)
        return rows

    def _gc_scratch_and_locks(self, root, drop, old, older_than_s: float, dry_run: bool) -> None:
        """gc_housekeeping's stale scratch and unheld locks (any age > 60 s), and a remote fetch's staging once past
        `older_than_s`; `drop` records (and unless `dry_run` removes) each, `old` tells an entry's age."""
        from filelock import FileLock, Timeout

        for entry in _listdir(self.root / "tmp"):
            m = SCRATCH_RE.match(entry.name)
            if m is None:  # a remote fetch's staging (kept so it can resume): only once past the retention
                if FETCH_RE.match(entry.name) and old(entry, older_than_s):
                    drop("tmp", entry)
                continue
            pid = int(m.group("pid"))
            if not old(entry, 60) or (pid != os.getpid() and _alive(pid)):
                continue
            lock_file = self.root / "locks" / f"{m.group('key')}.lock"
            try:
                with FileLock(str(lock_file), timeout=0):
                    drop("tmp", entry)
                    if not dry_run:
                        with _quiet():
                            root.remove(lock_file)   # held by us: a waiter re-opens it (filelock checks st_nlink)
            except (Timeout, OSError):
                continue
        for entry in _listdir(self.root / "locks"):
            if not LOCK_RE.match(entry.name) or entry.is_symlink() or not old(entry, 60):
                continue
            try:
                with FileLock(str(entry), timeout=0):
                    drop("lock", entry)
            except (Timeout, OSError):
                continue
