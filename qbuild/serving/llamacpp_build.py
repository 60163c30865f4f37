"""llama.cpp's own tools (llama-server, llama-imatrix, llama-perplexity), built from the vendored llama.cpp source of
the installed llama-cpp-python, so server, tools and the Python runtime are the same llama.cpp.

Built once per llama-cpp-python version (and build flags) into qbuild's cache, under a file lock (two runs build it
once), with a progress line; ~6 min on 2 cores. The sdist is the same pinned-hash download the converter uses
(qbuild/models/llamacpp_tools.py). QBUILD_LLAMA_CPP_BIN names a directory holding these binaries instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from qbuild.base.fingerprint import package_version
from qbuild.base.hashing import sha256_text
from qbuild.base.owned import claim_root

TARGETS = ("llama-server", "llama-imatrix", "llama-perplexity")
# the CPU flags llama-cpp-python is built with (scripts/install.sh): same kernels, so the same numbers; static
# binaries so the cache entry is self-contained
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_BUILD_SERVER=ON")
BUILD_VERSION = 1   # bump when what is built changes (flags, targets, layout)


def build_id(version: str) -> str:
    return f"{version}-{sha256_text(json.dumps([BUILD_VERSION, CMAKE_FLAGS, TARGETS]))[:10]}"


_BUILD_ENTRY = re.compile(r"^(\.build-\w+|[\w.+]+-[0-9a-f]{10}(\.lock|\.build\.log)?)$")


def _only_builds(root: Path) -> str | None:
    """An `adopt` test: the folder holds nothing but builds of ours (made before it had a marker)."""
    foreign = sorted(e for e in os.listdir(root) if not _BUILD_ENTRY.match(e))
    return f"it holds {', '.join(foreign[:3])}" if foreign else None


def bin_root() -> Path:
    from qbuild.models.llamacpp_tools import cache_root

    return cache_root().parent / "llama.cpp-bin"


def installed_version() -> str:
    version = package_version("llama-cpp-python")
    if version == "absent":
        raise RuntimeError("llama-cpp-python is not installed; run: pip install 'qbuild[gguf]'")
    return version


def cached_bin_dir() -> Path | None:
    """The directory with the built tools if they exist already (never builds): for plan-time checks."""
    override = os.environ.get("QBUILD_LLAMA_CPP_BIN")
    if override:
        return Path(override)
    version = package_version("llama-cpp-python")
    if version == "absent":
        return None
    path = bin_root() / build_id(version)
    return path if all((path / t).is_file() for t in TARGETS) else None


def tool(name: str, log=print) -> Path:
    """Path of llama.cpp tool `name` (one of TARGETS), building them first if this version has none yet."""
    if name not in TARGETS:
        raise ValueError(f"{name} is not one of the llama.cpp tools qbuild builds ({', '.join(TARGETS)})")
    override = os.environ.get("QBUILD_LLAMA_CPP_BIN")
    if override:
        path = Path(override) / name
        if not path.is_file():
            raise FileNotFoundError(f"QBUILD_LLAMA_CPP_BIN={override} has no {name}")
        return path
    return build(log=log) / name


def build(log=print, jobs: int | None = None) -> Path:
    """Build (once) and return the directory holding TARGETS for the installed llama-cpp-python."""
    from filelock import FileLock

    version = installed_version()
    target = bin_root() / build_id(version)
    if all((target / t).is_file() for t in TARGETS):
        return target
    root = claim_root(bin_root(), "llama.cpp-bin", adopt=_only_builds)   # replaced only inside a folder we own
    with FileLock(str(target) + ".lock"):
        if all((target / t).is_file() for t in TARGETS):   # another process built it while we waited
            return target
        started = time.monotonic()
        log(f"building {', '.join(TARGETS)} from the llama.cpp of llama-cpp-python {version} (once; ~6 min on 2 cores)")
        with tempfile.TemporaryDirectory(dir=bin_root(), prefix=".build-") as tmp:
            from qbuild.models.llamacpp_tools import download_sdist, extract_vendored

            src, build_dir, staged = Path(tmp) / "src", Path(tmp) / "build", Path(tmp) / "staged"
            extract_vendored(download_sdist(version, Path(tmp)), src)
            build_log = bin_root() / f"{build_id(version)}.build.log"
            with build_log.open("w") as out:
                _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS], out, build_log, log)
                _run(["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs or os.cpu_count() or 1)],
                     out, build_log, log, progress=True)
            staged.mkdir()
            for t in TARGETS:
                found = next((p for p in build_dir.rglob(t) if p.is_file() and os.access(p, os.X_OK)), None)
                if found is None:
                    raise RuntimeError(f"the llama.cpp build made no {t} (log: {build_log})")
                shutil.copy2(found, staged / t)
            seconds = round(time.monotonic() - started, 1)
            (staged / "build.json").write_text(json.dumps({"llama_cpp_python": version, "cmake_flags": CMAKE_FLAGS,
                                                           "targets": TARGETS, "seconds": seconds}, indent=2))
            if target.exists():   # a partial leftover of ours (no lock holder writes here but us)
                root.remove(target)
            root.move(staged, target)
        log(f"built llama.cpp tools in {seconds:.0f} s: {target}")
    return target


def _run(cmd: list[str], out, build_log: Path, log, progress: bool = False) -> None:
    """Run a build command, its output into the build log; with `progress`, a line per 10 % of cmake's counter."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shown = -10
    assert proc.stdout is not None
    for line in proc.stdout:
        out.write(line)
        m = re.match(r"\[\s*(\d+)%\]", line)
        if progress and m and int(m.group(1)) >= shown + 10:
            shown = int(m.group(1)) // 10 * 10
            log(f"  llama.cpp build {shown}%")
    if proc.wait() != 0:
        out.flush()
        tail = build_log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}): {tail[0]} (log: {build_log})")


if __name__ == "__main__":   # python -m qbuild.serving.llamacpp_build: build now (scripts/install.sh does)
    print(f"llama.cpp tools: {build(log=lambda m: print(m, flush=True))}")
