"""Entry point of a step's own process: `python -m qbuild.pipeline.worker SPEC.json`.

Heavy steps run here so memory is returned to the OS and a crash or OOM fails one step only.
stdout/stderr go to the step's log; progress goes to a dedicated pipe (QBUILD_PROGRESS_FD).

`python -m qbuild.pipeline.worker --standby MODULE...` is a worker started before its step is ready: it imports
the modules (torch and transformers take 4-6 s) while its step's inputs are still being built, then reads
its step from stdin and runs it like the first form. One process still runs one step.

`python -m qbuild.pipeline.worker SCRATCH --fork-server FD MODULE...` is the run's fork server (fork_server.py): it
imports qbuild's own worker modules once and forks each step's worker from there, a fresh process per step
without a fresh interpreter's start-up.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from qbuild.base.process import exit_without_teardown


def die_with_parent(parent: int | None = None) -> None:
    """When qbuild dies (kill -9 included), its workers and everything they started die too.

    The worker leads its own process group (the executor starts it in a new session): on its parent's death
    the kernel sends it SIGTERM (PR_SET_PDEATHSIG), and the handler kills the whole group. The parent is qbuild
    (QBUILD_PARENT_PID), or for a worker forked by the fork server, the server (which dies with qbuild)."""
    parent = parent or os.environ.get("QBUILD_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    signal.signal(signal.SIGTERM, lambda *_: os.killpg(os.getpgrp(), signal.SIGKILL))
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os._exit(1)


def main(spec_path: str, parent: int | None = None) -> int:
    die_with_parent(parent)
    spec = json.loads(Path(spec_path).read_text())
    try:   # in a backend environment qbuild's own imports can fail too (a missing core dependency): say which
        from qbuild.contract.step import StepContext
    except ImportError as exc:
        traceback.print_exc()
        Path(spec["result"]).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1

    fd = os.environ.get("QBUILD_PROGRESS_FD")
    ctx = StepContext(
        params=spec["params"],
        inputs={k: Path(v) for k, v in spec["inputs"].items()},
        input_manifests=spec["input_manifests"],
        out=Path(spec["out"]),
        threads=spec["threads"],
        device=spec["device"],
        step_name=spec["name"],
        runtime_args=spec["runtime_args"],
        store_root=Path(spec["store_root"]) if spec.get("store_root") else None,
        progress_fd=int(fd) if fd else None,
        threads_file=Path(spec["threads_file"]) if spec.get("threads_file") else None,
    )
    try:
        runner = resolve_runner(spec["runner"])
        # torch takes its thread count from OMP_NUM_THREADS (the executor sets it), so a step that never imports
        # torch does not pay its import (~1.7 s per step: most of an empty step's cost); a runner module that
        # imported torch already gets the count set explicitly too
        if spec["threads"] and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(spec["threads"])
        result = runner(ctx) or {}
    except BaseException as exc:  # report every failure, incl. KeyboardInterrupt, as one line + log
        traceback.print_exc()
        Path(spec["result"]).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    Path(spec["result"]).write_text(json.dumps(result, default=str))
    return 0


def standby(modules: list[str]) -> int:
    """Import `modules`, then wait for one line on stdin: {"spec", "log", "cwd", "env"} (the step's own
    variables: threads, progress pipe, ...), and run that step. End of input: no step came, exit 0."""
    die_with_parent()
    t0 = time.perf_counter()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:   # the step's own import of it reports the error, in its log
            pass
    imported = time.perf_counter() - t0
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log, 1), os.dup2(log, 2)
    os.close(log)
    print(f"qbuild worker started ahead of its step; imported {', '.join(modules)} "
          f"in {imported:.1f} s before it was needed", flush=True)
    return main(job["spec"])


def resolve_runner(runner: str):
    """The function a step's runner names: 'package.module:function', a module-level function (the one form: a runner
    is written whole as that string where the step is planned, tests/test_architecture.py)."""
    module, _, name = runner.partition(":")
    if not name.isidentifier():
        raise ValueError(f"runner {runner!r}: a runner names a module-level function, 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def fork_server(control_fd: int, modules: list[str]) -> int:
    """Import `modules` once, then fork a worker per step handed over `control_fd` (qbuild.pipeline.fork_server)."""
    from qbuild.pipeline.fork_server import serve

    die_with_parent()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:   # each worker imports what it needs itself: the step's own import reports the error
            pass
    import gc

    gc.freeze()   # the collector of a forked worker leaves these objects' pages alone (no copy on write)
    return serve(control_fd, main)


if __name__ == "__main__":
    if sys.argv[1] == "--standby":
        code = standby(sys.argv[2:])
    elif sys.argv[2:3] == ["--fork-server"]:
        code = fork_server(int(sys.argv[3]), sys.argv[4:])
    else:
        code = main(sys.argv[1])
    exit_without_teardown(code)
