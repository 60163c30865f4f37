"""Runs the missing steps of a plan: in parallel where resources allow, each in its own worker process.

Scheduling. A step starts when its inputs are done and it fits: the threads of the running steps never
exceed the machine's cores (`runtime.threads` per step × concurrent steps ≤ cores), at most `jobs` steps
run at once, a step that needs a GPU gets a free device of its own (CUDA_VISIBLE_DEVICES), and the memory
estimated from its inputs' sizes fits in what is available. Timing steps (throughput: their key holds the
hardware) run alone, so no other step disturbs what they measure.

Elastic threads. Cores that no step can use (nothing else is ready) go to the running steps whose numbers do
not depend on the thread count (Step.elastic_threads: perplexity and reference passes, with `threads: auto`).
The executor rewrites such a step's allowance file (`threads` in its scratch) and the step follows it between
forward passes; before another step starts, every elastic step is given back its own share.

Standby workers. While steps that declare heavy imports (Step.preload: torch and transformers take 4-6 s)
wait, one worker process is started ahead (`qbuild.core.worker --standby`) and imports them; the first of those
steps to start is handed to it instead of a fresh process. Still one process per step, with its own variables.

Cancellation. Ctrl-C / SIGTERM (the CLI turns SIGTERM into the same path) kills every running worker's
process group, removes their scratch, and re-raises; what finished stays stored, so the next run resumes.
Workers run in their own session (a terminal's Ctrl-C reaches qbuild only) and die with their parent.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.artifacts.store import NO_SPACE, Hit, Store, free_bytes, now_iso, store_full
from qbuild.core.hardware import gpu_devices, machine_facts
from qbuild.core.plan import PlannedStep
from qbuild.core.step import OnUnavailable, Outcome, PlanStatus, Step
from qbuild.errors import StepFailed, UserError
from qbuild.formats import manifest_loads_in
from qbuild.formats import spec as format_spec

log = logging.getLogger("qbuild")

if TYPE_CHECKING:
    from qbuild.artifacts.remote.cache import RemoteHit

UNBUILDABLE = (PlanStatus.NEEDS_GPU, PlanStatus.UNAVAILABLE)
MEMORY_FACTOR = 2.5   # peak RSS of a step that loads a model ≈ this × the model's size on disk (measured: 1.9-2.4)


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


@dataclass
class StepOutcome:
    step: Step
    status: Outcome
    path: Path | None = None
    digest: str | None = None
    seconds: float = 0.0
    record: dict = field(default_factory=dict)
    error: str | None = None
    log: str | None = None
    remote: RemoteHit | None = None   # a remote hit not (yet) fetched: path is None until materialized
    started: float | None = None      # wall-clock start/end of a build (time.time()), for `--json` and tests
    ended: float | None = None
    worker: str | None = None         # where it was built (the Ray executor: the node), None for this machine

    @property
    def metrics(self) -> dict:
        return self.record.get("metrics", {}) if self.record else {}

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.record.get("files", [])) if self.record else 0


@dataclass(frozen=True)
class Origin:
    """The recipe a step is built for: its provenance and its `plan` history."""

    recipe: str
    path: str
    sha256: str | None = None


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory_mb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


@dataclass
class Standby:
    """A worker started ahead of its step: it imports `preload` and waits on stdin for a step."""

    proc: subprocess.Popen
    read_fd: int     # its progress pipe (the worker writes to the other end)
    env: dict        # the variables it was started with; a step sends only those it needs changed
    preload: tuple[str, ...]
    for_keys: set[str]   # the waiting steps it was started for (a step started at once never needed it)


@dataclass
class Claim:
    """What a running step holds of the machine (Budget.claim); elastic steps' `cpus` grows and shrinks."""

    cpus: int
    memory_mb: float
    gpu: str | None
    alone: bool
    key: str = ""
    base: int = 0                      # the threads the step asked for (what an elastic step returns to)
    elastic: bool = False
    standby: Standby | None = None     # a worker started ahead for this step, if one was


@dataclass
class Budget:
    """What the machine can give running steps; a step takes a claim and gives it back when it ends."""

    cpus: int            # free cores
    jobs: int
    memory_mb: float     # free memory
    gpus: list[str]      # free devices
    running: int = 0
    exclusive: bool = False

    def __post_init__(self):
        self.cores = self.cpus

    def claim(self, step: Step, memory_mb: float, alone: bool) -> Claim | None:
        threads = min(max(step.threads, 1), self.cores)  # a step wanting more cores than exist gets them all
        if self.exclusive or (alone and self.running) or self.running >= self.jobs:
            return None
        if self.running and (threads > self.cpus or memory_mb > self.memory_mb):
            return None
        if step.requires_gpu and not self.gpus and self.running:
            return None
        claim = Claim(cpus=threads, memory_mb=memory_mb, gpu=self.gpus.pop(0) if step.requires_gpu and self.gpus
                      else None, alone=alone, key=step.key, base=threads, elastic=step.elastic_threads)
        self.cpus -= threads
        self.memory_mb -= memory_mb
        self.running += 1
        self.exclusive = alone
        return claim

    def take_back_idle_share(self, claims) -> None:
        """Every elastic step returns to its own threads, so a step about to start finds its cores free."""
        for c in claims:
            extra = c.cpus - c.base
            if extra > 0:
                self.cpus += extra
                c.cpus -= extra

    def share_idle(self, claims) -> None:
        """Hand cores no step could take to the running elastic steps, one at a time to the one with fewest."""
        elastic = [c for c in claims if c.elastic]
        while self.cpus > 0 and elastic and not self.exclusive:
            c = min(elastic, key=lambda c: c.cpus)
            if c.cpus >= self.cores:
                break
            c.cpus += 1
            self.cpus -= 1

    def release(self, claim: Claim) -> None:
        self.cpus += claim.cpus
        self.memory_mb += claim.memory_mb
        if claim.gpu is not None:
            self.gpus.append(claim.gpu)
        self.running -= 1
        self.exclusive = False


class Executor:
    def __init__(self, store: Store, run_id: str, origins: dict[str, Origin], *, progress=None, device: str = "auto",
                 jobs: int | None = None, remotes: tuple = (), materialize: bool = False, verify: str = "fast"):
        self.store = store
        self.verify = verify          # how a hit found under the lock is checked (see Store.lookup)
        self.run_id = run_id
        self.origins = origins        # step key → the (first) recipe it is built for
        self.progress = progress
        self.device = device
        self.jobs = max(1, jobs or cpu_count())
        self.remotes = tuple(remotes)
        self.materialize_all = materialize  # fetch every remote hit, not only what a step that runs reads
        self._procs: dict[str, subprocess.Popen] = {}   # step key → running worker
        self._standby: Standby | None = None
        self._scratch: dict[str, Path] = {}             # step key → its private build dir
        self._lock = threading.Lock()
        self._cancelled = threading.Event()

    # --- scheduling ------------------------------------------------------------------------------------
    def run(self, planned: list[PlannedStep]) -> list[StepOutcome]:
        blocked = [ps for ps in planned if ps.status in UNBUILDABLE and ps.step.on_unavailable != OnUnavailable.SKIP]
        if blocked:  # fail before any work (exit 2), naming each step and why
            raise UserError("cannot run on this machine: " + "; ".join(f"step {ps.step.name}: {ps.reason}" for ps in blocked)
                            + " (set on_missing_gpu: skip on the target to build the rest)")
        to_build = [ps.step.name for ps in planned if ps.status == PlanStatus.MISS]
        if to_build:  # a read-only store serves hits; building needs a writable one (say so before any work)
            self.store.require_writable(f"building {len(to_build)} step(s) ({', '.join(to_build[:3])}"
                                        f"{', ...' if len(to_build) > 3 else ''})")
            self.store.clean_stale()
        budget = Budget(cpus=cpu_count(), jobs=self.jobs, memory_mb=available_memory_mb() * 0.9,
                        gpus=gpu_devices() if any(ps.step.requires_gpu and ps.status == PlanStatus.MISS
                                                  for ps in planned) else [])
        outcomes: dict[str, StepOutcome] = {}
        pending = list(planned)
        running: dict[Future, tuple[PlannedStep, dict]] = {}
        pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="qbuild-step")
        try:
            while pending or running:
                before = {id(c): c.cpus for _, c in running.values()}
                budget.take_back_idle_share([c for _, c in running.values()])
                for ps in list(pending):
                    inputs = [outcomes.get(s.key) for s in ps.step.inputs.values()]
                    if any(o is None for o in inputs):
                        continue  # an input is still running (or waiting)
                    done = self._resolve_without_building(ps, inputs)
                    if done is not None:
                        outcomes[ps.step.key] = done
                        pending.remove(ps)
                        continue
                    claim = budget.claim(ps.step, self._memory_estimate(ps.step, outcomes), ps.step.per_hardware)
                    if claim is None:
                        continue
                    pending.remove(ps)
                    claim.standby = self._take_standby(ps.step, claim)   # here, before _prestart looks again
                    if claim.alone and claim.standby is None:
                        self._retire_standby()   # nothing may run beside a timing step, a standby's imports neither
                    running[pool.submit(self._build, ps.step, outcomes, claim)] = (ps, claim)
                # the waiting steps, nearest to ready first (fewest inputs still to build)
                if not budget.exclusive:
                    self._prestart(sorted((ps.step for ps in pending if ps.status == PlanStatus.MISS),
                                          key=lambda s: sum(outcomes.get(i.key) is None for i in s.inputs.values())))
                budget.share_idle([c for _, c in running.values()])
                for _, c in running.values():
                    if c.elastic and before.get(id(c), c.cpus) != c.cpus:
                        self._tell_threads(c)
                if not running:
                    if pending:  # nothing runs and nothing can start: inputs missing from the plan (a bug)
                        raise RuntimeError(f"cannot schedule {[ps.step.name for ps in pending]}")
                    break
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in finished:
                    ps, claim = running.pop(fut)
                    budget.release(claim)
                    outcomes[ps.step.key] = fut.result()
        except BaseException:
            self.cancel()
            wait(list(running))
            raise
        finally:
            pool.shutdown(wait=True)
            self._retire_standby()
        for ps in planned:
            if outcomes[ps.step.key].status in (Outcome.BUILT, Outcome.CACHED):
                self._remember(ps.step)
        return [outcomes[ps.step.key] for ps in planned]

    def _resolve_without_building(self, ps: PlannedStep, inputs: list[StepOutcome]) -> StepOutcome | None:
        step = ps.step
        broken = [s.name for s, o in zip(step.inputs.values(), inputs, strict=True)
                  if o.status in (Outcome.FAILED, Outcome.SKIPPED)]
        if ps.status == PlanStatus.SOURCE:
            return StepOutcome(step, Outcome.SOURCE, path=step.source_path)
        if broken:
            return StepOutcome(step, Outcome.SKIPPED, error=f"input failed: {', '.join(broken)}")
        if ps.status == PlanStatus.HIT:
            return StepOutcome(step, Outcome.CACHED, ps.hit.path, ps.hit.digest, record=ps.hit.record)
        if ps.status == PlanStatus.REMOTE_HIT:  # the action record holds the manifest: metrics need no fetch
            rh = ps.remote_hit
            outcome = StepOutcome(step, Outcome.CACHED, None, rh.digest, record=rh.record, remote=rh)
            if self.materialize_all:
                self.materialize(outcome)
            return outcome
        if ps.status in UNBUILDABLE:
            return StepOutcome(step, Outcome.SKIPPED, error=ps.reason)
        return None

    def _memory_estimate(self, step: Step, outcomes: dict[str, StepOutcome]) -> float:
        """MEMORY_FACTOR × the size of the model artifacts a step reads (MiB); 0 when it reads none."""
        total = 0
        for s in step.inputs.values():
            if not format_spec(s.format).model:
                continue
            o = outcomes[s.key]
            if o.record:
                total += o.size
            elif o.path is not None and o.path.is_dir():  # a source: the local model directory
                total += sum(f.stat().st_size for f in o.path.rglob("*") if f.is_file())
        return MEMORY_FACTOR * total / 2**20

    def _tell_threads(self, claim: Claim) -> None:
        """Write an elastic step's current thread allowance where its worker reads it (replaced atomically)."""
        with self._lock:
            tmp = self._scratch.get(claim.key)
            if tmp is None:   # not started yet: _run_in writes it
                return
            part = tmp / "threads.part"
            part.write_text(str(claim.cpus))
            os.replace(part, tmp / "threads")

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

    def cancel(self) -> None:
        """Kill every running worker (its whole process group) and remove its scratch."""
        self._cancelled.set()
        with self._lock:
            procs, scratch = dict(self._procs), dict(self._scratch)
            sb = self._standby
        if sb is not None:
            self._kill_group(sb.proc)
        for proc in procs.values():
            self._kill_group(proc)
        for tmp in scratch.values():
            self._drop_scratch(tmp)

    def _drop_scratch(self, tmp: Path) -> None:
        # a worker just killed may still have files in flight: retry (rmtree stops at its first error, where the
        # old ignore_errors=True went on and left what it could not remove)
        for attempt in range(10):
            try:
                self.store.owned.remove(tmp, within=self.store.root / "tmp")
                return
            except OSError:
                time.sleep(0.05 * (attempt + 1))

    # --- one step ---------------------------------------------------------------------------------------
    def materialize(self, outcome: StepOutcome, task=None) -> Path:
        """Fetch a remote hit's object into the local store (every file verified) and point the outcome at it."""
        from qbuild.artifacts.remote.cache import materialize

        rh = outcome.remote
        progress = None
        if self.progress is not None and task is not None:
            def progress(done, total):
                self.progress.update(task, completed=done, total=total or None,
                                     description=f"{escape(outcome.step.name)}: fetching from {escape(rh.remote.name)}")
        outcome.path = materialize(self.store, rh.remote, rh.digest, rh.key, rh.record, progress=progress)
        return outcome.path

    def _push_built(self, hit: Hit) -> None:
        """Write-through right after a build, to every remote whose policy is `push: always`."""
        from qbuild.artifacts.remote.cache import push_hit, should_push

        for remote in self.remotes:
            if should_push(remote, "step"):
                push_hit(remote, self.store, hit.key, hit.digest, hit.record)

    def _remember(self, step: Step) -> None:
        origin = self.origins.get(step.key)
        if origin is None:
            return
        last = self.store.last_build(origin.recipe, step.name)
        if last is None or last.get("key") != step.key:
            from qbuild.core.names import redact_tree

            self.store.remember_build(origin.recipe, step.name, {
                "key": step.key, "params": redact_tree(step.params), "inputs": step.input_keys(),
                "toolchain": step.toolchain(), "impl": step.impl_version, "when": now_iso()})

    def _build(self, step: Step, outcomes: dict[str, StepOutcome], claim: Claim) -> StepOutcome:
        task = self.progress.add_task(escape(step.name), total=None, step=escape(step.name)) if self.progress else None
        t0, started = time.perf_counter(), time.time()
        try:
            with self.store.lock(step.key):
                hit = self.store.lookup(step.key, self.verify)  # another run may have built it while we waited
                if hit:
                    return StepOutcome(step, Outcome.CACHED, hit.path, hit.digest, record=hit.record)
                hit = self._run_worker(step, outcomes, task, claim)
                self._push_built(hit)
                return StepOutcome(step, Outcome.BUILT, hit.path, hit.digest, time.perf_counter() - t0, hit.record,
                                   started=started, ended=time.time())
        except StepFailed as exc:
            return StepOutcome(step, Outcome.FAILED, seconds=time.perf_counter() - t0, error=exc.reason, log=exc.log,
                               started=started, ended=time.time())
        finally:
            if claim.get("standby") is not None:   # the step did not start a worker (a hit, an error): stop it
                self._discard(claim.standby)
                claim.standby = None
            if self.progress and task is not None:
                self.progress.update(task, visible=False)

    def _output_estimate(self, step: Step, outcomes: dict[str, StepOutcome]) -> int:
        """Rough bytes a step writes: a quantized model is at least a quarter of the model it reads (0: unknown)."""
        total = 0
        for s in step.inputs.values():
            o = outcomes.get(s.key)
            if o is None or not format_spec(s.format).model:
                continue
            if o.record:
                total = max(total, o.size)
            elif o.path is not None and o.path.is_dir():  # a source: the local model directory
                total = max(total, sum(f.stat().st_size for f in o.path.rglob("*") if f.is_file()))
        return total // 4

    def _run_worker(self, step: Step, outcomes: dict[str, StepOutcome], task, claim: Claim) -> Hit:
        needed = self._output_estimate(step, outcomes)
        free = free_bytes(self.store.root)
        if needed and free is not None and free < needed:
            raise store_full(self.store.root, f"the output of step {step.name} (estimated)", needed)
        try:
            tmp = self.store.new_tmp(step.key)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise store_full(self.store.root, f"the scratch of step {step.name}", needed) from None
            raise
        with self._lock:
            self._scratch[step.key] = tmp
        try:
            return self._run_in(tmp, step, outcomes, task, claim)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise store_full(self.store.root, f"the scratch of step {step.name}", needed) from None
            raise
        except StepFailed as exc:
            if "No space left on device" in exc.reason or "[Errno 28]" in exc.reason or "[Errno 122]" in exc.reason:
                written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file() and not f.is_symlink())
                raise store_full(self.store.root, f"the output of step {step.name} ({written} bytes written when "
                                 "the disk filled)", max(needed, written)) from None
            raise
        finally:  # published (out/ renamed into objects/), failed or cancelled: the scratch goes
            self._drop_scratch(tmp)
            with self._lock:
                self._scratch.pop(step.key, None)

    def _run_in(self, tmp: Path, step: Step, outcomes: dict[str, StepOutcome], task, claim: Claim) -> Hit:
        out = tmp / "out"
        out.mkdir()
        log_path = self.store.log_path(self.run_id, step.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        inputs = {role: outcomes[s.key] for role, s in step.inputs.items()}
        for o in inputs.values():
            if o.path is None and o.remote is not None:  # read through: fetch what this step reads, no more
                self.materialize(o, task)
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
                      else f"worker exited with code {rc} (killed? out of memory?)"}
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
        if engines is not None:   # which engines load it: one table (qbuild.formats.LOADS_IN), not a guess per run
            provenance["loads_in"] = engines
        from qbuild.core.names import redact_tree

        return self.store.publish(step.key, out, redact_tree(provenance),   # no URL password in a manifest
                                  link_roots=model_link_roots(inputs.values(), step))

    def _interpreter(self, step: Step, task) -> str:
        """The Python that runs `step`'s worker: qbuild's own, or its backend environment (created on first use)."""
        if step.backend_env is None:
            return sys.executable
        from qbuild.core.envs import EnvError, ensure

        def note(message: str) -> None:
            log.info(message)
            if self.progress and task is not None:
                self.progress.update(task, description=f"{escape(step.name)}: {escape(message)}")

        try:
            return ensure(step.backend_env, log=note)
        except EnvError as exc:
            raise StepFailed(step.name, f"{exc} (variant {step.variant or '-'})") from None

    def _worker_env(self, backend_env, progress_fd: int, threads: int, gpu: str | None, kind: str | None = None) -> dict:
        from qbuild.core.worker_env import step_environ

        env = step_environ(kind, os.environ)   # an allow-list per step kind: no worker gets AWS_*, *_PASSWORD, ...
        if backend_env is not None:
            from qbuild.core.envs import worker_environ

            env = worker_environ(backend_env, env)
        env.update({"QBUILD_PROGRESS_FD": str(progress_fd), "OMP_NUM_THREADS": str(threads),
                    "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                    "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
                    "HF_DATASETS_OFFLINE": env.get("HF_DATASETS_OFFLINE", "1"), "PYTHONUNBUFFERED": "1",
                    "QBUILD_PARENT_PID": str(os.getpid())})
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

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
        t0 = time.perf_counter()
        with self._lock:
            if self._cancelled.is_set():
                os.close(read_fd)
                if write_fd is not None:
                    os.close(write_fd)
                if sb is not None:
                    self._kill_group(sb.proc)
                return {"wall": 0.0, "cpu": 0.0, "peak_rss_mb": 0.0}, -signal.SIGKILL
            if sb is not None:
                proc = sb.proc
                job = {"spec": str(spec), "log": str(log_path), "cwd": str(spec.parent),
                       "env": {k: v for k, v in env.items() if sb.env.get(k) != v}}
                try:
                    proc.stdin.write((json.dumps(job) + "\n").encode())
                    proc.stdin.close()
                except OSError:   # it died since: the step sees a crashed worker, as with a fresh one
                    pass
            else:
                with open(log_path, "ab") as log:
                    # its own session: a terminal's Ctrl-C reaches qbuild, which cancels workers (and their
                    # children). cwd: the step's scratch, so what a library writes to its working directory
                    # (gptqmodel's logs/) stays out of the user's directory and goes with the scratch
                    proc = subprocess.Popen([python, "-m", "qbuild.core.worker", str(spec)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(write_fd,),
                                            env=env, start_new_session=True, cwd=spec.parent)
            self._procs[step.key] = proc
        if write_fd is not None:
            os.close(write_fd)
        buf = b""
        try:
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
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            with self._lock:
                self._procs.pop(step.key, None)
        rc = os.waitstatus_to_exitcode(status)
        proc.returncode = rc
        return {"wall": time.perf_counter() - t0, "cpu": usage.ru_utime + usage.ru_stime,
                "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}, rc

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
