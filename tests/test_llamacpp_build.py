"""llama.cpp's tools built once per llama-cpp-python version: the cache layout, the override, and one build when
several processes ask at once (the real build, ~6 min, is what scripts/install.sh runs; the lifecycle and end-to-end
serving tests use its binaries)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from qbuild.models import llamacpp_toolchain as lb


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
            bin_dir = Path(cmd[2]) / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            for t in lb.TARGETS:
                (bin_dir / t).write_text("#!/bin/sh\n")
                (bin_dir / t).chmod(0o755)
        else:
            Path(cmd[cmd.index("-B") + 1], "CMakeCache.txt").parent.mkdir(parents=True, exist_ok=True)
            Path(cmd[cmd.index("-B") + 1], "CMakeCache.txt").write_text("")

    import qbuild.models.llamacpp_toolchain as tools

    monkeypatch.setattr(tools, "download_sdist", fake_sdist)
    monkeypatch.setattr(tools, "extract_vendored", fake_extract)
    monkeypatch.setattr(tools, "extract_from", lambda sdist, version: None)
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
    assert not lb._tree("0.3.36").exists()   # and the build tree, once everything is built


def test_libraries_then_tools_compile_once(tmp_path, monkeypatch):
    """install.sh's path: llama-cpp-python installed without its libraries gets them from qbuild's build tree, and
    the tools are built later in that same tree: configured once, each target compiled once, tools shipped with the
    very library files the Python package loads."""
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QBUILD_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setattr(lb, "installed_version", lambda: "0.3.36")
    package_lib = tmp_path / "site-packages" / "llama_cpp" / "lib"
    package_lib.parent.mkdir(parents=True)
    monkeypatch.setattr(lb, "package_lib_dir", lambda: package_lib)
    commands: list[list[str]] = []

    def fake_run(cmd, out, build_log, log, progress=False):
        commands.append(cmd)
        if cmd[1] == "-S":
            Path(cmd[cmd.index("-B") + 1]).mkdir(parents=True)
            Path(cmd[cmd.index("-B") + 1], "CMakeCache.txt").write_text("")
            return
        bin_dir = Path(cmd[2]) / "bin"
        bin_dir.mkdir(exist_ok=True)
        for target in cmd[cmd.index("--target") + 1: cmd.index("-j")]:
            names = lb.TARGETS if target in lb.TARGETS else ("libggml.so", "libggml-base.so", "libggml-cpu.so",
                                                            "libllama.so.0.5.0")
            for name in names:
                (bin_dir / name).write_text(f"compiled {name}")
        if not (bin_dir / "libllama.so").exists():
            (bin_dir / "libllama.so").symlink_to("libllama.so.0.5.0")

    import qbuild.models.llamacpp_toolchain as tools

    monkeypatch.setattr(tools, "download_sdist", lambda version, dest: dest / "sdist.tar.gz")
    monkeypatch.setattr(tools, "extract_vendored", lambda sdist, staged, members=None: staged.mkdir(parents=True))
    monkeypatch.setattr(tools, "extract_from", lambda sdist, version: None)
    monkeypatch.setattr(lb, "_run", fake_run)
    assert lb.libraries(log=lambda m: None) == package_lib
    assert (package_lib / "libllama.so").read_text() == "compiled libllama.so.0.5.0"   # content, not a link
    assert not (package_lib / "libllama.so").is_symlink() and (package_lib / lb.MARKER).is_file()
    assert lb.libraries(log=lambda m: None) == package_lib and len(commands) == 2   # placed: nothing again
    target = lb.build(log=lambda m: None)
    configures = [c for c in commands if c[1] == "-S"]
    built = [t for c in commands if c[1] == "--build" for t in c[c.index("--target") + 1: c.index("-j")]]
    assert len(configures) == 1 and built == ["llama", *lb.TARGETS]
    assert (target / "libllama.so.0.5.0").read_text() == (package_lib / "libllama.so").read_text()
    assert json.loads((target / "build.json").read_text())["libraries_compiled_before"] is True
    assert not lb._tree("0.3.36").exists()


def test_a_package_with_its_own_libraries_is_left_alone(tmp_path, monkeypatch):
    """llama-cpp-python compiled by pip (CMAKE_ARGS of the user's, or a plain pip install) keeps its libraries."""
    package_lib = tmp_path / "lib"
    package_lib.mkdir()
    (package_lib / "libllama.so").write_text("pip's")
    monkeypatch.setattr(lb, "installed_version", lambda: "0.3.36")
    monkeypatch.setattr(lb, "package_lib_dir", lambda: package_lib)
    monkeypatch.setattr(lb, "_run", lambda *a, **k: pytest.fail("compiled"))
    assert lb.libraries(log=lambda m: None) == package_lib
    assert (package_lib / "libllama.so").read_text() == "pip's"


def test_installed_llama_cpp_is_one_build():
    """Where scripts/install.sh installed it: the Python package loads the library files the tools were built with
    (one compile of ggml and llama), and the package still imports and runs."""
    lib_dir = lb.package_lib_dir()
    if not (lib_dir / lb.MARKER).is_file():
        pytest.skip("llama-cpp-python here was compiled by pip, not by scripts/install.sh")
    tools_dir = lb.cached_bin_dir()
    assert tools_dir is not None, "install.sh dev builds the tools"
    for name in ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so"):
        assert (lib_dir / name).read_bytes() == (tools_dir / name).read_bytes(), name
    import llama_cpp

    assert llama_cpp.llama_supports_mmap() in (True, False)
