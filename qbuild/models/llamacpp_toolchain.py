"""llama.cpp's toolchain, in one place: the pinned sdist of the installed llama-cpp-python, the HF→GGUF converter
extracted from it, and the one build of its vendored llama.cpp (the libraries llama-cpp-python loads and
llama-server, llama-imatrix, llama-perplexity).

## The converter

Locating llama.cpp's own HF→GGUF converter.

llama-cpp-python builds llama.cpp but does not install `convert_hf_to_gguf.py`; its sdist vendors
it together with the gguf-py it needs (PyPI's `gguf` may lag behind the converter). qbuild extracts
exactly that converter from the sdist of the installed llama-cpp-python version, once, into its
cache, so converter and runtime always come from the same llama.cpp.

The sdist is checked against a pinned sha256 (SDIST_SHA256, the hash PyPI publishes): pip verifies it
(--require-hashes) and so does qbuild before extracting. A version not pinned here is refused unless
QBUILD_LLAMA_CPP_SDIST_SHA256 gives its hash (or QBUILD_LLAMA_CPP_DIR points at a converter).

## The build

llama.cpp, compiled once per install: the libraries llama-cpp-python loads and llama.cpp's own tools
(llama-server, llama-imatrix, llama-perplexity) come from one build of the vendored llama.cpp of the installed
llama-cpp-python, so server, tools and the Python runtime are the same llama.cpp, compiled once.

One CMake build tree per llama-cpp-python version (and build flags) lives in qbuild's cache, under a file lock (two
runs build it once), with a progress line:
- `libraries()` builds ggml and llama as shared libraries and places them in the llama_cpp package, where
  scripts/install.sh installed llama-cpp-python without compiling it (CMAKE_ARGS=-DLLAMA_BUILD=OFF);
- `build()` then builds the tools in the same tree (only what the libraries did not compile), copies them with
  their libraries into `<cache>/llama.cpp-bin/<build id>/` (rpath $ORIGIN) and drops the tree.
Without the first (llama-cpp-python compiled by pip on its own), `build()` compiles everything, as before.

The sdist is the same pinned-hash download the converter uses (above).
QBUILD_LLAMA_CPP_BIN names a directory holding these binaries instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from qbuild.base.fingerprint import cache_dir, package_version
from qbuild.base.hashing import sha256_text
from qbuild.base.owned import OwnedRoot, claim_root
from qbuild.base.tool_run import run_tool

MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# llama.cpp's vocabulary test files: models/ggml-vocab-<name>.gguf (vocabulary only, no tensors) with, for most,
# .gguf.inp (test strings) and .gguf.out (llama.cpp's token ids for each): tests/test_gguf_vocab_vectors.py. Kept in
# a directory of their own, so a converter cache extracted before they were wanted stays as it is.
VOCAB_MEMBERS = ("models/ggml-vocab-",)
SDIST_SHA256 = {  # llama_cpp_python-<version>.tar.gz on PyPI; add a line when scripts/constraints.txt moves
    "0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
}


def sdist_sha256(version: str) -> str:
    pinned = os.environ.get("QBUILD_LLAMA_CPP_SDIST_SHA256") or SDIST_SHA256.get(version)
    if not pinned:
        raise RuntimeError(f"no pinned sha256 for the llama-cpp-python {version} sdist; set "
                           "QBUILD_LLAMA_CPP_SDIST_SHA256 to the hash PyPI lists for it, install a pinned version "
                           f"({', '.join(sorted(SDIST_SHA256))}), or set QBUILD_LLAMA_CPP_DIR")
    return pinned.lower().removeprefix("sha256:")


def cache_root() -> Path:
    return cache_dir() / "llama.cpp"


def converter_dir(log=print) -> Path:
    """Directory holding convert_hf_to_gguf.py (+ conversion/, gguf-py/) for the installed llama.cpp."""
    override = os.environ.get("QBUILD_LLAMA_CPP_DIR")
    if override:
        path = Path(override)
        if not (path / "convert_hf_to_gguf.py").is_file():
            raise FileNotFoundError(f"QBUILD_LLAMA_CPP_DIR={override} has no convert_hf_to_gguf.py")
        return path
    version = package_version("llama-cpp-python")
    if version == "absent":
        raise RuntimeError("llama-cpp-python is not installed; run: pip install 'qbuild[gguf]'")
    target = cache_root() / version
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    log(f"extracting llama.cpp's converter from the llama-cpp-python {version} sdist (once)")
    # the vocabulary test files from the same download, where they are not there yet
    _extract(version, {target: MEMBERS, vocab_cache(version): VOCAB_MEMBERS})
    if not (target / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{target} has no convert_hf_to_gguf.py (an incomplete extraction: remove it to extract "
                           "again)")
    return target


def vocab_cache(version: str) -> Path:
    return cache_root() / "vocab" / version


def vocab_test_dir(log=print) -> Path:
    """Directory holding llama.cpp's vocabulary test files (ggml-vocab-*.gguf, .gguf.inp, .gguf.out) of the installed
    llama-cpp-python's llama.cpp, extracted from its sdist once (with the converter, or on first use)."""
    version = package_version("llama-cpp-python")
    if version == "absent":
        raise RuntimeError("llama-cpp-python is not installed; run: pip install 'qbuild[gguf]'")
    target = vocab_cache(version)
    if not target.is_dir():
        log(f"extracting llama.cpp's vocabulary test files from the llama-cpp-python {version} sdist (once)")
        _extract(version, {target: VOCAB_MEMBERS})
    return target / "models"


def extract_from(sdist: Path, version: str) -> None:
    """The converter and vocabulary test files from an sdist already downloaded and checked (the llama.cpp build's):
    one download per install, not one per use."""
    _extract(version, {cache_root() / version: MEMBERS, vocab_cache(version): VOCAB_MEMBERS}, sdist)


def _extract(version: str, wanted: dict[Path, tuple[str, ...]], sdist: Path | None = None) -> None:
    """Download the sdist once (unless given) and extract, for each target directory not there yet, the vendored
    llama.cpp paths starting with its members; each target appears whole (staged, then renamed: the same filesystem)
    or not at all."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        sdist = sdist or download_sdist(version, Path(tmp))
        for i, (target, members) in enumerate(wanted.items()):
            if target.is_dir() and any(target.iterdir()):
                continue
            staged = Path(tmp) / f"staged-{i}"
            staged.mkdir()
            extract_vendored(sdist, staged, members)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(staged, target)
            except OSError:
                if not target.is_dir():   # not another process's complete copy: a real failure
                    raise


def download_sdist(version: str, dest: Path) -> Path:
    """The llama-cpp-python `version` sdist, downloaded into `dest` by pip with its pinned hash, checked again."""
    pinned = sdist_sha256(version)
    req = dest / "requirements.txt"
    req.write_text(f"llama-cpp-python=={version} --hash=sha256:{pinned}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "--require-hashes", "-r", str(req), "-d", str(dest)],
        check=True,
    )
    sdist = next(dest.glob("llama_cpp_python-*.tar.gz"))
    check_sdist(sdist, pinned)
    return sdist


def extract_vendored(sdist: Path, staged: Path, members: tuple[str, ...] | None = None) -> None:
    """Extract the sdist's vendor/llama.cpp/ (only paths starting with one of `members`, if given) into `staged`."""
    with tarfile.open(sdist) as tar:
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        for member in tar.getmembers():
            rel = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and (members is None or rel.startswith(members)) and member.isfile():
                member.name = rel
                tar.extract(member, staged, filter="data")


def check_sdist(sdist: Path, pinned: str) -> None:
    """Refuse a downloaded sdist whose sha256 is not the pinned one (never extract unverified code)."""
    from qbuild.base.hashing import sha256_file

    got = sha256_file(sdist)
    if got != pinned:
        raise RuntimeError(f"{sdist.name}: sha256 {got} does not match the pinned {pinned}; refusing to use it")


def converter_command(model_dir: Path, outfile: Path, outtype: str, trust_remote_code: bool = False,
                      log=print) -> list[str]:
    """llama.cpp's converter on `model_dir`; unless the recipe trusts the model's code, behind the guard that keeps
    transformers from running it (the converter asks for trust_remote_code=True for some architectures)."""
    from qbuild.models.custom_code import LAUNCHER

    script = converter_dir(log) / "convert_hf_to_gguf.py"
    guard = [] if trust_remote_code else [str(LAUNCHER)]
    return [sys.executable, *guard, str(script), str(model_dir), "--outfile", str(outfile), "--outtype", outtype]


def converter_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use its vendored gguf-py, not PyPI's
    return env


def run_converter(model_dir: Path, outfile: Path, outtype: str, log=print, trust_remote_code: bool = False) -> None:
    cmd = converter_command(model_dir, outfile, outtype, trust_remote_code, log)
    log("running " + " ".join(cmd))
    run_tool(cmd, "convert_hf_to_gguf.py", env=converter_env())


# --- the build ------------------------------------------------------------------------------------------------
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
    def say(message: str) -> None:
        print(message, flush=True)

    wanted = sys.argv[1:] or ["libraries", "tools"]
    if "libraries" in wanted:
        libraries(log=say)
    if "tools" in wanted:
        say(f"llama.cpp tools: {build(log=say)}")


def ggml_type_id(llama_cpp, name: str) -> int:
    """ggml's enum value of a tensor type. llama-cpp-python exports only some (not BF16, TQ1_0, TQ2_0); gguf-py
    mirrors ggml's whole enum but may lag the newest types (Q2_0 in gguf 0.19): ask both."""
    value = getattr(llama_cpp, f"GGML_TYPE_{name}", None)
    if value is None:
        import gguf

        member = gguf.GGMLQuantizationType.__members__.get(name)
        if member is None:
            raise ValueError(f"this llama.cpp build ({llama_cpp.__version__}) has no tensor type {name}")
        value = member.value
    return int(value)
