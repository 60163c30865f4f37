"""Files on disk as a step's output holds them."""

from __future__ import annotations

from pathlib import Path


def dir_size(path) -> int:
    """Bytes of every file under a step's output directory (its `size_bytes` metric)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
