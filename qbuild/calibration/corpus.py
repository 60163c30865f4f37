"""An offline English corpus that exists on every machine: the Python standard library's docstrings.

Docstrings are read with `ast` (never imported: importing `antigravity` opens a browser). Modules are
split into disjoint train/test sets by a hash of their name, so calibration and evaluation never share
text.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import sys
import sysconfig
from pathlib import Path

MIN_CHARS = 200
TEST_FRACTION = 0.25  # share of modules held out for evaluation
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo", "ensurepip"}


def _is_test_module(module: str) -> bool:
    h = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < TEST_FRACTION


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("test_") for part in rel.parts):
            continue
        out.append(p)
    return out


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                doc = inspect.cleandoc(doc)
                if len(doc) >= MIN_CHARS:
                    docs.append(doc)
    return docs


def pydocs_documents(split: str) -> list[str]:
    """Docstrings of the stdlib modules in `split` ("train" or "test"), in a deterministic order. Read once per
    Python and kept in qbuild's per-user cache: every calibration, evaluation-text and fidelity step reads them, and
    parsing the standard library takes 0.6-1.3 s a split on 2 cores."""
    name = _cache_name(split)
    docs = _cached(name)
    if docs is None:
        docs = _extract(split)
        _keep(name, docs)
    return docs


CACHE_VERSION = 1   # bump with any change to what _extract returns


def _cache_name(split: str) -> str:
    # what decides the docstrings: the Python (its version string names the build), where its stdlib is, the rules
    rules = [sys.version, sysconfig.get_paths()["stdlib"], split, MIN_CHARS, TEST_FRACTION, sorted(SKIP_DIRS),
             CACHE_VERSION]
    return f"pydocs-{hashlib.sha256(json.dumps(rules).encode()).hexdigest()[:24]}.json"


def _cached(name: str) -> list[str] | None:
    from qbuild.base.fingerprint import cache_dir

    try:
        record = json.loads((cache_dir() / "corpus" / name).read_text(encoding="utf-8"))
        docs = record["documents"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = isinstance(docs, list) and all(isinstance(d, str) for d in docs)
    return docs if ok and record.get("sha256") == _digest(docs) else None   # a damaged file is read again


def _keep(name: str, docs: list[str]) -> None:
    """Written only through a root qbuild owns (its marker checked, no link followed); a read-only home or a folder
    not ours means the next step parses the stdlib again, never an error."""
    from qbuild.base.fingerprint import cache_dir
    from qbuild.base.owned import keep_in_cache

    keep_in_cache(cache_dir() / "corpus", "corpus", name, json.dumps({"documents": docs, "sha256": _digest(docs)}).encode())


def _digest(docs: list[str]) -> str:
    return hashlib.sha256(json.dumps(docs).encode()).hexdigest()


def _extract(split: str) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in _stdlib_files():
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        if _is_test_module(module) == (split == "test"):
            docs.extend(_docstrings(path))
    return docs
