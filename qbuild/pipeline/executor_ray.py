"""`qbuild run --executor ray`: each step that must be built is a Ray task on a cluster.

Ray's own API does the distributed part: `ray.remote` tasks with the step's resources (num_cpus = its threads,
num_gpus for GPU steps, a custom resource `sm_<major><minor>` for steps bound to a GPU model, e.g. TensorRT
engine builds: start such nodes with `--resources '{"sm_90": 1}'`), `ray.wait` for completions, `max_retries`
so a step lost with its node is run again elsewhere (safe: publishing is atomic and keyed, and a retried step
first looks for an object another attempt already pushed), `ray.cancel` on Ctrl-C / SIGTERM.

Every node keeps its own local store (env QBUILD_NODE_STORE on the node, default <QBUILD_CACHE>/ray-store) in
front of the shared remote store (the recipe's first store.remotes entry, or --remote / QBUILD_REMOTE): a task
pulls the inputs it reads from the remote, builds in a worker process exactly as the local executor does, and
pushes its output to the remote before it returns. The driver never needs the files: what a step built reaches
the summary through its manifest (metrics, sizes); `--materialize` fetches every object into the driver's store.
Progress lines come back through a Ray queue pinned to the driver's node; each step's log is written into the
driver's store (logs/<run>/<step>.log) when the step ends.

Source models (a local directory) must be at the same path on every node (a shared mount), or come from the hub.
This module is the only one that imports ray.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from qbuild.artifacts.remote.cache import RemoteHit, push_hit
from qbuild.artifacts.store import Store
from qbuild.base.errors import UserError, first_line
from qbuild.contract.step import Outcome, Step
from qbuild.pipeline.budget import Claim
from qbuild.pipeline.executor import UNBUILDABLE, Executor
from qbuild.pipeline.outcome import Origin, StepOutcome
from qbuild.pipeline.plan import PlannedStep
from qbuild.pipeline.worker_launch import escape, killed_by_signal

MAX_RETRIES = 3          # a step whose node (or worker process) dies is run again, up to this many times
CANCEL_GRACE_S = 10      # on Ctrl-C, how long a task may take to stop its worker and remove its scratch (a loaded node)
LOG_LIMIT = 4 << 20      # bytes of a step's log sent back to the driver
PROBE_TIMEOUT_S = 5      # a cluster address that accepts no TCP connection in this long is reported dead


class WorkerKilled(RuntimeError):
    """The step's worker process on a node was killed by a signal. Its node going down kills it (and the task can
    live long enough to report that, as a failed step, before the node is gone) and so does the kernel's OOM
    killer: either way the step is run again, on any node, like a task lost with its node (`max_retries`)."""


def need_remote_message() -> str:
    return ("--executor ray needs a shared remote store that every node reads inputs from and pushes outputs to: "
            "add store.remotes to the recipe, or pass --remote s3://BUCKET/PREFIX (or file:///shared/mount; "
            "env QBUILD_REMOTE)")


def _ray():
    try:
        import ray
    except ImportError:
        raise UserError("--executor ray needs Ray: pip install 'qbuild[ray]'") from None
    return ray


def remote_spec(remote) -> dict:
    """How a node reopens a remote (RemoteStore objects hold locks and clients: they do not travel)."""
    return {"url": remote.url, "name": remote.name, "endpoint_url": remote.endpoint_url, "region": remote.region,
            "insecure": remote.insecure, "push": "always", "jobs": remote.jobs}


def node_store() -> Store:
    from qbuild.base.fingerprint import cache_dir

    return Store(Path(os.environ.get("QBUILD_NODE_STORE") or cache_dir() / "ray-store"))


def resources(step: Step, max_cpus: float) -> dict:
    """The Ray resources of a step: its threads as CPUs (never more than the largest node has), a GPU for GPU
    steps, and the GPU model (compute capability) as a custom resource when the step's key depends on it."""
    opts: dict = {"num_cpus": min(max(step.threads, 1), max(max_cpus, 1))}
    if step.requires_gpu:
        opts["num_gpus"] = 1
    sm = step.env_toolchain.get("gpu.sm")
    if sm:
        opts["resources"] = {f"sm_{str(sm).replace('.', '')}": 0.001}   # a label: any number of steps share it
    return opts


# --- on a node -----------------------------------------------------------------------------------------------
class _NodeExecutor(Executor):
    """The local executor's build path (lock, scratch, worker process, atomic publish), on a Ray node."""

    def __init__(self, *args, queue=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.queue, self._last = queue, 0.0

    def _on_progress(self, task, line: bytes) -> None:
        if self.queue is None or time.time() - self._last < 0.5:
            return
        self._last = time.time()
        try:
            import json

            p = json.loads(line)
            self.queue.put_nowait((self._step_key, p.get("done"), p.get("total"), str(p.get("desc", ""))))
        except Exception:  # the driver's queue is gone or full: progress is best effort, the build is not
            pass


def build_on_node(step: Step, origin: Origin | None, run_id: str, device: str, remotes: list[dict],
                  inputs: dict[str, dict], queue=None) -> dict:
    """A Ray task: fetch inputs from the remote, build `step` in a worker process, push the object to the remote."""
    import socket

    from qbuild.artifacts.remote import open_remote
    from qbuild.artifacts.remote.cache import lookup

    store = node_store()
    store.clean_stale()   # scratch of a task killed on this node (a forced cancel, a lost worker) goes here
    tiers = tuple(open_remote(r.pop("url"), **r) for r in (dict(x) for x in remotes))
    where = f"{socket.gethostname()}:{os.getpid()}"
    try:
        import ray

        where = ray.get_runtime_context().get_node_id()[:12]
    except Exception:
        pass
    outcomes: dict[str, StepOutcome] = {}
    for role, s in step.inputs.items():
        given = inputs[role]
        if given.get("source"):
            outcomes[s.key] = StepOutcome(s, Outcome.SOURCE, path=Path(given["source"]))
            continue
        hit = store.lookup(s.key)
        if hit:
            outcomes[s.key] = StepOutcome(s, Outcome.CACHED, hit.path, hit.digest, record=hit.record)
            continue
        rh = lookup(tiers, s.key)
        if rh is None:
            return {"status": Outcome.FAILED, "error": f"input {s.name} is in no remote ({tiers[0].display})",
                    "node": where}
        outcomes[s.key] = StepOutcome(s, Outcome.CACHED, None, rh.digest, record=rh.record, remote=rh)
    done = lookup(tiers[:1], step.key)   # a retry after a lost node: the first attempt may have pushed already
    if done is not None:
        return {"status": Outcome.CACHED, "digest": done.digest, "record": done.record, "node": where}
    ex = _NodeExecutor(store, run_id, {step.key: origin} if origin else {}, device=device, jobs=1, remotes=(),
                       queue=queue)
    ex._step_key = step.key
    # Ray placed it (CUDA_VISIBLE_DEVICES is set): the claim only carries its threads
    claim = Claim(cpus=step.threads, memory_mb=0, gpu=None, alone=False, key=step.key, base=step.threads)
    try:
        out = ex._build(step, outcomes, claim)
    except BaseException:   # ray.cancel: KeyboardInterrupt here; stop the worker process, remove its scratch
        ex.cancel()
        raise
    if out.status == Outcome.FAILED and killed_by_signal(out.error):
        raise WorkerKilled(f"{step.name} on node {where}: {out.error}")
    log = store.log_path(run_id, step.name)
    text = log.read_bytes()[-LOG_LIMIT:].decode(errors="replace") if log.is_file() else ""
    result = {"status": out.status, "digest": out.digest, "record": out.record, "seconds": out.seconds,
              "started": out.started, "ended": out.ended, "error": out.error, "log": text, "node": where}
    if out.status in (Outcome.BUILT, Outcome.CACHED):
        push_hit(tiers[0], store, step.key, out.digest, out.record)   # before returning: other nodes read it there
    return result


# --- on the driver -------------------------------------------------------------------------------------------
class RayExecutor(Executor):
    def __init__(self, store: Store, run_id: str, origins: dict[str, Origin], *, address: str | None = None,
                 **kwargs):
        super().__init__(store, run_id, origins, **kwargs)
        if not self.remotes:
            raise UserError(need_remote_message())
        self.address = address or os.environ.get("RAY_ADDRESS") or "auto"
        self._owns_ray = False

    def _connect(self):
        ray = _ray()
        if ray.is_initialized():   # inside a Ray job or a notebook that connected already: use that session
            return ray
        self._probe_address()
        env = {k: os.environ[k] for k in ("PYTHONPATH",) if os.environ.get(k)}   # where qbuild and plugins live
        try:
            ray.init(address=self.address, runtime_env={"env_vars": env} if env else None, log_to_driver=False,
                     logging_level="ERROR", configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise self._unreachable(first_line(exc)) from None
        self._owns_ray = True
        return ray

    def _unreachable(self, why: str) -> UserError:
        return UserError(f"no Ray cluster at {self.address}: {why} "
                         "(start one with `ray start --head`, or pass --address HOST:PORT)")

    def _probe_address(self) -> None:
        """A named HOST:PORT that accepts no connection fails here in seconds: ray.init would retry it for minutes."""
        import socket
        from urllib.parse import urlsplit

        if self.address in ("auto", "local"):   # Ray finds (or reports the lack of) a local cluster quickly itself
            return
        try:   # HOST:PORT or ray://HOST:PORT; an IPv6 host in brackets
            parts = urlsplit("//" + self.address.removeprefix("ray://"))
            host, port = parts.hostname or "127.0.0.1", parts.port
        except ValueError:
            port = None
        if port is None:
            raise self._unreachable("expected HOST:PORT")
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        except OSError as exc:
            raise self._unreachable(first_line(exc)) from None

    def run(self, planned: list[PlannedStep]) -> list[StepOutcome]:
        # Ray's driver prints cluster events (a node lost, a worker killed) on stdout: keep stdout for --json
        with contextlib.redirect_stdout(sys.stderr):
            try:
                return self._run(planned)
            finally:
                if self._owns_ray:   # connected here: disconnect (a caller's own Ray session stays)
                    sys.modules["ray"].shutdown()

    def _run(self, planned: list[PlannedStep]) -> list[StepOutcome]:
        blocked = [ps for ps in planned if ps.status in UNBUILDABLE and ps.step.on_unavailable != "skip"]
        if blocked:
            raise UserError("cannot run: " + "; ".join(f"step {ps.step.name}: {ps.reason}" for ps in blocked))
        ray = self._connect()
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        pinned = NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        queue = Queue(maxsize=1000, actor_options={"num_cpus": 0, "scheduling_strategy": pinned})
        max_cpus = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")), default=1)
        task = ray.remote(build_on_node)
        specs = [remote_spec(r) for r in self.remotes[:1]]
        outcomes: dict[str, StepOutcome] = {}
        pending = list(planned)
        running: dict = {}   # ObjectRef → (planned step, progress task id)
        try:
            while pending or running:
                for ps in list(pending):
                    ins = [outcomes.get(s.key) for s in ps.step.prerequisites()]
                    if any(o is None for o in ins) or _group_full(ps.step, running):
                        continue
                    done = self._resolve_without_building(ps, ins)
                    pending.remove(ps)
                    if done is not None:
                        outcomes[ps.step.key] = done
                        continue
                    self._share_inputs(ps.step, outcomes)
                    opts = resources(ps.step, max_cpus)
                    if ps.step.per_hardware:   # timings: the key holds this machine's hardware, so measure here
                        opts["scheduling_strategy"] = pinned
                    inputs = {role: {"source": str(outcomes[s.key].path)} if outcomes[s.key].status == Outcome.SOURCE
                              else {"key": s.key} for role, s in ps.step.inputs.items()}
                    ref = task.options(max_retries=MAX_RETRIES, retry_exceptions=[WorkerKilled], name=ps.step.name,
                                       **opts).remote(ps.step, self.origins.get(ps.step.key), self.run_id, self.device,
                                                      specs, inputs, queue)
                    bar = self.progress.add_task(escape(ps.step.name), total=None, step=escape(ps.step.name)) \
                        if self.progress else None
                    running[ref] = (ps, bar, time.time())
                if not running:
                    break
                ready, _ = ray.wait(list(running), num_returns=1, timeout=0.25)
                self._drain(queue, running)
                for ref in ready:
                    ps, bar, t0 = running.pop(ref)
                    if self.progress and bar is not None:
                        self.progress.update(bar, visible=False)
                    outcomes[ps.step.key] = self._outcome(ray, ref, ps.step, t0)
        except BaseException:
            _cancel(ray, running)
            raise
        for ps in planned:
            if outcomes[ps.step.key].status in (Outcome.BUILT, Outcome.CACHED):
                self._remember(ps.step)
        return [outcomes[ps.step.key] for ps in planned]

    def _share_inputs(self, step: Step, outcomes: dict[str, StepOutcome]) -> None:
        """Inputs only the driver's store has (a local hit) go to the remote first, so any node can read them."""
        remote = self.remotes[0]
        for s in step.inputs.values():
            o = outcomes[s.key]
            if o.status == Outcome.CACHED and o.path is not None and o.remote is None:
                push_hit(remote, self.store, s.key, o.digest, o.record)
                o.remote = RemoteHit(remote, s.key, o.digest, o.record)

    def _drain(self, queue, running) -> None:
        if not self.progress:
            try:
                queue.get_nowait_batch(queue.qsize())
            except Exception:
                pass
            return
        bars = {ps.step.key: bar for ps, bar, _ in running.values()}
        try:
            items = queue.get_nowait_batch(queue.qsize())
        except Exception:
            return
        for key, done, total, desc in items:
            if key in bars and bars[key] is not None:
                name = self.progress.tasks[bars[key]].fields.get("step", "")
                self.progress.update(bars[key], completed=done, total=total or None,
                                     description=f"{name}{': ' if desc else ''}{escape(desc)}")

    def _outcome(self, ray, ref, step: Step, t0: float) -> StepOutcome:
        log_path = self.store.log_path(self.run_id, step.name)
        try:
            res = ray.get(ref)
        except Exception as exc:   # lost more often than max_retries, cancelled, or an error in qbuild itself
            first = (str(exc).strip().splitlines() or [""])[0]
            return StepOutcome(step, Outcome.FAILED, seconds=time.time() - t0, log=str(log_path),
                               error=f"Ray task failed ({MAX_RETRIES} retries): {type(exc).__name__}: {first}")
        if res.get("log"):
            self.store.owned.write_bytes(log_path, res["log"].encode(), durable=False)   # never through a link
        status = res["status"]
        if status == Outcome.FAILED:
            return StepOutcome(step, Outcome.FAILED, seconds=res.get("seconds") or 0.0, error=res.get("error"),
                               log=str(log_path), started=res.get("started"), ended=res.get("ended"),
                               worker=res.get("node"))
        outcome = StepOutcome(step, status, None, res["digest"], res.get("seconds") or 0.0, res.get("record") or {},
                              started=res.get("started"), ended=res.get("ended"), worker=res.get("node"),
                              remote=RemoteHit(self.remotes[0], step.key, res["digest"], res.get("record") or {}))
        if self.materialize_all:
            self.materialize(outcome)
        return outcome


def _group_full(step: Step, running: dict) -> bool:
    """Step.at_once across the cluster: as many steps of its group are running as it allows (a search's probes)."""
    if step.at_once is None:
        return False
    group, limit = step.at_once
    return sum(1 for ps, _, _ in running.values() if ps.step.at_once and ps.step.at_once[0] == group) >= limit


def _cancel(ray, running: dict) -> None:
    """Ctrl-C / SIGTERM: each task stops its worker process and removes its scratch (KeyboardInterrupt in the task);
    one that has not within CANCEL_GRACE_S is killed (its qbuild.pipeline.worker dies with it, and its scratch goes
    when the node's next task starts)."""
    for ref in running:
        ray.cancel(ref, force=False)
    _, late = ray.wait(list(running), num_returns=len(running), timeout=CANCEL_GRACE_S) if running else ([], [])
    for ref in late:
        ray.cancel(ref, force=True)
