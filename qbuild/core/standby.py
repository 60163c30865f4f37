"""Standby workers: a worker started ahead of its step imports the step's heavy modules (torch, transformers) while
the step waits for its inputs or cores, and is handed the step when it starts."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from qbuild.core.budget import Claim, Standby
from qbuild.core.step import Step

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
            proc = subprocess.Popen([sys.executable, "-m", "qbuild.core.worker", "--standby", *preload],
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
        self._kill_group(sb.proc)
        sb.proc.wait()
        sb.proc.stdin.close()
        os.close(sb.read_fd)

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
