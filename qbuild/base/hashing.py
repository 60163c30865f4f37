"""Canonical serialization and hashing: how a step key and a content digest are computed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, UTF-8: the one serialization that gets hashed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def copy_hashed(inp, out, detach: bool = False, hasher=None, limit: int | None = None) -> str:
    """Copy the open file `inp` into `out` (None: only hash it) and return the sha256 of its bytes, reading `inp`
    once. detach: `out` gets a copy of each chunk (a writer that may keep what it is handed, a remote upload's).
    hasher: a sha256 to continue (the bytes before `inp`'s position, hashed earlier); limit: read at most that many
    bytes."""
    h = hasher if hasher is not None else hashlib.sha256()
    buf = memoryview(bytearray(CHUNK))
    left = limit
    while left is None or left > 0:
        n = inp.readinto(buf if left is None or left >= CHUNK else buf[:left])
        if not n:
            break
        h.update(buf[:n])
        if out is not None:
            out.write(bytes(buf[:n]) if detach else buf[:n])
        if left is not None:
            left -= n
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return copy_hashed(f, None)


def memo_sha256(path: Path, st, memo) -> tuple[list, bool]:
    """[size, mtime_ns, inode, sha256] of `path` (stat result `st`), re-hashing only when the stat triple differs
    from `memo` (a previous such list, or None to force). Returns (entry, hashed)."""
    mark = [st.st_size, st.st_mtime_ns, st.st_ino]
    if isinstance(memo, list) and len(memo) == 4 and memo[:3] == mark:
        return memo, False
    return mark + [sha256_file(path)], True


def step_key(kind: str, params: dict, inputs: dict[str, str], toolchain: dict[str, str]) -> str:
    """Key of a step = hash of exactly (kind, canonical params, input identities, toolchain)."""
    return sha256_text(canonical_json({"kind": kind, "params": params, "inputs": inputs, "toolchain": toolchain}))


def tree_digest(files: list[dict]) -> str:
    """Content digest of an artifact: hash over its sorted (path, size, sha256) list."""
    rows = sorted((f["path"], f["size"], f["sha256"]) for f in files)
    return sha256_text(canonical_json(rows))
