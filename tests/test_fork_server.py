"""Warm workers (qbuild.pipeline.fork_server): each step's worker is forked from the run's fork server, a fresh process
per step that sees what a fresh interpreter's worker sees; the server loads no library that sizes a thread pool from
its own environment; a server killed from outside fails only the step it was running, and the rest start fresh.
(A kill -9 of qbuild taking the server and its workers with it: test_executor_parallel.py, whose pgrep finds them.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from qbuild.pipeline.executor import Executor
from qbuild.pipeline.fork_server import PRELOAD, THREAD_POOLS, warm_modules

from helpers import fake_recipe, run_api, step_infos, write_recipe


def _build(tmp_path: Path, store: Path, level: int) -> dict[str, dict]:
    variants = [{"name": f"v{i}", "method": "fake", "level": level + i} for i in range(3)]
    recipe = write_recipe(tmp_path / f"r{level}.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    rc, summary = run_api(recipe, store, jobs=1)
    assert rc == 0, summary["steps"]
    return step_infos(store)


def test_each_step_runs_in_its_own_forked_worker_that_sees_what_a_fresh_one_sees(tmp_path, monkeypatch):
    warm = _build(tmp_path, tmp_path / "warm", 100)
    assert len({i["pid"] for i in warm.values()}) == 3                 # one process per step
    servers = {i["ppid"] for i in warm.values()}
    assert len(servers) == 1 and os.getpid() not in servers            # all forked by the run's one server
    assert not Path(f"/proc/{servers.pop()}").exists(), "the fork server outlived the run"
    monkeypatch.setattr(Executor, "warm_workers", False)
    fresh = _build(tmp_path, tmp_path / "fresh", 200)
    assert {i["ppid"] for i in fresh.values()} == {os.getpid()}        # fresh interpreters, started by qbuild itself
    for w, f in zip(sorted(warm.values(), key=str), sorted(fresh.values(), key=str), strict=True):
        assert w["env_names"] == f["env_names"]                        # the same allow-listed variables, no more
        assert w["omp_threads"] == f["omp_threads"] == "1" and w["cwd_is_scratch"] and f["cwd_is_scratch"]


def test_the_server_imports_nothing_that_sizes_a_thread_pool(monkeypatch):
    # what the server imports, in a clean interpreter: no thread-pool library, no thread started
    code = ("import importlib, json, os, sys; from qbuild.pipeline.fork_server import PRELOAD, THREAD_POOLS\n"
            "for m in PRELOAD: importlib.import_module(m)\nimport fake_method\n"
            "print(json.dumps({'pools': [m for m in THREAD_POOLS if m in sys.modules], "
            "'threads': len(os.listdir('/proc/self/task'))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"pools": [], "threads": 1}
    # runner modules: those planning imported, unless something here loaded a thread-pool library
    for name in THREAD_POOLS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import fake_method  # noqa: F401  (planning a fake variant imports it)

    assert warm_modules(["fake_method:run", "qbuild_never_imported_here:run"]) == (*PRELOAD, "fake_method")
    monkeypatch.setitem(sys.modules, "numpy", types.ModuleType("numpy"))
    assert warm_modules(["fake_method:run"]) == PRELOAD


def test_a_server_killed_from_outside_fails_only_its_step_and_the_rest_start_fresh(tmp_path, store_dir):
    variants = [{"name": "slow", "method": "fake", "level": 1, "sleep": 30.0}] + \
               [{"name": f"q{i}", "method": "fake", "level": 10 + i} for i in range(2)]
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants, runtime={"threads": 1}))
    proc = subprocess.Popen([sys.executable, "-m", "qbuild", str(recipe), "--store", str(store_dir), "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not any((store_dir / "tmp").glob("*/out/weights.bin")):
            time.sleep(0.1)
        time.sleep(0.5)   # the quick steps (if they went first) are done: what runs now is "slow"
        # the oldest of the processes with the server's command line (its forked workers share it)
        server = subprocess.run(["pgrep", "-o", "-f", f"qbuild.pipeline.worker {store_dir}/tmp --fork-server"],
                                capture_output=True, text=True).stdout.split()
        assert len(server) == 1, server
        os.kill(int(server[0]), 9)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "worker exited with code -9" in out and "Traceback" not in out + err   # the step that ran in it
    built = {json.loads(m.read_text())["name"] for m in (store_dir / "objects").glob("*/*/manifest.json")}
    assert built == {"quantize[q0]", "quantize[q1]"}
    assert not list((store_dir / "tmp").glob("*")), "scratch left behind"
    left = subprocess.run(["pgrep", "-f", f"qbuild.pipeline.worker {store_dir}"], capture_output=True, text=True)
    assert not left.stdout.split(), "a worker outlived its server"
