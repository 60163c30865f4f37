"""Standby workers: a worker started ahead of its step imports the step's heavy modules (torch, transformers) while
the step waits for its inputs or cores, and is handed the step when it starts."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from qbuild.contract.step import Step
from qbuild.pipeline.budget import Claim, Standby
from qbuild.pipeline.fork_server import ForkServer, kill_group, warm_modules

log = logging.getLogger("qbuild")


class StandbyWorkers:
    """Executor methods: standby workers: a worker started ahead of its step imports the step's heavy modules
    (torch, transformers) while the step waits for its inputs or cores, and is handed the step when it starts."""

    # --- standby workers ----------------------------------------------------------------------------
    def _may_use_standby(self, step: Step) -> bool:
        return self.jobs > 1 and bool(step.preload) and step.backend_env is None and not step.requires_gpu

    def _prestart(self, waiting: list[Step]) -> None:
        """Keep one standby worker for the steps that wait: it imports what the first of them preloads."""
        wanting = [s for s in waiting if self._may_use_standby(s)]
        keys = {s.key for s in wanting}
        if self._standby is not None:
            if self._standby.for_keys & keys:
                return
            self._retire_standby()   # every step it was for has started (or been skipped) without it
        if not wanting:
            return
        preload = wanting[0].preload
        read_fd, write_fd = os.pipe()
        # its threads: those of the step it most likely runs (OpenBLAS reads them once, when numpy loads)
        env = self._worker_env(None, write_fd, wanting[0].threads, None)
        with self._lock:
            if self._cancelled.is_set():
                os.close(read_fd), os.close(write_fd)
                return
            proc = subprocess.Popen([sys.executable, "-m", "qbuild.pipeline.worker", "--standby", *preload],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    pass_fds=(write_fd,), env=env, start_new_session=True)
            self._standby = Standby(proc, read_fd, env, preload,
                                    {s.key for s in wanting if set(s.preload) <= set(preload)})
        os.close(write_fd)

    def _take_standby(self, step: Step, claim: Claim) -> Standby | None:
        with self._lock:
            sb = self._standby
            if sb is None or step.key not in sb.for_keys or claim.gpu is not None:
                return None
            self._standby = None
        if sb.proc.poll() is not None:   # it died (killed from outside): the step starts a fresh worker
            os.close(sb.read_fd)
            return None
        return sb

    def _retire_standby(self) -> None:
        """An unused standby (end of the run, or no waiting step needs it) gets end of input and exits."""
        with self._lock:
            sb, self._standby = self._standby, None
        if sb is not None:
            self._discard(sb)

    def _discard(self, sb: Standby) -> None:
        """It has only imported modules: stop it at once."""
        self._kill_group(sb.proc.pid)
        sb.proc.wait()
        sb.proc.stdin.close()
        os.close(sb.read_fd)

    # --- the fork server (warm workers for every other step) ---------------------------------------------
    def _start_fork_server(self, steps: list[Step]) -> None:
        """Start the run's fork server: from here each step's worker in qbuild's own interpreter is forked from it."""
        if not self.warm_workers or self._fork_server is not None:
            return
        env = self._worker_env(None, -1, 1, None)   # a worker's basics; each step's own variables come with it
        del env["QBUILD_PROGRESS_FD"]
        with self._lock:
            if not self._cancelled.is_set():
                self._fork_server = ForkServer(self.store.root / "tmp", env, warm_modules([s.runner for s in steps]))

    def _stop_fork_server(self) -> None:
        with self._lock:
            server, self._fork_server = self._fork_server, None
        if server is not None:
            server.stop()

    @staticmethod
    def _kill_group(pid: int) -> None:
        kill_group(pid)
