"""llama.cpp's tools built once per llama-cpp-python version: the cache layout, the override, and one build when
several processes ask at once (the real build, ~6 min, is what scripts/install.sh runs; the lifecycle and end-to-end
serving tests use its binaries)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from qbuild.serving import llamacpp_build as lb


def test_tools_come_from_the_version_and_flags_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path))
    monkeypatch.delenv("QBUILD_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setattr(lb, "installed_version", lambda: "0.3.36")
    target = lb.bin_root() / lb.build_id("0.3.36")
    assert target.parent == tmp_path / "llama.cpp-bin" and target.name.startswith("0.3.36-")
    assert lb.build_id("0.3.36") != lb.build_id("0.3.37")
    target.mkdir(parents=True)
    for t in lb.TARGETS:
        (target / t).write_text("#!/bin/sh\n")
    monkeypatch.setattr(lb, "_run", lambda *a, **k: pytest.fail("built again"))
    assert lb.tool("llama-server") == target / "llama-server"
    with pytest.raises(ValueError, match="not one of the llama.cpp tools"):
        lb.tool("llama-cli")


def test_override_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("QBUILD_LLAMA_CPP_BIN", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="has no llama-server"):
        lb.tool("llama-server")
    (tmp_path / "llama-server").write_text("")
    assert lb.tool("llama-server") == tmp_path / "llama-server" and lb.cached_bin_dir() == tmp_path


def test_concurrent_requests_build_once(tmp_path, monkeypatch):
    """Two threads (standing in for two runs) ask for the tools at once: one builds under the lock, the other waits
    and finds them."""
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path))
    monkeypatch.delenv("QBUILD_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setattr(lb, "installed_version", lambda: "0.3.36")
    builds = []

    def fake_sdist(version, dest: Path) -> Path:
        return dest / "sdist.tar.gz"

    def fake_extract(sdist, staged, members=None):
        staged.mkdir(parents=True)

    def fake_run(cmd, out, build_log, log, progress=False):
        if cmd[1] == "--build":
            builds.append(cmd)
            build_dir = Path(cmd[2])
            build_dir.mkdir(parents=True, exist_ok=True)
            for t in lb.TARGETS:
                (build_dir / t).write_text("#!/bin/sh\n")
                (build_dir / t).chmod(0o755)

    import qbuild.models.llamacpp_tools as tools

    monkeypatch.setattr(tools, "download_sdist", fake_sdist)
    monkeypatch.setattr(tools, "extract_vendored", fake_extract)
    monkeypatch.setattr(lb, "_run", fake_run)
    lines: list[str] = []
    results = []
    threads = [threading.Thread(target=lambda: results.append(lb.build(log=lines.append))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(set(results)) == 1
    assert all((results[0] / t).is_file() for t in lb.TARGETS) and (results[0] / "build.json").is_file()
    assert sum(line.startswith("building llama-server") for line in lines) == 1
    assert not list(lb.bin_root().glob(".build-*"))   # the scratch tree is gone
