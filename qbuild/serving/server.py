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


@dataclass(frozen=True)
class ServerLaunch:
    """How to start one server (what a `Server` plugin returns): the command, its readiness probe, how to stop it."""

    command: tuple[str, ...]        # `{port}` is replaced by the port chosen at start
    engine: str                     # for messages: "llama.cpp", "vllm" ...
    model_name: str                 # the `model` field requests send
    ready_path: str = "/health"     # GET → 200 once the model is loaded
    env: dict = field(default_factory=dict)
    stop_signal: int = signal.SIGTERM
    stop_timeout_s: float = 10.0    # after this, SIGKILL to the whole group
    ignore_eos: bool = True         # the engine honours `ignore_eos` in a completion request

    def argv(self, port: int) -> list[str]:
        return [a.replace("{port}", str(port)) for a in self.command]


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
    try:
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


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


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids or [pgid]


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
        yield server
    finally:
        server.stop()
