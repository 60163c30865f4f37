"""Identities that go into keys: library versions, hardware, and local directory contents.

Nothing here imports torch or any other heavy library: versions come from package metadata.
"""

from __future__ import annotations

import json
import os
import platform
import re
from functools import cache, lru_cache
from importlib import metadata
from pathlib import Path

from qbuild.base.hashing import canonical_json, memo_sha256, sha256_text, tree_digest


@cache
def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _normalized(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def install_hint(dists: list[str]) -> str:
    """How to install distributions qbuild's steps use: the qbuild extras that list them (from qbuild's own
    metadata, so pyproject.toml is the one list), else the distributions by name."""
    wanted = {_normalized(d) for d in dists}
    extras: list[str] = []
    try:
        requires = metadata.requires("qbuild") or []
    except metadata.PackageNotFoundError:   # a source tree on sys.path, not installed
        requires = []
    for line in requires:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*).*;\s*extra\s*==\s*[\"']([\w-]+)[\"']", line)
        if m and _normalized(m.group(1)) in wanted and m.group(2) != "dev":
            wanted.discard(_normalized(m.group(1)))
            if m.group(2) not in extras:
                extras.append(m.group(2))
    parts = ([f"'qbuild[{','.join(extras)}]'"] if extras else []) + sorted(wanted)
    return "pip install " + " ".join(parts)


def toolchain(dists: tuple[str, ...]) -> dict[str, str]:
    """Versions of exactly the distributions a step uses: an unrelated upgrade keeps the cache."""
    return {d: package_version(d) for d in sorted(dists)}


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(threads: int) -> dict[str, str]:
    """For steps whose output depends on the machine (timings): CPU model and thread count."""
    return {"cpu": cpu_model(), "threads": str(threads), "machine": platform.machine()}


def cache_dir() -> Path:
    """qbuild's per-user cache (memos, extracted tools): QBUILD_CACHE or ~/.cache/qbuild."""
    return Path(os.environ.get("QBUILD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qbuild"))


def _memo_dir() -> Path:
    return cache_dir() / "fingerprints"


def generated(rel: str, hidden: bool = False) -> bool:
    """Whether a file (its path relative to the fingerprinted directory) is something tools wrote beside the
    sources, not content: Python's bytecode cache (written when a file is imported, different per Python version);
    with `hidden`, also dot-files and dot-directories (editor, VCS, notebook and tool caches)."""
    parts = rel.split("/")
    if "__pycache__" in parts[:-1] or rel.endswith((".pyc", ".pyo")):
        return True
    return hidden and any(p.startswith(".") for p in parts)


def dir_fingerprint(path: Path, sources_only: bool = False) -> str:
    """Content fingerprint of a directory (or file), with a stat-based memo.

    A file is re-hashed only when its size, mtime or inode changed, so the warm fingerprint of a
    100 GB model costs one stat per file. Bytecode caches never count (`generated`); `sources_only` (a directory
    of sources, such as an lm-eval task directory) also leaves out hidden files and directories.
    """
    path = path.resolve()
    memo_file = _memo_dir() / (sha256_text(f"{path}{' sources' if sources_only else ''}")[:32] + ".json")
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    rows, fresh, changed = [], {}, False
    for f in files:
        rel = f.name if f == path else f.relative_to(path).as_posix()
        if rel.startswith(".cache/") or rel.startswith(".git/") or (f != path and generated(rel, sources_only)):
            continue
        st = f.stat()
        fresh[rel], hashed = memo_sha256(f, st, memo.get(rel))
        changed = changed or hashed
        rows.append({"path": rel, "size": st.st_size, "sha256": fresh[rel][3]})
    if changed or set(fresh) != set(memo):
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(canonical_json(fresh))
        os.replace(tmp, memo_file)
    return tree_digest(rows)
