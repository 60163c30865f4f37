"""Running one step in its own worker process: the interpreter and environment it gets, the spec it reads, its
scratch, its progress lines, and what is left of it when it is killed."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.artifacts.store import Hit, free_bytes
from qbuild.base.errors import StepFailed
from qbuild.base.hardware import machine_facts
from qbuild.contract.formats import manifest_loads_in
from qbuild.contract.step import Step

if TYPE_CHECKING:
    from qbuild.pipeline.budget import Claim
    from qbuild.pipeline.outcome import StepOutcome

log = logging.getLogger("qbuild")

EXITED = "worker exited with code "   # killed_reason writes it, killed_by_signal reads it


def killed_reason(rc: int) -> str:
    """Why a step failed whose worker wrote no result: its exit code (negative: the signal that killed it)."""
    return f"{EXITED}{rc} (killed? out of memory?)"


def killed_by_signal(reason: str | None) -> bool:
    """Whether `reason` (a failed step's error) says its worker was killed by a signal: SIGKILL from a node going
    down or the kernel's OOM killer, not an error of the step."""
    return bool(reason) and reason.startswith(EXITED + "-")


def escape(text: str) -> str:
    from rich.markup import escape as _escape

    return _escape(text)


def model_link_roots(inputs, step: Step) -> tuple[Path, ...]:
    """Where a link in a step's output may point besides its scratch and the store: its model files outside the
    store (a local checkpoint, a GGUF file, a hub snapshot with the blobs its links point at)."""
    roots = []
    for o in inputs:
        if o.path is not None:
            p = Path(o.path)
            roots.append(p.parent.parent if p.parent.name == "snapshots" else p)   # hub cache: snapshots -> ../../blobs
    if step.runtime_args.get("gguf_path"):
        roots.append(Path(step.runtime_args["gguf_path"]))
    return tuple(roots)


class WorkerLaunch:
    """Executor methods: running one step in its own worker process: the interpreter and environment it gets, the
    spec it reads, its scratch, its progress lines, and what is left of it when it is killed."""

    def _tell_threads(self, claim: Claim) -> None:
        """Write an elastic step's current thread allowance where its worker reads it (replaced atomically)."""
        with self._lock:
            tmp = self._scratch.get(claim.key)
            if tmp is None:   # not started yet: _run_in writes it
                return
            part = tmp / "threads.part"
            part.write_text(str(claim.cpus))
            os.replace(part, tmp / "threads")

    def _drop_scratch(self, tmp: Path) -> None:
        # a worker just killed may still have files in flight: retry (rmtree stops at its first error, where the
        # old ignore_errors=True went on and left what it could not remove)
        for attempt in range(10):
            try:
                self.store.owned.remove(tmp, within=self.store.root / "tmp")
                return
            except OSError:
                time.sleep(0.05 * (attempt + 1))

    def _run_in(self, tmp: Path, step: Step, outcomes: dict[str, StepOutcome], task, claim: Claim) -> Hit:
        out = tmp / "out"
        out.mkdir()
        log_path = self.store.log_path(self.run_id, step.name)
        self.store.owned.mkdirs(log_path.parent)   # logs/<run>/ inside the store, no level a link
        inputs = {role: outcomes[s.key] for role, s in step.inputs.items()}
        for o in inputs.values():
            if o.path is None and o.remote is not None:  # read through: fetch what this step reads, no more
                self.fetch_input(o, outcomes, task, claim)
        spec = {
            "name": step.name, "runner": step.runner, "params": step.params, "out": str(out),
            "inputs": {r: str(o.path) for r, o in inputs.items()},
            "input_manifests": {r: o.record for r, o in inputs.items()},
            "threads": step.threads, "device": self.device, "runtime_args": step.runtime_args,
            "result": str(tmp / "result.json"), "store_root": str(self.store.root),
        }
        if claim.elastic:
            spec["threads_file"] = str(tmp / "threads")
            self._tell_threads(claim)
        (tmp / "spec.json").write_text(json.dumps(spec, default=str))
        python = self._interpreter(step, task)
        rusage, rc = self._spawn(tmp / "spec.json", log_path, step, task, claim, python)
        if self._cancelled.is_set():
            raise StepFailed(step.name, "cancelled", str(log_path))
        try:
            result = json.loads((tmp / "result.json").read_text())
        except (OSError, ValueError):
            free = free_bytes(tmp)
            result = {"error": "[Errno 28] No space left on device" if rc != 0 and free is not None and free < 1 << 20
                      else killed_reason(rc)}
        if rc != 0 or "error" in result:
            reason = result.get("error", f"exit code {rc}")
            if step.backend_env is not None:   # an import error there is the environment's, not qbuild's
                reason += f" (in environment {step.backend_env.label}, {step.backend_env.python})"
            raise StepFailed(step.name, reason, str(log_path))
        origin = self.origins.get(step.key)
        # only `out` becomes the object: spec/result/log stay private
        provenance = {
            "kind": step.kind, "name": step.name, "variant": step.variant, "format": result.get("format", step.format),
            "scheme": step.scheme or None,
            "params": step.params, "toolchain": step.toolchain(), "runner": step.runner, "impl": step.impl_version,
            "inputs": {r: {"key": s.key, "digest": inputs[r].digest, "step": s.name} for r, s in step.inputs.items()},
            "metrics": result.get("metrics", {}), "info": result.get("info", {}),
            "timings": {"seconds": round(rusage["wall"], 3), "cpu_seconds": round(rusage["cpu"], 3),
                        "peak_rss_mb": rusage["peak_rss_mb"]},
            "recipe": {"name": origin.recipe, "path": origin.path, "sha256": origin.sha256} if origin else None,
            "run_id": self.run_id, "machine": machine_facts(),   # not in the key: `verify --rebuild` compares it
        }
        engines = manifest_loads_in(provenance["format"], step.scheme, provenance["info"])
        if engines is not None:   # which engines load it: one table (qbuild.contract.formats.LOADS_IN), not a guess per run
            provenance["loads_in"] = engines
        from qbuild.base.names import redact_tree

        return self.store.publish(step.key, out, redact_tree(provenance),   # no URL password in a manifest
                                  link_roots=model_link_roots(inputs.values(), step))

    def _interpreter(self, step: Step, task) -> str:
        """The Python that runs `step`'s worker: qbuild's own, or its backend environment (created on first use)."""
        if step.backend_env is None:
            return sys.executable
        from qbuild.envs import EnvError, ensure

        def note(message: str) -> None:
            log.info(message)
            if self.progress and task is not None:
                self.progress.update(task, description=f"{escape(step.name)}: {escape(message)}")

        try:
            return ensure(step.backend_env, log=note)
        except EnvError as exc:
            raise StepFailed(step.name, f"{exc} (variant {step.variant or '-'})") from None

    def _worker_env(self, backend_env, progress_fd: int, threads: int, gpu: str | None, kind: str | None = None) -> dict:
        from qbuild.base.worker_env import step_environ

        env = step_environ(kind, os.environ)   # an allow-list per step kind: no worker gets AWS_*, *_PASSWORD, ...
        if backend_env is not None:
            from qbuild.envs import worker_environ

            env = worker_environ(backend_env, env)
        env.update({"QBUILD_PROGRESS_FD": str(progress_fd), "OMP_NUM_THREADS": str(threads),
                    "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                    "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
                    "HF_DATASETS_OFFLINE": env.get("HF_DATASETS_OFFLINE", "1"), "PYTHONUNBUFFERED": "1",
                    "QBUILD_PARENT_PID": str(os.getpid())})
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

    def _fork(self, job: dict, write_fd: int):
        """A warm worker from the fork server (a fork, not a fresh interpreter), or None: no server, or it is gone
        (killed from outside), and then this and later steps start fresh."""
        server = self._fork_server
        if server is None:
            return None
        forked = server.start(job, write_fd)
        if forked is not None and forked.started() is None and forked.lost:
            forked.wait()
            forked = None
        if forked is None:
            self._stop_fork_server()
        return forked

    def _abandon(self, read_fd: int, write_fd: int | None, sb, forked) -> None:
        """Cancelled before the step's worker started its work: close the pipe, kill the standby or forked worker."""
        os.close(read_fd)
        if write_fd is not None:
            os.close(write_fd)
        for pid in (sb.proc.pid if sb else None, forked.pid if forked else None):
            if pid is not None:
                self._kill_group(pid)
        if forked is not None:
            forked.wait()

    def _follow_progress(self, read_fd: int, task) -> None:
        """Pass each progress line the worker writes to `task` until the worker closes its end of the pipe."""
        buf = b""
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while True:
                ready, _, _ = select.select([pipe], [], [], 0.5)
                if ready:
                    chunk = pipe.read(65536)
                    if not chunk:
                        break
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        self._on_progress(task, line)

    def _spawn(self, spec: Path, log_path: Path, step: Step, task, claim: Claim,
               python: str = sys.executable) -> tuple[dict, int]:
        sb, claim.standby = claim.standby, None
        if sb is not None and python != sys.executable:   # not for this interpreter after all: let it go
            self._discard(sb)
            sb = None
        if sb is None:
            read_fd, write_fd = os.pipe()
            env = self._worker_env(step.backend_env, write_fd, step.threads, claim.gpu, step.kind)
        else:
            read_fd, write_fd = sb.read_fd, None
            env = self._worker_env(None, int(sb.env["QBUILD_PROGRESS_FD"]), step.threads, claim.gpu, step.kind)
        job = {"spec": str(spec), "log": str(log_path), "cwd": str(spec.parent), "env": env}
        t0 = time.perf_counter()
        forked = self._fork(job, write_fd) if sb is None and python == sys.executable else None
        proc = None
        with self._lock:
            if self._cancelled.is_set():
                self._abandon(read_fd, write_fd, sb, forked)
                return {"wall": 0.0, "cpu": 0.0, "peak_rss_mb": 0.0}, -signal.SIGKILL
            if sb is not None:
                job["env"] = {k: v for k, v in env.items() if sb.env.get(k) != v}
                try:
                    sb.proc.stdin.write((json.dumps(job) + "\n").encode())
                    sb.proc.stdin.close()
                except OSError:   # it died since: the step sees a crashed worker, as with a fresh one
                    pass
                proc = sb.proc
            elif forked is None:
                with open(log_path, "ab") as log:
                    # its own session: a terminal's Ctrl-C reaches qbuild, which cancels workers (and their
                    # children). cwd: the step's scratch, so what a library writes to its working directory
                    # (gptqmodel's logs/) stays out of the user's directory and goes with the scratch
                    proc = subprocess.Popen([python, "-m", "qbuild.pipeline.worker", str(spec)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(write_fd,),
                                            env=env, start_new_session=True, cwd=spec.parent)
            pid = proc.pid if proc is not None else forked.pid
            if pid is not None:   # None: a forked worker that died before it led its session
                self._procs[step.key] = pid
        if write_fd is not None:
            os.close(write_fd)
        try:
            self._follow_progress(read_fd, task)
            rc, cpu, peak_rss_mb = forked.wait() if forked is not None else _exit_status(pid)
        except BaseException:
            # interrupted here (Ctrl-C, a Ray task's cancel): the worker dies before its scratch is removed, and
            # before its pid leaves _procs, where cancel() would have looked for it
            self._reap_killed(pid, forked)
            raise
        finally:
            with self._lock:
                self._procs.pop(step.key, None)
        if proc is not None:
            proc.returncode = rc
        return {"wall": time.perf_counter() - t0, "cpu": cpu, "peak_rss_mb": peak_rss_mb}, rc

    def _reap_killed(self, pid: int | None, forked) -> None:
        """Kill a step's worker (its whole group) and wait until it is gone, so it writes nothing more."""
        if pid is None:
            return
        self._kill_group(pid)
        try:
            if forked is not None:
                forked.wait()
            else:
                os.waitpid(pid, 0)
        except (ChildProcessError, OSError):   # reaped already (cancel() from another thread)
            pass

    def _on_progress(self, task, line: bytes) -> None:
        if not self.progress or task is None:
            return
        try:
            p = json.loads(line)
        except ValueError:
            return
        desc = f"{self.progress.tasks[task].fields.get('step', '')}"
        self.progress.update(task, completed=p["done"], total=p["total"] or None,
                             description=f"{desc}{': ' if desc else ''}{escape(str(p.get('desc', '')))}")


def _exit_status(pid: int) -> tuple[int, float, float]:
    """(exit code, CPU seconds, peak RSS in MB) of the worker process `pid`, once it has ended."""
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime, round(usage.ru_maxrss / 1024, 1)
