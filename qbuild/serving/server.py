"""An inference server's lifecycle: start on 127.0.0.1 on a free port, wait until ready, stop and reap.

The server runs in a process group of its own (so stopping it reaches everything it started) and dies with the
process that started it (PR_SET_PDEATHSIG: a worker killed with -9 takes its server along). `running()` stops it
whatever happens inside (success, an exception, Ctrl-C, a SIGTERM turned into an exception, a server that never
gets ready or dies mid-sweep); a failure is one line naming the engine, the variant and the server log's last line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"   # never any other address: servers qbuild starts are reachable from this machine only
PORT = "{port}"      # the argument of a ServerLaunch command that the chosen port replaces


@dataclass(frozen=True)
class ServerLaunch:
    """How to start one server (what a `Server` plugin returns): the command, its readiness probe, how to stop it."""

    command: tuple[str, ...]        # an argument that is exactly PORT becomes the port chosen at start
    engine: str                     # for messages: "llama.cpp", "vllm" ...
    model_name: str                 # the `model` field requests send
    ready_path: str = "/health"     # GET → 200 once the model is loaded
    env: dict = field(default_factory=dict)
    stop_signal: int = signal.SIGTERM
    stop_timeout_s: float = 10.0    # after this, SIGKILL to the whole group
    ignore_eos: bool = True         # the engine honours `ignore_eos` in a completion request

    def argv(self, port: int) -> list[str]:
        # only the placeholder argument itself: a model path or any other value holding "{port}" stays as it is
        return [str(port) if a == PORT else a for a in self.command]


class ServerError(RuntimeError):
    """A server that failed to start, never became ready or died: the message is the one line users see."""


def free_port() -> int:
    """A port free on 127.0.0.1 now (the kernel picks it; the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def last_line(log: Path) -> str:
    """The server log's last line, or the error it points at ("See root cause above": vLLM's engine processes)."""
    from qbuild.base.tool_run import pointed_cause

    try:
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return (pointed_cause(lines) or lines[-1])[:300] if lines else "(empty log)"


class RunningServer:
    def __init__(self, launch: ServerLaunch, proc: subprocess.Popen, port: int, log: Path, variant: str):
        self.launch, self.proc, self.port, self.log, self.variant = launch, proc, port, log, variant

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fail(self, what: str) -> ServerError:
        return ServerError(f"{self.launch.engine} server for {self.variant} {what}; its log ends: "
                           f"{last_line(self.log)} (log: {self.log})")

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise self.fail(f"exited with {_describe_exit(code)}")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.url + self.launch.ready_path, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError, TimeoutError):
                pass   # not listening yet, or loading (503)
            if time.monotonic() > deadline:
                raise self.fail(f"was not ready after {timeout_s:.0f} s")
            time.sleep(0.1)

    def check_owner(self) -> None:
        """The port answers from the server started here: free_port() only found it free, and another local process
        may bind it before the server does (the server then fails to bind, and the probe reached the other one)."""
        sockets = _listening_sockets(self.port)
        if sockets is None:
            return   # no /proc here: nothing to check with
        ours = set(_group_pids(self.proc.pid)) | _descendants(self.proc.pid)   # a child may start a session of its own
        if any(sockets & _socket_inodes(pid) for pid in ours):
            return
        other = next((pid for pid in _pids() if pid not in ours and sockets & _socket_inodes(pid)), None)
        raise ServerError(f"{self.launch.engine} server for {self.variant}: port {self.port} on {HOST} is answered "
                          f"by another process ({f'pid {other}' if other else 'not one of its own'}), not the server "
                          f"qbuild started; it took the port first; run again (log: {self.log})")

    def peak_rss_bytes(self) -> int | None:
        """Peak resident memory of the server and its children (VmHWM, summed), while it runs."""
        total, found = 0, False
        for pid in _group_pids(self.proc.pid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
                        found = True
            except (OSError, ValueError):
                continue
        return total if found else None

    def stop(self) -> None:
        """Signal the group, wait, SIGKILL what is left, reap. Safe to call twice."""
        pgid = self.proc.pid   # setsid: the server leads its own group
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, self.launch.stop_signal)
            try:
                self.proc.wait(self.launch.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)   # children that outlived their leader, or a leader that ignored us
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _pids() -> list[int]:
    try:
        return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return []


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for pid in _pids():
        try:
            if os.getpgid(pid) == pgid:
                pids.append(pid)
        except OSError:
            continue
    return pids or [pgid]


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (from /proc/<pid>/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _listening_sockets(port: int) -> set[str] | None:
    """Inodes of the sockets listening on HOST:port (any address that takes HOST's connections), from
    /proc/net/tcp{,6}; None where there is no /proc."""
    found, read = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                found.add(parts[9])
    return found if read else None


def _socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process `pid` holds open (empty when its fds cannot be read: another user's)."""
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    out.add(target[8:-1])
    except OSError:
        pass
    return out


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@contextlib.contextmanager
def running(launch: ServerLaunch, log: Path, variant: str, ready_timeout_s: float = 120.0) -> Iterator[RunningServer]:
    """Start `launch` on a free 127.0.0.1 port, wait for its readiness probe, yield it; always stop and reap it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = launch.argv(port)
    with log.open("ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **launch.env}, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise ServerError(f"{launch.engine} server for {variant} could not start: {exc}") from None
    server = RunningServer(launch, proc, port, log, variant)
    try:
        server.wait_ready(ready_timeout_s)
        server.check_owner()
        yield server
    finally:
        server.stop()
