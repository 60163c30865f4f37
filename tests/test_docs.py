"""The documentation site builds with warnings as errors (a broken link, a missing page or anchor fails), and the
README stays a five-minute read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "site" / "store-integrity" / "index.html").is_file()


def test_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), target
