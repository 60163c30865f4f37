"""An offline English corpus that exists on every machine: the Python standard library's docstrings.

Docstrings are read with `ast` (never imported: importing `antigravity` opens a browser). Modules are
split into disjoint train/test sets by a hash of their name, so calibration and evaluation never share
text.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
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
    """Docstrings of the stdlib modules in `split` ("train" or "test"), in a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in _stdlib_files():
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        if _is_test_module(module) == (split == "test"):
            docs.extend(_docstrings(path))
    return docs
