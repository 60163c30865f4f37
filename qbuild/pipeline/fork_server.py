"""Warm workers: a fork server that has imported qbuild's worker modules once and forks a fresh worker per step.

A fresh interpreter per step costs ~180 ms on 2 cores before the step does anything (starting Python ~40 ms, then
qbuild.contract.step, qbuild.contract.plugin and pydantic ~140 ms): that was most of a trivial step's overhead, paid by every
candidate of a mixed-precision search. The executor starts one server per run (`python -m qbuild.pipeline.worker
SCRATCH --fork-server FD MODULE...`); it imports MODULE... (torch-free modules only: nothing that reads the thread
count when it loads, nothing that starts a thread) and then, for each step, forks a child that is a worker exactly
like a fresh one: its own process (memory goes back to the OS at its end, a crash fails one step), its own
session, the step's own environment (the allow-list of worker_env, its threads, its GPU), directory, log and
progress pipe; it imports the step's runner module itself. A fork takes ~2 ms.

Protocol. The control socket (SOCK_SEQPACKET: one message per step) carries a step's job as JSON, with two file
descriptors: the step's status socket and the write end of its progress pipe. The child writes {"pid"} on the
status socket once it leads its own session (the executor can then kill its process group); the server reaps it
and writes {"rc", "cpu", "peak_rss_mb"} there, as os.wait4 gives them. End of the control socket: the server
exits. The server dies with the executor (PR_SET_PDEATHSIG), and each child with the server, so a kill -9 of
qbuild leaves no worker behind, as with fresh workers.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

MAX_JOB_BYTES = 1 << 20
# what every worker imports before its runner (qbuild.pipeline.worker.main): torch-free, thread-free (tests check it)
PRELOAD = ("qbuild.contract.step", "qbuild.contract.plugin", "qbuild.contract.variant", "qbuild.contract.formats")
# libraries that size a thread pool from the environment when they load: never imported in the server, where the
# count would be the server's and not each step's
THREAD_POOLS = ("numpy", "torch", "scipy", "numexpr", "tensorflow", "jax")


def warm_modules(runners: list[str]) -> tuple[str, ...]:
    """What the server imports: PRELOAD, and the runner modules (of 'module:function') that planning imported here
    already, as long as nothing imported here loaded a thread-pool library (planning never imports torch; a
    module that imports numpy when it loads stays for the step's own worker to import)."""
    if any(name in sys.modules for name in THREAD_POOLS):
        return PRELOAD
    return PRELOAD + tuple(sorted({r.partition(":")[0] for r in runners} & set(sys.modules) - set(PRELOAD)))


# --- the executor's end -------------------------------------------------------------------------------------------
class ForkServer:
    """A running fork server, as the executor sees it: hand it a step, get the worker's pid and exit status."""

    def __init__(self, scratch_root: Path, env: dict, preload: tuple[str, ...]):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # the scratch root in its command line: `pgrep -f "qbuild.pipeline.worker STORE"` finds it and its workers
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qbuild.pipeline.worker", str(scratch_root), "--fork-server", str(theirs.fileno()),
             *preload], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),), env=env, start_new_session=True)
        theirs.close()
        self._send = threading.Lock()

    def start(self, job: dict, progress_fd: int) -> ForkedWorker | None:
        """Hand one step to the server (job: spec, log, cwd, env). None: the server is gone (start a fresh worker)."""
        mine, theirs = socket.socketpair()
        try:
            with self._send:
                socket.send_fds(self.control, [json.dumps(job).encode()], [theirs.fileno(), progress_fd])
        except OSError:
            mine.close()
            return None
        finally:
            theirs.close()
        return ForkedWorker(mine)

    def stop(self) -> None:
        """End of input: it exits (it has no step left to run when the executor stops it)."""
        try:
            self.control.close()
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()


class ForkedWorker:
    """One step's worker forked by the server: its pid once it leads its session, then its exit status."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._lines = sock.makefile("rb")
        self.pid: int | None = None
        self._status: dict | None = None
        self._result: tuple[int, float, float] | None = None

    def _next(self) -> dict | None:
        try:
            line = self._lines.readline()
            return json.loads(line) if line else None
        except (OSError, ValueError):
            return None

    def started(self) -> int | None:
        """Wait until the worker leads its own session: its pid (None: it died first, or the server did)."""
        msg = self._next()
        if msg is not None and "pid" in msg:
            self.pid = msg["pid"]
        else:
            self._status = msg
        return self.pid

    @property
    def lost(self) -> bool:
        """The server ended before it forked the worker (killed from outside)."""
        return self.pid is None and self._status is None

    def wait(self) -> tuple[int, float, float]:
        """(exit code, CPU seconds, peak RSS MiB) once the server has reaped it; a server gone counts as a kill."""
        if self._result is None:
            status = self._status or (self._next() if self.pid is not None else None)
            self._lines.close()
            self.sock.close()
            ok = status and "rc" in status
            self._result = (status["rc"], status["cpu"], status["peak_rss_mb"]) if ok else (-signal.SIGKILL, 0.0, 0.0)
        return self._result


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- the server -------------------------------------------------------------------------------------------------
def serve(control_fd: int, run_step) -> int:
    """The server's loop (single-threaded, so forking is safe): fork a worker per job, reap each, report."""
    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so SIGCHLD is delivered (and wakes select)
    running: dict[int, socket.socket] = {}           # pid → its status socket
    open_control = True
    while open_control or running:
        ready, _, _ = select.select([control, wake_r] if open_control else [wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(running)
        if control in ready:
            msg, fds, _, _ = socket.recv_fds(control, MAX_JOB_BYTES, 2)
            if not msg:   # the executor is done (or gone): the workers still running finish or die with it
                open_control = False
                control.close()
                continue
            status, progress_fd = socket.socket(fileno=fds[0]), fds[1]
            pid = os.fork()
            if pid == 0:
                _child(json.loads(msg), status, progress_fd, [control, *running.values()], (wake_r, wake_w), run_step)
            os.close(progress_fd)
            running[pid] = status
            _reap(running)   # a SIGCHLD that came before this child was recorded
    return 0


def _reap(running: dict[int, socket.socket]) -> None:
    while running:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = running.pop(pid, None)
        if sock is None:
            continue
        report = {"rc": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime,
                  "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}
        try:
            sock.sendall((json.dumps(report) + "\n").encode())
        except OSError:   # the executor stopped waiting (cancelled)
            pass
        sock.close()


def _child(job: dict, status: socket.socket, progress_fd: int, inherited: list, wake: tuple[int, int],
           run_step) -> None:
    """In the forked worker: become a fresh worker for the job's step, run it, exit. Never returns."""
    code = 1
    try:
        server = os.getppid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in inherited:
            sock.close()
        for fd in wake:
            os.close(fd)
        os.setsid()   # its own group: the executor kills it and whatever it starts as one
        status.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
        status.close()
        os.environ.clear()   # exactly the variables a fresh worker for this step gets
        os.environ.update(job["env"])
        os.set_inheritable(progress_fd, True)
        os.environ["QBUILD_PROGRESS_FD"] = str(progress_fd)
        os.chdir(job["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1), os.dup2(log, 2)
        os.close(log)
        sys.argv = [sys.argv[0], job["spec"]]
        code = run_step(job["spec"], server)
    except BaseException:
        try:
            traceback.print_exc()
        finally:
            os._exit(1)
    from qbuild.base.process import exit_without_teardown

    exit_without_teardown(code)
