"""llama.cpp, compiled once per install: the libraries llama-cpp-python loads and llama.cpp's own tools
(llama-server, llama-imatrix, llama-perplexity) come from one build of the vendored llama.cpp of the installed
llama-cpp-python, so server, tools and the Python runtime are the same llama.cpp, compiled once.

One CMake build tree per llama-cpp-python version (and build flags) lives in qbuild's cache, under a file lock (two
runs build it once), with a progress line:
- `libraries()` builds ggml and llama as shared libraries and places them in the llama_cpp package, where
  scripts/install.sh installed llama-cpp-python without compiling it (CMAKE_ARGS=-DLLAMA_BUILD=OFF);
- `build()` then builds the tools in the same tree (only what the libraries did not compile), copies them with
  their libraries into `<cache>/llama.cpp-bin/<build id>/` (rpath $ORIGIN) and drops the tree.
Without the first (llama-cpp-python compiled by pip on its own), `build()` compiles everything, as before.

The sdist is the same pinned-hash download the converter uses (qbuild/models/llamacpp_tools.py).
QBUILD_LLAMA_CPP_BIN names a directory holding these binaries instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from qbuild.base.fingerprint import package_version
from qbuild.base.hashing import sha256_text
from qbuild.base.owned import OwnedRoot, claim_root

TARGETS = ("llama-server", "llama-imatrix", "llama-perplexity")
LIBRARY_TARGETS = ("llama",)   # with its ggml, ggml-base and ggml-cpu: what llama-cpp-python loads
# The CPU flags install.sh used for llama-cpp-python before it came from this build: any x86-64 with AVX2, no
# AMX/AVX-512 autodetection (AMX tiles fault in some VMs/sandboxes). Shared libraries found beside each binary
# ($ORIGIN), so the Python package and the tools load the same files and a cache entry is self-contained.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
               "-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON")
BUILD_VERSION = 2   # bump when what is built changes (flags, targets, layout); 2: shared libraries, one tree
MARKER = "qbuild-llama.cpp.json"   # in llama_cpp/lib: these libraries are this build's


def build_id(version: str) -> str:
    return f"{version}-{sha256_text(json.dumps([BUILD_VERSION, CMAKE_FLAGS, TARGETS]))[:10]}"


_BUILD_ENTRY = re.compile(r"^(\.build-\w+|[\w.+]+-[0-9a-f]{10}(\.lock|\.build\.log|\.tree)?)$")


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


def package_lib_dir() -> Path:
    """llama_cpp/lib of the installed llama-cpp-python, found without importing it (the import loads libllama)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama-cpp-python is not installed; run: pip install 'qbuild[gguf]'")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _is_library(name: str) -> bool:
    return name.startswith("lib") and ".so" in name


def libraries(log=print, jobs: int | None = None) -> Path:
    """Give the installed llama-cpp-python its libraries from this build when it has none (installed with
    CMAKE_ARGS=-DLLAMA_BUILD=OFF, as scripts/install.sh does); the build tree stays for the tools. Returns the
    package's lib folder. One that has a libllama already (pip compiled it) is left as it is."""
    from filelock import FileLock

    version, lib_dir = installed_version(), package_lib_dir()
    if (lib_dir / "libllama.so").exists():
        return lib_dir
    target = bin_root() / build_id(version)
    root = claim_root(bin_root(), "llama.cpp-bin", adopt=_only_builds)
    with FileLock(str(target) + ".lock"):
        if (lib_dir / "libllama.so").exists():   # another process placed them while we waited
            return lib_dir
        if (target / "libllama.so").exists():   # the tools of this build are here: their libraries are the ones
            built = target
        else:
            built = _compile(root, version, LIBRARY_TARGETS, "the libraries of llama-cpp-python (ggml, llama)",
                             "~4 min", log, jobs)
        # a folder of ours from here on (it is empty or missing: a wheel compiled by pip returned above); libllama.so
        # is copied last, so a run killed half-way leaves no libllama and the next call copies again
        owned = claim_root(lib_dir, "llama-cpp-python libraries")
        names = sorted((p for p in built.iterdir() if _is_library(p.name)), key=lambda p: p.name.startswith("libllama"))
        for p in names:
            owned.copy_in(p, lib_dir / p.name)   # content, not links: as the wheel ships them
        owned.write_bytes(lib_dir / MARKER, json.dumps({"llama_cpp_python": version, "build": build_id(version)}).encode())
    log(f"llama-cpp-python {version} loads llama.cpp from {lib_dir}")
    return lib_dir


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
        reused = (_tree(version) / "build" / "CMakeCache.txt").is_file()
        built = _compile(root, version, TARGETS, ", ".join(TARGETS), "~6 min" if reused else "~10 min", log, jobs)
        staged = bin_root() / f".build-{os.getpid()}"
        root.remove(staged)   # a leftover of a killed build with this pid
        root.mkdirs(staged)
        for t in TARGETS:
            if not (built / t).is_file():
                raise RuntimeError(f"the llama.cpp build made no {t} (log: {_build_log(version)})")
        for p in sorted(built.iterdir()):
            if p.name in TARGETS or _is_library(p.name):
                shutil.copy2(p, staged / p.name, follow_symlinks=False)
        seconds = round(time.monotonic() - started, 1)
        (staged / "build.json").write_text(json.dumps({"llama_cpp_python": version, "cmake_flags": CMAKE_FLAGS,
                                                       "targets": TARGETS, "seconds": seconds,
                                                       "libraries_compiled_before": reused}, indent=2))
        if target.exists():   # a partial leftover of ours (no lock holder writes here but us)
            root.remove(target)
        root.move(staged, target)
        root.remove(_tree(version))   # everything is built: the tree (sources, objects) is not needed again
        log(f"built llama.cpp tools in {seconds:.0f} s: {target}")
    return target


def _tree(version: str) -> Path:
    return bin_root() / f"{build_id(version)}.tree"


def _build_log(version: str) -> Path:
    return bin_root() / f"{build_id(version)}.build.log"


def _compile(root: OwnedRoot, version: str, targets: tuple[str, ...], what: str, expected: str, log,
             jobs: int | None) -> Path:
    """Build `targets` in this version's one build tree (made here from the pinned sdist when absent; a tree left by
    an earlier call is reused, so what it compiled is not compiled again). Returns the folder of the built binaries
    and libraries. Called under the version's lock."""
    from qbuild.models.llamacpp_tools import download_sdist, extract_from, extract_vendored

    tree = _tree(version)
    src, build_dir = tree / "src", tree / "build"
    build_log = _build_log(version)
    fresh = not (build_dir / "CMakeCache.txt").is_file()
    log(f"building {what} from the llama.cpp of llama-cpp-python {version} (once; {expected} on 2 cores)")
    with build_log.open("a") as out:
        if fresh:
            root.remove(tree)   # a tree that never finished configuring
            root.mkdirs(tree)
            sdist = download_sdist(version, tree)
            extract_vendored(sdist, src)
            extract_from(sdist, version)   # the converter too, while the download is here
            root.remove(sdist)
            _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS], out, build_log, log)
        _run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs or os.cpu_count() or 1)],
             out, build_log, log, progress=True)
    return build_dir / "bin"


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


if __name__ == "__main__":   # scripts/install.sh: `libraries` for llama-cpp-python, then (dev) the tools
    import sys

    def say(message: str) -> None:
        print(message, flush=True)

    wanted = sys.argv[1:] or ["libraries", "tools"]
    if "libraries" in wanted:
        libraries(log=say)
    if "tools" in wanted:
        say(f"llama.cpp tools: {build(log=say)}")
