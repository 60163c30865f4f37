"""Helpers for the remote-store tests: build small objects in a local store, run code in a killable child."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from qbuild.artifacts.store import Hit, Store

REPO = Path(__file__).resolve().parents[1]


def make_object(store: Store, files: dict[str, bytes], key: str | None = None, **provenance) -> Hit:
    """Publish `files` as one object (the executor's publish path) and return its hit."""
    key = key or hashlib.sha256(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())
                                           ).encode() + json.dumps(provenance, sort_keys=True).encode()).hexdigest()
    tmp = store.new_tmp(key)
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    prov = {"kind": "quantize", "name": "gguf[q4km]", "variant": "q4km", "format": "gguf",
            "params": {"method": "gguf", "type": "Q4_K_M"}, "recipe": {"name": "demo", "sha256": "0" * 64},
            "inputs": {}, "toolchain": {"llama-cpp-python": "0.3.16"}, "metrics": {}}
    prov.update(provenance)
    return store.publish(key, tmp, prov)


def model_files(size: int = 3 << 20, seed: int = 0) -> dict[str, bytes]:
    """A small HF-like checkpoint: a weight file, configs, a tokenizer in a subdirectory."""
    rnd = hashlib.sha256(str(seed).encode()).digest()
    weights = (rnd * (size // len(rnd) + 1))[:size - 8] + seed.to_bytes(8, "little")
    return {"model.safetensors": weights, "config.json": b'{"model_type": "llama"}',
            "tok/tokenizer.json": b'{"v": %d}' % seed, "empty.txt": b""}


def run_child(code: str, env: dict | None = None, kill_when=None, timeout: float = 120) -> subprocess.CompletedProcess | None:
    """Run python `code` in a child; with kill_when (a callable polled every 20 ms) SIGKILL it when it returns True."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                             os.environ.get("PYTHONPATH", "")]), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-c", code], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    if kill_when is not None:
        while proc.poll() is None and time.time() < deadline:
            if kill_when():
                proc.kill()
                proc.wait()
                return None
            time.sleep(0.02)
    out, err = proc.communicate(timeout=max(1, deadline - time.time()))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def tree_bytes(root: Path) -> bytes:
    """Every file under root concatenated (for grepping planted secrets)."""
    out = bytearray()
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and not p.is_symlink():
            out += p.read_bytes()
    return bytes(out)
