"""A step's worker ends without Python's module teardown (qbuild.pipeline.worker.exit_without_teardown: ~1.2 s per step
with torch loaded), yet loses nothing a step leaves behind: buffered files it never closed, non-daemon threads
still writing, thread pools, temporary directories cleaned by finalizers, atexit handlers, its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

RUNNER = textwrap.dedent('''
    import atexit, concurrent.futures, tempfile, threading, time
    from pathlib import Path

    LEFT_OPEN = []   # a module global: only a normal exit's teardown (or qbuild's flush) writes its buffer

    class Teardown:   # its __del__ runs only in the module teardown that the worker skips
        def __init__(self, path):
            self.path = path
        def __del__(self):
            self.path.write_text("module teardown ran")

    def run(ctx):
        out = ctx.out
        f = open(out / "unclosed.txt", "w", buffering=1 << 20)
        f.write("x" * 100_000)
        LEFT_OPEN.append(f)
        g = open(out / "unclosed.bin", "wb")
        g.write(b"y" * 50_000)
        LEFT_OPEN.append(g)

        def late():
            time.sleep(0.5)
            (out / "late.txt").write_text("written by a non-daemon thread after the step returned")
        threading.Thread(target=late).start()
        pool = concurrent.futures.ThreadPoolExecutor(2)   # never shut down: exit must not hang on its idle workers
        pool.submit(lambda: (out / "pool.txt").write_text("pool")).result()
        scratch = tempfile.TemporaryDirectory(dir=out.parent)   # cleaned by its weakref finalizer at exit
        LEFT_OPEN.append(scratch)
        (out / "scratch.txt").write_text(scratch.name)
        atexit.register(lambda: (out / "atexit.txt").write_text("atexit ran"))
        LEFT_OPEN.append(Teardown(out.parent / "teardown.txt"))
        if ctx.params.get("fail"):
            raise RuntimeError("asked to fail")
        return {"metrics": {"ok": 1}}
''')


def _worker(tmp: Path, params: dict) -> tuple[subprocess.CompletedProcess, Path, Path]:
    (tmp / "mod").mkdir(exist_ok=True)
    (tmp / "mod" / "leaky_runner.py").write_text(RUNNER)
    out = tmp / "job" / "out"
    out.mkdir(parents=True)
    spec = {"name": "leaky", "runner": "leaky_runner:run", "params": params, "out": str(out), "inputs": {},
            "input_manifests": {}, "threads": 1, "device": "cpu", "runtime_args": {},
            "result": str(tmp / "job" / "result.json")}
    (tmp / "job" / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp / "mod"), os.environ.get("PYTHONPATH", "")])}
    env.pop("QBUILD_PARENT_PID", None)
    proc = subprocess.run([sys.executable, "-m", "qbuild.pipeline.worker", str(tmp / "job" / "spec.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    return proc, out, tmp / "job" / "result.json"


def test_a_step_that_leaves_files_open_and_threads_running_loses_nothing(tmp_path):
    proc, out, result = _worker(tmp_path, {})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text()) == {"metrics": {"ok": 1}}
    assert (out / "unclosed.txt").read_text() == "x" * 100_000
    assert (out / "unclosed.bin").read_bytes() == b"y" * 50_000
    assert (out / "late.txt").read_text().startswith("written by a non-daemon thread")
    assert (out / "pool.txt").read_text() == "pool"
    assert (out / "atexit.txt").read_text() == "atexit ran"
    assert not Path((out / "scratch.txt").read_text()).exists()
    assert not (out.parent / "teardown.txt").exists()   # the ~1.2 s per torch step that is saved


def test_a_failing_step_exits_1_with_its_error_and_still_flushes(tmp_path):
    proc, out, result = _worker(tmp_path, {"fail": True})
    assert proc.returncode == 1
    assert json.loads(result.read_text()) == {"error": "RuntimeError: asked to fail"}
    assert "RuntimeError: asked to fail" in proc.stderr   # the traceback reaches the step's log
    assert (out / "unclosed.txt").read_text() == "x" * 100_000
    assert (out / "atexit.txt").read_text() == "atexit ran"
