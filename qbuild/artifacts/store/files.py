"""Durable, bounded file operations of the store: fsync'd atomic writes, reads that treat a damaged record as absent,
free-space checks, and the link policy of a step's output."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from qbuild.artifacts.store.layout import DIGEST_RE, NO_SPACE
from qbuild.base.errors import EXIT_USER_ERROR, QBuildError
from qbuild.base.owned import OwnedRoot, fsync_dir, output_root  # noqa: F401 (fsync_dir: imported from here by the store)


class StoreFull(QBuildError):
    """The store's filesystem is full (ENOSPC/EDQUOT): one line naming the store, what was written, free vs needed."""


class StoreReadOnly(QBuildError):
    """Something must be written to a read-only store (a serving team's shared mount): exit 2, before any work."""

    exit_code = EXIT_USER_ERROR


def free_bytes(path: Path) -> int | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def store_full(root: Path, what: str, needed: int | None) -> StoreFull:
    return StoreFull(f"store {root} is full: writing {what} needs {_human(needed)}, {_human(free_bytes(root))} free; "
                     "free some space (qbuild gc) or use another --store")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data, root: OwnedRoot | None = None) -> None:
    """Write a record inside `root` (a store; None: a cache outside any store, confined to the record's own folder):
    a fresh file beside `path`, fsynced, renamed over it, the folder fsynced (OwnedRoot.write_bytes: confined to
    the root, never through a link; NotOurs otherwise).

    A power cut leaves either the old or the new content, never an empty record. ENOSPC → StoreFull (one line),
    with the half-written file removed."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str).encode()
    try:
        if root is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            root = output_root(path.parent)
        root.write_bytes(path, text)
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise store_full(root.path, str(path), len(text)) from None
        if exc.errno == errno.EROFS:
            raise StoreReadOnly(f"store {root.path} is read-only: cannot write {path}") from None
        raise


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def read_json(path: Path) -> dict | None:
    """A record as a dict, or None when missing, empty, unreadable, not JSON or not an object (never raises)."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def valid_files(files) -> bool:
    """A manifest's file list: [{path: relative, size: int >= 0, sha256: 64 hex}, ...] with no '..' or absolute path."""
    if not isinstance(files, list):
        return False
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(f.get("sha256"), str):
            return False
        if not isinstance(f.get("size"), int) or isinstance(f.get("size"), bool) or f["size"] < 0:
            return False
        parts = f["path"].split("/")
        if not f["path"] or f["path"].startswith("/") or ".." in parts or "" in parts or "\0" in f["path"]:
            return False
    return True


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def checked_digest(value: object, what: str = "digest") -> str:
    """`value` if it is a 64-hex digest or key; ValueError otherwise. Every store path built from a digest or key
    goes through here, so a name from a remote record (`x/../../victim`) never becomes a path."""
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise ValueError(f"invalid {what} {str(value)[:80]!r} (expected 64 lowercase hex characters)")
    return value


class _quiet_store:
    """Best-effort writes (stamps): a full or read-only store must not fail a lookup."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (StoreFull, StoreReadOnly, OSError))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listdir(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except OSError:
        return []


def _walk(root: Path) -> list[Path]:
    """Regular files under root, sorted; never follows a symlink (links are listed as files when not materialized)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        out += [d / n for n in filenames]
        out += [d / n for n in dirnames if (d / n).is_symlink()]
    return sorted(out)


def _materialize_links(tmp: Path, allowed: tuple[Path, ...]) -> None:
    """Replace each symlink a step wrote by a fresh copy of the bytes it points at, when it resolves to a regular
    file inside one of `allowed`; refuse links to folders, to nothing, and to anywhere else (one line naming it)."""
    from qbuild.base.errors import StepFailed

    bases = [Path(os.path.realpath(a)) for a in allowed]
    for p in _walk(tmp):
        if not p.is_symlink():
            continue
        target = p.resolve()
        rel = p.relative_to(tmp)
        if not any(target == b or b in target.parents for b in bases):
            raise StepFailed(str(rel), f"output {rel} is a symlink to {target}, outside the step's scratch, inputs and "
                             "model files; refusing to store it (a library must write the file itself)")
        if not target.is_file():
            raise StepFailed(str(rel), f"output {rel} is a symlink to "
                             f"{'a directory' if target.is_dir() else 'nothing'}; write the file itself")
        staged = p.with_name(f".{p.name}.{uuid.uuid4().hex[:8]}.copy")
        shutil.copyfile(target, staged)
        os.replace(staged, p)
