"""Locating llama.cpp's own HF→GGUF converter.

llama-cpp-python builds llama.cpp but does not install `convert_hf_to_gguf.py`; its sdist vendors
it together with the gguf-py it needs (PyPI's `gguf` may lag behind the converter). qbuild extracts
exactly that converter from the sdist of the installed llama-cpp-python version, once, into its
cache, so converter and runtime always come from the same llama.cpp.

The sdist is checked against a pinned sha256 (SDIST_SHA256, the hash PyPI publishes): pip verifies it
(--require-hashes) and so does qbuild before extracting. A version not pinned here is refused unless
QBUILD_LLAMA_CPP_SDIST_SHA256 gives its hash (or QBUILD_LLAMA_CPP_DIR points at a converter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from qbuild.base.fingerprint import cache_dir, package_version
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
