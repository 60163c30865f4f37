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
wait, one worker process is started ahead (`qbuild.pipeline.worker --standby`) and imports them; the first of those
steps to start is handed to it instead of a fresh process. Still one process per step, with its own variables.

Warm workers. Every other step's worker (qbuild's own interpreter) is forked by the run's fork server
(fork_server.py), which imported qbuild's worker modules once: a fresh process per step without a fresh
interpreter's ~180 ms start-up, the per-step overhead a search of hundreds of candidate steps pays.

Cancellation. Ctrl-C / SIGTERM (the CLI turns SIGTERM into the same path) kills every running worker's
process group, removes their scratch, and re-raises; what finished stays stored, so the next run resumes.
Workers run in their own session (a terminal's Ctrl-C reaches qbuild only) and die with their parent.

Where the parts live: the scheduling loop, hits and outputs here; the machine's budget in budget.py; standby
workers in standby.py; starting, feeding and reaping one step's worker process in worker_launch.py.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.artifacts.remote.base import RemoteRefused
from qbuild.artifacts.store import NO_SPACE, Hit, Store, free_bytes, now_iso, store_full
from qbuild.base.errors import StepFailed, UserError
from qbuild.base.files import dir_size
from qbuild.base.hardware import gpu_devices
from qbuild.contract.formats import spec as format_spec
from qbuild.contract.step import OnUnavailable, Outcome, PlanStatus, Step
from qbuild.pipeline.budget import Budget, Claim, available_memory_mb, cpu_count
from qbuild.pipeline.outcome import Origin, StepOutcome
from qbuild.pipeline.plan import PlannedStep
from qbuild.pipeline.standby import Standby, StandbyWorkers
from qbuild.pipeline.worker_launch import WorkerLaunch, escape

if TYPE_CHECKING:
    pass

log = logging.getLogger("qbuild")

UNBUILDABLE = (PlanStatus.NEEDS_GPU, PlanStatus.UNAVAILABLE)

MEMORY_FACTOR = 2.5   # peak RSS of a step that loads a model ≈ this × the model's size on disk (measured: 1.9-2.4)


class Executor(StandbyWorkers, WorkerLaunch):
    warm_workers = True   # fork the steps' workers from a fork server (False: a fresh interpreter per step)

    def __init__(self, store: Store, run_id: str, origins: dict[str, Origin], *, progress=None, device: str = "auto",
                 jobs: int | None = None, remotes: tuple = (), materialize: bool = False, verify: str = "fast",
                 time_limits=()):
        self.store = store
        # a TimeLimit (qbuild.pipeline.plan) of each limited step, and when each limit's first step started
        self._limits = {s.key: limit for limit in time_limits for s in limit.steps}
        self._limit_started: dict[str, float] = {}
        self._limit_hit: set[str] = set()
        self.verify = verify          # how a hit found under the lock is checked (see Store.lookup)
        self.run_id = run_id
        self.origins = origins        # step key → the (first) recipe it is built for
        self.progress = progress
        self.device = device
        self.jobs = max(1, jobs or cpu_count())
        self.remotes = tuple(remotes)
        self.materialize_all = materialize  # fetch every remote hit, not only what a step that runs reads
        self._procs: dict[str, int] = {}                # step key → its running worker's pid (its process group)
        self._standby: Standby | None = None
        self._fork_server = None                        # forks the steps' workers (started by run())
        self._scratch: dict[str, Path] = {}             # step key → its private build dir
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._remote_missed: set[str] = set()           # remote hits whose copy failed verification: built here

    # --- scheduling ------------------------------------------------------------------------------------
    def run(self, planned: list[PlannedStep]) -> list[StepOutcome]:
        self._prepare(planned)
        budget = Budget(cpus=cpu_count(), jobs=self.jobs, memory_mb=available_memory_mb() * 0.9,
                        gpus=gpu_devices() if any(ps.step.requires_gpu and ps.status == PlanStatus.MISS
                                                  for ps in planned) else [],
                        disk_free=lambda: free_bytes(self.store.root))
        outcomes: dict[str, StepOutcome] = {}
        pending = list(planned)
        running: dict[Future, tuple[PlannedStep, dict]] = {}
        pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="qbuild-step")
        try:
            while pending or running:
                before = {id(c): c.cpus for _, c in running.values()}
                budget.take_back_idle_share([c for _, c in running.values()])
                self._start_ready(pending, outcomes, budget, pool, running)
                # the waiting steps, nearest to ready first (fewest inputs still to build)
                if not budget.exclusive:
                    self._prestart(sorted((ps.step for ps in pending if ps.status == PlanStatus.MISS),
                                          key=lambda s: sum(outcomes.get(i.key) is None for i in s.prerequisites())))
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
            self._stop_fork_server()
        for ps in planned:
            if outcomes[ps.step.key].status in (Outcome.BUILT, Outcome.CACHED):
                self._remember(ps.step)
        return [outcomes[ps.step.key] for ps in planned]

    def _prepare(self, planned: list[PlannedStep]) -> None:
        """Before any work: refuse steps this machine cannot run (exit 2, each step and why), and where steps are to
        be built, a writable store (a read-only one serves hits), its stale scratch cleaned, the fork server up."""
        blocked = [ps for ps in planned if ps.status in UNBUILDABLE and ps.step.on_unavailable != OnUnavailable.SKIP]
        if blocked:
            hint = " (set on_missing_gpu: skip on the target to build the rest)" \
                if any(ps.status == PlanStatus.NEEDS_GPU for ps in blocked) else ""
            by_reason: dict[str, list[str]] = {}   # one reason said once, with every step it stops
            for ps in blocked:
                by_reason.setdefault(ps.reason, []).append(ps.step.name)
            raise UserError("cannot run on this machine: " + "; ".join(
                f"step{'s' if len(names) > 1 else ''} {', '.join(names)}: {reason}"
                for reason, names in by_reason.items()) + hint)
        to_build = [ps.step.name for ps in planned if ps.status == PlanStatus.MISS]
        if to_build:
            self.store.require_writable(f"building {len(to_build)} step(s) ({', '.join(to_build[:3])}"
                                        f"{', ...' if len(to_build) > 3 else ''})")
            self.store.clean_stale()
            self._start_fork_server([ps.step for ps in planned if ps.status == PlanStatus.MISS])

    def _start_ready(self, pending: list[PlannedStep], outcomes: dict[str, StepOutcome], budget: Budget,
                     pool: ThreadPoolExecutor, running: dict) -> None:
        """Settle or start every pending step whose inputs are done: a hit or a skip without building, a step past its
        time limit stopped, the others started in `pool` as far as the budget lets them."""
        for ps in list(pending):
            inputs = [outcomes.get(s.key) for s in ps.step.prerequisites()]
            if any(o is None for o in inputs):
                continue  # an input is still running (or waiting)
            done = self._resolve_without_building(ps, inputs)
            if done is None:
                done = self._past_time_limit(ps.step, outcomes)
            if done is not None:
                outcomes[ps.step.key] = done
                pending.remove(ps)
                continue
            claim = budget.claim(ps.step, self._memory_estimate(ps.step, outcomes), ps.step.per_hardware,
                                 self._output_estimate(ps.step, outcomes))
            if claim is None:
                continue
            pending.remove(ps)
            if ps.step.key in self._limits:
                self._limit_started.setdefault(self._limits[ps.step.key].field, time.monotonic())
            claim.standby = self._take_standby(ps.step, claim)   # here, before _prestart looks again
            if claim.alone and claim.standby is None:
                self._retire_standby()   # nothing may run beside a timing step, a standby's imports neither
            running[pool.submit(self._build, ps.step, outcomes, claim)] = (ps, claim)

    def _past_time_limit(self, step: Step, outcomes: dict[str, StepOutcome]) -> StepOutcome | None:
        """A step of a time-limited set (a search's max_minutes) is not started once the set has run longer than its
        limit: the first one fails with one line that says what is stored, the rest are skipped. What finished stays
        stored, so a rerun resumes; no result depends on the clock, only whether the run goes on."""
        limit = self._limits.get(step.key)
        started = self._limit_started.get(limit.field) if limit is not None else None
        if started is None or (minutes := (time.monotonic() - started) / 60) <= limit.minutes:
            return None
        if limit.field in self._limit_hit:
            return StepOutcome(step, Outcome.SKIPPED, error=f"{limit.what} stopped at max_minutes")
        self._limit_hit.add(limit.field)
        done = sum(1 for s in limit.steps
                   if (o := outcomes.get(s.key)) is not None and o.status in (Outcome.BUILT, Outcome.CACHED))
        return StepOutcome(step, Outcome.FAILED, error=(
            f"{limit.what} stopped after {minutes:.1f} min ({limit.field} {limit.minutes:g}): {done} of "
            f"{len(limit.steps)} of its steps are stored; rerun to resume, or raise max_minutes"))

    def _resolve_without_building(self, ps: PlannedStep, inputs: list[StepOutcome]) -> StepOutcome | None:
        step = ps.step
        broken = [s.name for s, o in zip(step.prerequisites(), inputs, strict=True)
                  if o.status in (Outcome.FAILED, Outcome.SKIPPED)]
        if ps.status == PlanStatus.SOURCE:
            return StepOutcome(step, Outcome.SOURCE, path=step.source_path)
        if broken:
            return StepOutcome(step, Outcome.SKIPPED, error=f"input failed: {', '.join(broken)}")
        if ps.status == PlanStatus.HIT:
            return StepOutcome(step, Outcome.CACHED, ps.hit.path, ps.hit.digest, record=ps.hit.record)
        if ps.status == PlanStatus.REMOTE_HIT and step.key not in self._remote_missed:
            # the action record holds the manifest: metrics need no fetch
            rh = ps.remote_hit
            outcome = StepOutcome(step, Outcome.CACHED, None, rh.digest, record=rh.record, remote=rh)
            if self.materialize_all:
                try:
                    self.materialize(outcome)
                except RemoteRefused as exc:   # the remote's copy is damaged: a miss, built here like one
                    self._remote_damaged(outcome, exc)
                    return None
            return outcome
        if ps.status in UNBUILDABLE:
            return StepOutcome(step, Outcome.SKIPPED, error=ps.reason)
        return None

    def _memory_estimate(self, step: Step, outcomes: dict[str, StepOutcome]) -> float:
        """MEMORY_FACTOR × the size of the model artifacts a step reads (MiB); 0 when it reads none."""
        return MEMORY_FACTOR * sum(self._model_input_sizes(step, outcomes)) / 2**20

    @staticmethod
    def _model_input_sizes(step: Step, outcomes: dict[str, StepOutcome]) -> list[int]:
        """The size in bytes of each model artifact a step reads that is built or found (a source: its directory)."""
        sizes = []
        for s in step.inputs.values():
            o = outcomes.get(s.key)
            if o is None or not format_spec(s.format).model:
                continue
            if o.record:
                sizes.append(o.size)
            elif o.path is not None and o.path.is_dir():  # a source: the local model directory
                sizes.append(dir_size(o.path))
        return sizes

    def cancel(self) -> None:
        """Kill every running worker (its whole process group) and remove its scratch."""
        self._cancelled.set()
        with self._lock:
            procs, scratch = dict(self._procs), dict(self._scratch)
            sb, server = self._standby, self._fork_server
        if sb is not None:
            self._kill_group(sb.proc.pid)
        for pid in procs.values():
            self._kill_group(pid)
        if server is not None:
            self._kill_group(server.proc.pid)
        for tmp in scratch.values():
            self._drop_scratch(tmp)

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

    def fetch_input(self, outcome: StepOutcome, outcomes: dict[str, StepOutcome], task, claim: Claim) -> None:
        """Bring a remote hit a step reads into the local store; when the remote's copy fails verification (a file's
        bytes, a forged manifest) the input is built here instead, as a miss, with the reading step's claim. The
        run's push then replaces the damaged copy (remote.damaged)."""
        try:
            self.materialize(outcome, task)
            return
        except RemoteRefused as exc:
            self._remote_damaged(outcome, exc)
        step, standby = outcome.step, claim.standby
        claim.standby = None   # the reading step's standby waits for it
        try:
            with self.store.lock(step.key):
                hit = self.store.lookup(step.key, self.verify) or self._run_worker(step, outcomes, task, claim)
        finally:
            claim.standby = standby
        outcome.status, outcome.path, outcome.digest, outcome.record, outcome.remote = (
            Outcome.BUILT, hit.path, hit.digest, hit.record, None)

    def _remote_damaged(self, outcome: StepOutcome, exc: RemoteRefused) -> None:
        with self._lock:
            if outcome.step.key in self._remote_missed:
                return
            self._remote_missed.add(outcome.step.key)
        log.warning(f"remote {outcome.remote.remote.name}: {exc.reason}; building {outcome.step.name} here instead")

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
            from qbuild.base.names import redact_tree

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
            if claim.standby is not None:   # the step did not start a worker (a hit, an error): stop it
                self._discard(claim.standby)
                claim.standby = None
            if self.progress and task is not None:
                self.progress.update(task, visible=False)

    def _output_estimate(self, step: Step, outcomes: dict[str, StepOutcome]) -> int:
        """Rough bytes a step writes: a quantized model is at least a quarter of the model it reads, a step with scratch
        (a search's probe file) that share of it (0: unknown)."""
        total = max(self._model_input_sizes(step, outcomes), default=0)
        return max(total // 4, int(total * step.scratch))

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
