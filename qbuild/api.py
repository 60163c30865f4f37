"""The Python API: everything the CLI does, for notebooks, orchestrators (Airflow, Dagster, Ray) and tests.

    import qbuild
    plan = qbuild.plan("recipes/demo.yaml")                 # keys, hit/miss and why; never imports torch
    result = qbuild.run("recipes/demo.yaml", tag="nightly")
    result.passed, result.exit_code, result.summary["variants"]
    digest, path = qbuild.pull("demo/q4km", out="./q4km")
    html = qbuild.report("demo")

Errors are exceptions from qbuild.errors (each carries the exit code the CLI uses); nothing here
prints except the progress display, which is off unless asked for.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qbuild.errors import EXIT_GATE_FAILED, EXIT_STEP_FAILED, QBuildError, UserError

if TYPE_CHECKING:
    from qbuild.artifacts.store import Store
    from qbuild.core.outcome import StepOutcome
    from qbuild.core.plan import Plan
    from qbuild.core.recipe import Recipe

log = logging.getLogger("qbuild")


@dataclass(frozen=True)
class RunResult:
    run_id: str
    plan: Plan
    outcomes: tuple[StepOutcome, ...]
    summary: dict                 # the JSON `qbuild run --json` prints (also stored as runs/<run_id>.json)
    gates: tuple[dict, ...]       # one row per (gate, variant, bound)

    @property
    def failed(self) -> list[StepOutcome]:
        from qbuild.core.step import Outcome

        return [o for o in self.outcomes if o.status == Outcome.FAILED]

    @property
    def selected(self) -> bool:
        """No `selection:`, or something met every one of its bounds."""
        return (self.summary.get("selection") or {}).get("passed", True)

    @property
    def passed(self) -> bool:
        """No step failed, every quality gate passed and (with `selection:`) some artifact met every bound."""
        return not self.failed and all(g["passed"] for g in self.gates) and self.selected

    @property
    def exit_code(self) -> int:
        if self.failed:
            return EXIT_STEP_FAILED
        return EXIT_GATE_FAILED if not (all(g["passed"] for g in self.gates) and self.selected) else 0


def load(recipe, threads: int | None = None) -> tuple[Recipe, Path, Path | None]:
    """(recipe, directory relative paths resolve against, its file or None) from a path, dict or Recipe."""
    from qbuild.core.recipe import Recipe, load_recipe, parse_recipe

    if isinstance(recipe, Recipe):
        r, base, path = recipe, Path.cwd(), None
    elif isinstance(recipe, dict):
        r, base, path = parse_recipe(recipe), Path.cwd(), None
    else:
        path = Path(recipe)
        r, base = load_recipe(path), path.resolve().parent
    if threads:
        r = r.model_copy(update={"runtime": r.runtime.model_copy(update={"threads": threads})})
    return r, base, path


def open_store(store=None, recipe: Recipe | None = None) -> Store:
    """A Store, a path, or None: --store / QBUILD_STORE / the recipe's store.path / ./artifacts."""
    from qbuild.artifacts.store import Store
    from qbuild.artifacts.store import open_store as _open

    if isinstance(store, Store):
        return store
    return _open(store, recipe.store.path if recipe else None)


def validate(recipe) -> Plan:
    """Schema, files, installed backends and model shapes; builds nothing, reads no store."""
    from qbuild.core.plan import Plan, PlannedStep, build_steps
    from qbuild.core.step import PlanStatus

    r, base, _ = load(recipe)
    ctx = build_steps(r, base)
    return Plan(r, base, tuple(PlannedStep(s, PlanStatus.MISS) for s in ctx.steps), tuple(ctx.artifacts),
                dict(ctx.not_evaluated), tuple(ctx.warnings), overlap=ctx.overlap)


def backend_envs(recipe) -> list:
    """The backend environments (qbuild.core.envs.BackendEnv) RECIPE's steps run in, resolved but not created."""
    from qbuild.core.plan import build_steps

    r, base, _ = load(recipe)
    return list(dict.fromkeys(s.backend_env for s in build_steps(r, base).steps if s.backend_env is not None))


def open_remotes(recipe: Recipe | None = None, urls: list[str] | tuple[str, ...] = ()) -> tuple:
    """The remote tiers: --remote URLs (or QBUILD_REMOTE) beat the recipe's store.remotes."""
    from qbuild.artifacts.remote import open_remote, remotes_from_env

    given = remotes_from_env(urls)
    if given:
        return tuple(open_remote(u) for u in given)
    return tuple(spec.open() for spec in (recipe.store.remotes if recipe else ()))


def plan(recipe, *, store=None, threads: int | None = None, remotes: list[str] | tuple = (),
         verify: str = "fast", estimate: bool = True) -> Plan:
    """Every step of the recipe with its key: hit (stored locally or in a remote) or miss, and why it misses.

    With misses and `estimate`, each miss gets an estimate of its time from the store's history of similar
    steps, and the plan a total (qbuild/core/estimate.py; `plan.estimate`)."""
    from qbuild.core.plan import make_plan

    _check_verify(verify)
    r, base, _ = load(recipe, threads)
    st = open_store(store, r)
    if st is store:
        st = type(store)(store.root)   # the caller's store keeps its own setting
    st.repair = False   # a plan is a dry run: a damaged object is reported as a miss, never moved to quarantine
    the_plan = make_plan(r, base, st, open_remotes(r, remotes), verify)
    if not estimate:
        return the_plan
    from dataclasses import replace

    from qbuild.core.estimate import estimate_plan

    return replace(the_plan, estimate=estimate_plan(the_plan.steps, st, r.name))


def select(recipe, *, store=None, threads: int | None = None) -> dict:
    """The `selection:` of RECIPE judged from the store, building nothing: {selected: {variant, config, ...} | None,
    rejected: [{variant, config, why}], passed}. Every step the selection reads must be stored (run RECIPE first)."""
    from qbuild.core.outcome import StepOutcome
    from qbuild.core.plan import make_plan
    from qbuild.core.step import Outcome, PlanStatus
    from qbuild.results.summary import summarize

    r, base, _ = load(recipe, threads)
    if r.selection is None:
        raise UserError(f"{r.name}: the recipe has no selection: section (SLOs, bounds and an objective)")
    st = open_store(store, r)
    the_plan = make_plan(r, base, st)
    outcomes, missing = [], []
    for ps in the_plan.steps:
        if ps.status == PlanStatus.HIT:
            outcomes.append(StepOutcome(ps.step, Outcome.CACHED, ps.hit.path, ps.hit.digest, record=ps.hit.record))
        elif ps.status == PlanStatus.SOURCE:
            outcomes.append(StepOutcome(ps.step, Outcome.SOURCE, path=ps.step.source_path))
        else:
            outcomes.append(StepOutcome(ps.step, Outcome.SKIPPED, error=f"not stored ({ps.status})"))
            if ps.status == PlanStatus.MISS:
                missing.append(ps.step.name)
    if r.selection.on_uncertain == "measure_more" and not missing:   # the passes the run made, from the store
        from qbuild.core.plan import _status
        from qbuild.results.measure_more import settle

        def stored(steps):
            planned = [_status(s, st, r.name) for s in steps]
            if any(ps.status != PlanStatus.HIT for ps in planned):
                return None
            return planned, [StepOutcome(ps.step, Outcome.CACHED, ps.hit.path, ps.hit.digest, record=ps.hit.record)
                             for ps in planned]

        the_plan, outcomes = settle(the_plan, outcomes, stored, None)
    summary = summarize(the_plan, outcomes)
    result = dict(summary["selection"])
    if missing:
        result["not_stored"] = missing
    return result


def _check_verify(verify: str) -> None:
    from qbuild.artifacts.store import VERIFY_MODES

    if verify not in VERIFY_MODES:
        raise UserError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")


def recipe_files(args) -> list[Path]:
    """Recipe paths from arguments that may be directories (every *.yaml / *.yml in them, sorted)."""
    out: list[Path] = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml") and f.is_file())
            if not found:
                raise UserError(f"{p}: no *.yaml recipes in this directory")
            out += found
        else:
            out.append(p)
    return out


def run(recipe, *, store=None, executor: str = "local", tag: str | None = None, threads: int | None = None,
        mlflow: str | None = None, progress=None, remotes: list[str] | tuple = (), materialize: bool = False,
        jobs: int | None = None, address: str | None = None, verify: str = "fast") -> RunResult:
    """Build what is missing, evaluate, set refs, check gates, push to remotes, register, track.

    Returns the result (never exits). progress: a rich Progress (the CLI passes one) or None.
    remotes: URLs overriding the recipe's store.remotes; materialize: fetch every remote hit's files;
    jobs: steps at most at once (default: the CPU cores; threads per step × steps never exceed them);
    executor: "local" (this machine) or "ray" (a Ray cluster at `address`: auto, HOST:PORT or ray://HOST:PORT;
    it needs a remote store every node shares);
    verify: how each cache hit is checked before use, "fast" (file set, sizes, memoized hashes) or "full"."""
    return run_many([recipe], store=store, executor=executor, tag=tag, threads=threads, mlflow=mlflow,
                    progress=progress, remotes=remotes, materialize=materialize, jobs=jobs, address=address,
                    verify=verify).results[0]


@dataclass(frozen=True)
class MultiRunResult:
    results: tuple[RunResult, ...]

    @property
    def exit_code(self) -> int:
        codes = [r.exit_code for r in self.results]
        return EXIT_STEP_FAILED if EXIT_STEP_FAILED in codes else max(codes, default=0)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)


def run_many(recipes, *, store=None, executor: str = "local", tag: str | None = None, threads: int | None = None,
             mlflow: str | None = None, progress=None, remotes: list[str] | tuple = (), materialize: bool = False,
             jobs: int | None = None, address: str | None = None, verify: str = "fast") -> MultiRunResult:
    """Several recipes as one deduplicated graph: a shared model, calibration set or evaluation is built once.

    Every recipe still gets its own summary, refs, gates, run record and registration."""
    from qbuild.core.executor import Executor
    from qbuild.core.hashing import sha256_text
    from qbuild.core.names import check_name
    from qbuild.core.outcome import Origin
    from qbuild.core.plan import make_plan

    if executor not in ("local", "ray"):
        raise UserError(f"unknown executor {executor!r}; available: local, ray")
    if tag is not None:
        check_name(tag, "tag")
    _check_verify(verify)
    loaded = [load(r, threads) for r in recipes]
    if not loaded:
        raise UserError("no recipe given")
    if store is None and len({r.store.path for r, _, _ in loaded}) > 1:
        raise UserError("these recipes name different store.path values; run them into one store with --store DIR")
    st = open_store(store, loaded[0][0])
    remote_tiers = open_remotes(None, remotes) if remotes else _union_remotes([r for r, _, _ in loaded])
    if executor == "ray" and not remote_tiers:   # before planning: nodes share objects through a remote only
        from qbuild.core.executor_ray import need_remote_message

        raise UserError(need_remote_message())
    plans = [make_plan(r, base, st, remote_tiers, verify) for r, base, _ in loaded]
    origins: dict = {}
    merged: dict = {}
    for (r, _, path), the_plan in zip(loaded, plans, strict=True):
        sha = sha256_text(path.read_text()) if path and path.is_file() else None
        for ps in the_plan.steps:
            merged.setdefault(ps.step.key, ps)
            origins.setdefault(ps.step.key, Origin(r.name, str(path or "<api>"), sha))
    run_id = st.new_run_id()
    started = time.time()
    device = loaded[0][0].runtime.device
    limits = [limit for the_plan in plans for limit in the_plan.time_limits]
    if executor == "ray":
        from qbuild.core.executor_ray import RayExecutor

        runner = RayExecutor(st, run_id, origins, address=address, progress=progress, device=device, jobs=jobs,
                             remotes=remote_tiers, materialize=materialize, time_limits=limits)
    else:
        runner = Executor(st, run_id, origins, progress=progress, device=device, jobs=jobs, remotes=remote_tiers,
                          materialize=materialize, verify=verify, time_limits=limits)
    done = runner.run(list(merged.values()))
    by_key = {o.step.key: o for o in done}
    results = []
    for i, ((r, _, path), the_plan) in enumerate(zip(loaded, plans, strict=True)):
        outcomes = [by_key[ps.step.key] for ps in the_plan.steps]
        if r.selection is not None and r.selection.on_uncertain == "measure_more":
            the_plan, outcomes = _measure_more(runner, st, the_plan, outcomes, remote_tiers, verify)
        rid = run_id if i == 0 else st.new_run_id()
        results.append(_finish(st, the_plan, outcomes, rid, path, started, tag, mlflow))
    return MultiRunResult(tuple(results))


def _measure_more(runner, st: Store, the_plan: Plan, outcomes: list[StepOutcome], remotes: tuple, verify: str):
    """selection.on_uncertain: measure_more: passes of added serving rounds for the candidates in doubt, run by the
    same executor, within the selection's budget (qbuild.results.measure_more)."""
    from qbuild.core.plan import _status
    from qbuild.core.step import Outcome
    from qbuild.results.measure_more import settle

    if any(o.status == Outcome.FAILED for o in outcomes):
        return the_plan, outcomes
    r = the_plan.recipe

    def execute(steps):
        # the executor starts a step once its inputs are resolved in the same call: they go along (stored by now)
        planned = [_status(s, st, r.name, remotes, verify) for s in (*_prerequisites(steps), *steps)]
        keys = {s.key for s in steps}
        return [ps for ps in planned if ps.step.key in keys], [o for o in runner.run(planned) if o.step.key in keys]

    return settle(the_plan, outcomes, execute, r.selection.measure_more_minutes * 60)


def _prerequisites(steps) -> list:
    """Every step the given ones need, transitively, inputs first, each once."""
    seen: dict[str, Any] = {}

    def visit(step) -> None:
        for p in step.prerequisites():
            if p.key not in seen:
                visit(p)
                seen[p.key] = p
    for s in steps:
        visit(s)
    return list(seen.values())


def _union_remotes(recipes: list[Recipe]) -> tuple:
    seen: dict = {}
    for r in recipes:
        for spec in r.store.remotes:
            seen.setdefault(spec.url, spec)
    return tuple(spec.open() for spec in seen.values())


def _finish(st: Store, the_plan: Plan, outcomes: list[StepOutcome], run_id: str, path: Path | None, started: float,
            tag: str | None, mlflow: str | None) -> RunResult:
    """After the build: refs, then summary, gates, write-through, registry, tracking, run record.

    The refs come first and need nothing else; should anything after them fail, the run record is still written
    (its steps, and the error), then the error goes on: what was built is never left unnamed or unrecorded."""
    tags = set_refs(st, the_plan, outcomes, tag)
    try:
        return _conclude(st, the_plan, outcomes, run_id, path, started, tag, mlflow, tags)
    except BaseException as exc:
        try:
            _write_failed_run(st, the_plan, outcomes, run_id, path, started, exc)
        except OSError as write_error:   # the first error is the one to see
            log.warning(f"run record {run_id} not written: {write_error}")
        raise


def _write_failed_run(st: Store, the_plan: Plan, outcomes: list[StepOutcome], run_id: str, path: Path | None,
                      started: float, exc: BaseException) -> None:
    """The run record of a run whose conclusion failed: its steps and the error; never a "last good run"."""
    from qbuild.core.names import redact_tree
    from qbuild.errors import first_line
    from qbuild.results.summary import step_rows

    steps, counts = step_rows(the_plan, outcomes)
    r = the_plan.recipe
    st.write_run(run_id, redact_tree({
        "recipe": r.name, "run_id": run_id, "variants": [], "steps": steps, "counts": counts,
        "error": f"{type(exc).__name__}: {first_line(exc)}", "store": str(st.root),
        "seconds": round(time.time() - started, 3), "gates": {"passed": False, "checks": [], "compared_with": None},
        "recipe_path": str(path.resolve()) if path else None, "resolved_recipe": r.canonical(),
        "finished": time.time()}))


def _conclude(st: Store, the_plan: Plan, outcomes: list[StepOutcome], run_id: str, path: Path | None,
              started: float, tag: str | None, mlflow: str | None, tags: list[str]) -> RunResult:
    from qbuild.core.fingerprint import cpu_model
    from qbuild.core.step import Outcome
    from qbuild.results.summary import summarize

    r = the_plan.recipe
    summary = summarize(the_plan, outcomes)
    summary.update({"run_id": run_id, "store": str(st.root), "seconds": round(time.time() - started, 3),
                    "hardware": {"cpu": cpu_model(), "threads": r.runtime.resolved_threads()}})
    gate_rows: list[dict] = []
    if r.evaluation.gates:
        from qbuild.evaluate.gates import check_gates

        previous = st.last_good_run(r.name, before=run_id)   # what regression bounds compare with
        gate_rows = check_gates(r.evaluation.gates, summary, previous)
        summary["gates"] = {"passed": all(g["passed"] for g in gate_rows), "checks": gate_rows,
                            "compared_with": previous.get("run_id") if previous else None}
    failed = any(o.status == Outcome.FAILED for o in outcomes)
    if r.runtime.rebuild_check and not failed:   # a nightly job's reproducibility check of chosen steps
        from qbuild.results.rebuild import after_run

        summary["rebuild_check"], rebuild_gates = after_run(st, the_plan, r.runtime.rebuild_check)
        gate_rows += rebuild_gates
        summary.setdefault("gates", {"checks": [], "compared_with": None})
        summary["gates"]["checks"] = gate_rows
        summary["gates"]["passed"] = all(g["passed"] for g in gate_rows)
    if the_plan.remotes and not failed:
        from qbuild.results.publish import write_through

        summary["remotes"] = write_through(st, the_plan, outcomes, summary, tags)
    mlflow_cfg = r.tracking.mlflow
    if r.model_registry and not failed:
        from qbuild.results.publish import register

        summary["registered"] = register(the_plan, outcomes, summary, st, mlflow or (mlflow_cfg.uri if mlflow_cfg else None))
    if mlflow or mlflow_cfg:
        summary["mlflow"] = track(mlflow or mlflow_cfg.uri, mlflow_cfg.experiment if mlflow_cfg else None,
                                  r, summary, st)
    from qbuild.core.names import redact_tree

    summary = redact_tree(summary)   # no password in a URL reaches --json, the run record or a report
    if st.quarantined:
        summary["quarantined"] = list(st.quarantined)
    st.write_run(run_id, redact_tree({**summary, "recipe_path": str(path.resolve()) if path else None,
                                      "resolved_recipe": r.canonical(), "finished": time.time()}))
    return RunResult(run_id, the_plan, tuple(outcomes), summary, tuple(gate_rows))


def set_refs(store: Store, the_plan: Plan, outcomes: list[StepOutcome], tag: str | None) -> list[str]:
    """recipe/<artifact>:latest (+ tags) for every named artifact this run has, built or cached; returns the tags.

    A remote hit gets its local ref too: the name resolves, and `pull` fetches the object when asked."""
    from qbuild.core.step import Outcome

    recipe = the_plan.recipe
    by_key = {o.step.key: o for o in outcomes}
    # artifacts (incl. identical variants sharing a step), the imported base model, and target outputs
    named = {**{o.step.variant: o.step for o in outcomes if o.step.variant}, **the_plan.artifact_steps()}
    tags = ["latest"] + ([tag] if tag else []) + ([recipe.store.tag] if recipe.store.tag else [])
    for label, step in named.items():
        o = by_key.get(step.key)
        if o and o.digest and o.status in (Outcome.BUILT, Outcome.CACHED):
            for t in tags:
                if not store.writable:  # a read-only store serves hits; its refs stay as they are
                    if (store.get_ref(recipe.name, label, t) or {}).get("digest") != o.digest:
                        log.warning(f"store {store.root} is read-only: ref {recipe.name}/{label}:{t} not updated")
                    continue
                store.set_ref(recipe.name, label, t, o.digest, step.key)
    return tags


TRACKING_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}
_tracking_failed: set[str] = set()   # tracking URIs that failed in this process: warned once, not retried


def track(uri: str, experiment: str | None, recipe: Recipe, summary: dict, store: Store) -> dict:
    """Log to MLflow; a tracking failure is one warning (once per server), never fatal to the stored artifacts.

    The client's HTTP timeout and retries are bounded (TRACKING_ENV, unless the environment sets its own), so an
    unreachable server costs seconds, not minutes; the run's result never depends on it."""
    from qbuild.artifacts.mlflow_registry import mlflow_http_limits
    from qbuild.core.names import redact_url
    from qbuild.results.report import render_html
    from qbuild.results.tracking import log_run

    shown = redact_url(uri)
    if uri in _tracking_failed:
        return {"uri": shown, "error": "unreachable (see the warning above)"}
    try:
        # mlflow prints run links; stdout is for --json
        with mlflow_http_limits(TRACKING_ENV), contextlib.redirect_stdout(sys.stderr):
            run_id = log_run(uri, experiment, recipe, summary, store, render_html(summary))
        return {"uri": shown, "run_id": run_id}
    except QBuildError:
        raise
    except Exception as exc:  # server down, bad URI: the build itself succeeded
        _tracking_failed.add(uri)
        reason = redact_url(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
        log.warning(f"MLflow tracking to {shown} failed (the run's result is unchanged): {reason}")
        return {"uri": shown, "error": reason}


def pull(name: str, *, store=None, out: str | Path | None = None, need: dict | None = None, remote=None,
         machine: dict | None = None,
         verify_with: str | Path | None = None, tracking_uri: str | None = None, progress=None,
         force: bool = False) -> tuple[str, Path]:
    """Fetch NAME, every file verified against its manifest; returns (digest, path).

    NAME is a ref (recipe/variant[:tag]), a digest, or models:/NAME@ALIAS (MLflow registry: it names the
    digest and the store that holds it). From the local store by default; from a remote with `remote=`
    (URL or RemoteStore), or when the local store lacks the object and QBUILD_REMOTE names remotes.
    An engine ref picks the build that fits this GPU (SM + TensorRT toolchain; `need` overrides the probe).
    `verify_with`: a public key; unsigned or tampered artifacts are refused (remote/registry pulls).
    `out` must be new or empty; `force=True` writes into a non-empty folder, replacing files of the artifact's names
    (a link there is replaced, never written through) and touching nothing else."""
    if name.startswith("models:/"):
        import os

        from qbuild.artifacts.mlflow_registry import resolve_models_uri

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise UserError(f"{name}: set MLFLOW_TRACKING_URI (or pass --mlflow) to resolve registry names")
        name, store_url = resolve_models_uri(name, uri)
        if store_url.startswith("qbuild-file://"):
            store = store or store_url.removeprefix("qbuild-file://")
        elif remote is None:
            remote = _remote_named_by_registry(store_url)
    if remote is not None:
        return _pull_remote(name, remote, out, need, verify_with, progress, machine)
    if verify_with is not None:
        raise UserError("--verify-with checks the signature pushed with an artifact: pull it from its remote "
                        "(--from REMOTE) or by registry name (models:/NAME@ALIAS)")
    return _pull_local(name, open_store(store), out, need, progress, force, machine)


def _remote_named_by_registry(url: str):
    """The remote a registry version's tag names. It may use qbuild's credential variables only when the user
    configured that host themselves (QBUILD_REMOTE): a tag must not send QBUILD_REGISTRY_PASSWORD to any host."""
    from urllib.parse import urlsplit

    from qbuild.artifacts.remote import open_remote, remotes_from_env

    def netloc(u: str) -> str:   # host and port: another port on the same host is another registry
        return urlsplit(u).netloc.rsplit("@", 1)[-1].lower()

    configured = {netloc(u) for u in remotes_from_env()}
    return open_remote(url, env_credentials=bool(netloc(url)) and netloc(url) in configured)


def machine_bound_targets() -> list:
    """Targets whose builds load only on the machine they were built for (TensorRT-LLM engines)."""
    from qbuild.plugins import targets

    return [t for t in targets.all() if t.machine_bound_kind]


def pull_options() -> list[dict]:
    """The `qbuild pull` flags targets declare to pick a machine-bound build for another machine."""
    seen: dict[str, dict] = {}
    for t in machine_bound_targets():
        for o in t.pull_options:
            seen.setdefault(o.flag, {"flag": o.flag, "key": o.key, "help": o.help})
    return list(seen.values())


def _builds_of(manifests, target, recipe: str, variant: str) -> list[dict]:
    """The manifests among `manifests` that are builds of recipe/variant by `target`, newest first."""
    found = [m for m in manifests if isinstance(m, dict) and m.get("kind") == target.machine_bound_kind
             and m.get("variant") == variant and (m.get("recipe") or {}).get("name") == recipe]
    return sorted(found, key=lambda m: m.get("created", ""), reverse=True)


def _manifests(src):
    """Every readable manifest of a store or remote (the shared reading interface, qbuild.artifacts.StoreReader);
    a remote object whose manifest is refused is no candidate, and fails alone."""
    from qbuild.artifacts.remote.base import RemoteRefused

    for digest in src.list_objects():
        try:
            yield src.get_manifest(digest)
        except RemoteRefused as exc:   # `verify --remote` names it; here it is only no candidate
            log.debug(f"{exc}; skipped")


def _machine_bound_family(name: str, manifest: dict | None, all_manifests):
    """(target, builds newest first) when NAME names a machine-bound build, or a family of them that no ref names
    (builds are found by recipe/variant); (None, []) otherwise."""
    from qbuild.artifacts.store import REF_RE

    bound = machine_bound_targets()
    target = next((t for t in bound if manifest is not None and t.machine_bound_kind == manifest.get("kind")), None)
    if manifest is not None and target is None:
        return None, []
    m = REF_RE.match(name)
    family: list[dict] = []
    if m:
        manifests = list(all_manifests())
        for t in [target] if target else bound:
            family = _builds_of(manifests, t, m.group("recipe"), m.group("variant"))
            if family:
                target = t
                break
    if target is not None and manifest is not None and manifest not in family:
        family = [manifest, *family]
    return (target, family) if family else (None, [])


def _choose_build(target, family: list[dict], need: dict | None, machine: dict | None, where: str) -> str:
    need = need or target.machine_needs(dict(machine or {}))
    return target.select_build(family, need, where)["digest"]


def _pull_remote(name, remote, out, need, verify_with, progress, machine=None) -> tuple[str, Path]:
    from qbuild.artifacts.remote import RemoteError, open_remote
    from qbuild.artifacts.remote.cache import pull as pull_from
    from qbuild.artifacts.remote.cache import resolve

    r = open_remote(remote) if isinstance(remote, str) else remote
    if out is None:
        raise UserError(f"pulling from {r.display} needs a destination: --out DIR")
    where = f"{name} on {r.display}"
    try:
        digest = resolve(r, name)
        target, family = _machine_bound_family(name, r.get_manifest(digest) or {}, lambda: _manifests(r))
    except RemoteError as exc:
        if not exc.reason.startswith(("no ref", "no object")):
            raise
        target, family = _machine_bound_family(name, None, lambda: _manifests(r))
        if target is None:
            raise
        try:   # this machine's facts cannot be read: the name's own error says more
            need = need or target.machine_needs(dict(machine or {}))
        except UserError:
            raise exc from None
    if target is not None:
        digest = _choose_build(target, family, need, machine, where)
    manifest = pull_from(r, digest, Path(out), progress=progress, verify_with=verify_with, requested=name)
    return manifest["digest"], Path(out)


def _pull_local(name: str, st: Store, out, need, progress, force: bool = False, machine=None) -> tuple[str, Path]:
    try:
        digest = st.resolve(name)
    except UserError:
        target, family = _machine_bound_family(name, None, lambda: _manifests(st))
        if target is None:
            raise
        digest = family[0]["digest"]
    if not (st.object_dir(digest) / "manifest.json").is_file():
        _fetch_missing(st, digest, progress)  # a ref set by a run that hit a remote: read through now
    target, family = _machine_bound_family(name, st.manifest(digest), lambda: _manifests(st))
    if target is not None:
        digest = _choose_build(target, family, need, machine, name)
    rows = st.verify([digest])
    if not rows[0]["ok"]:
        raise QBuildError(f"{name}: object {digest[:12]} is damaged: " + "; ".join(rows[0]["problems"])
                          + " (run `qbuild verify --repair`, then rebuild)")
    src = st.object_dir(digest)
    if out is None:
        return digest, src
    dest = Path(out)
    if dest.is_symlink():
        raise UserError(f"--out {dest} is a symlink; give the folder itself (a pull never writes through a link)")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise UserError(f"--out {dest} exists and is not empty; give a new or empty folder (or --force to write "
                        "the artifact's files into it)")
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()):
        write_fresh(f, dest, f.relative_to(src))
    return digest, dest


def write_fresh(src: Path, dest_root: Path, rel: Path) -> Path:
    """Copy src to dest_root/rel without following any link already there (OwnedRoot.copy_in in dest_root: a fresh
    file, then an atomic replace). A symlink at the target, or a symlinked directory on the way, is replaced (the
    link itself removed), never written through."""
    from qbuild.core.owned import output_root

    root = output_root(dest_root)
    parent = Path(dest_root)
    for part in rel.parts[:-1]:
        parent = parent / part
        if parent.is_symlink():
            root.remove(parent)
    return root.copy_in(src, Path(dest_root) / rel)


def _fetch_missing(st: Store, digest: str, progress) -> None:
    from qbuild.artifacts.remote.base import RemoteRefused
    from qbuild.artifacts.remote.cache import materialize

    refused = None
    for r in open_remotes():
        try:
            if r.get_manifest(digest) is not None:
                materialize(st, r, digest, progress=progress)
                return
        except RemoteRefused as exc:   # this remote's copy is not the object: the next remote may have it
            refused = exc
    if refused is not None:
        raise refused
    raise UserError(f"object {digest[:12]} is not in store {st.root}, and no remote (QBUILD_REMOTE / --from) has it")


def verified_as(name: str, digest: str, path: str | Path) -> str:
    """What a `pull NAME --verify-with KEY` into `path` verified: the name the signature binds and the object
    ("demo/q4km (object <digest>)"); a registry name (models:/...) is bound by the digest it resolved to."""
    import json

    from qbuild.artifacts.signing import SIDECAR_DIR, STATEMENT, check_binding

    statement = json.loads((Path(path) / SIDECAR_DIR / STATEMENT).read_text())
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    bound = digest if name.startswith("models:/") else name
    what = check_binding(statement, manifest, bound)
    return what if bound == name else f"{name} = {what}"


def push(name: str, to: str, *, store=None, progress=None) -> dict:
    """Upload NAME (ref or digest) from the local store to a remote: files, sidecars, manifest, action record, ref."""
    from qbuild.artifacts.remote import open_remote
    from qbuild.artifacts.remote.cache import build_sidecars, push_hit
    from qbuild.artifacts.signing import signing_key
    from qbuild.artifacts.store import REF_RE
    from qbuild.results.publish import refresh_signature

    st = open_store(store)
    digest = st.resolve(name)
    manifest = st.manifest(digest)
    problems = st.check_object(digest, full=True)
    if problems or not isinstance(manifest.get("key"), str):
        raise QBuildError(f"{name}: object {digest[:12]} is damaged: {'; '.join(problems) or 'manifest has no key'} "
                          "(run `qbuild verify --repair`, then rebuild); nothing pushed")
    remote = open_remote(to)
    m = REF_RE.match(name)
    refs = [(m.group("recipe"), m.group("variant"), m.group("tag") or "latest")] if m else []
    names = [f"{recipe}/{variant}" for recipe, variant, _ in refs]   # what the signature binds (signing.verify)

    def sidecars(previous=None):
        return build_sidecars(st, digest, names=names, previous=previous)

    uploaded = push_hit(remote, st, manifest["key"], digest, None, sidecars=sidecars, refs=(), progress=progress)
    if not uploaded and signing_key() is not None:   # already there: its signature must name this ref too
        refresh_signature(remote, digest, sidecars, names)
    for recipe, variant, tag in refs:
        remote.set_ref(recipe, variant, tag, digest, manifest["key"])
    return {"digest": digest, "remote": remote.display, "uploaded": uploaded, "refs": [f"{a}/{b}:{c}" for a, b, c in refs]}


def report(name: str | None = None, *, store=None, markdown: bool = False) -> str:
    """The report of a run (run id, recipe name or file, or None for the latest) as HTML or Markdown."""
    from qbuild.results.report import find_run, render_html, render_markdown

    st = open_store(store)
    record = find_run(st, name)
    if markdown:
        return render_markdown(record)
    return render_html(record, history=history(st, record))


def history(st: Store, record: dict) -> list[dict]:
    """The report's history view: the run records of the recipe of `record`, oldest first, up to that run."""
    runs = st.runs(record.get("recipe"))
    ids = [r.get("run_id") for r in runs]
    return runs[:ids.index(record["run_id"]) + 1] if record.get("run_id") in ids else runs


def diff(run_a: str | None = None, run_b: str | None = None, *, last: str | None = None, store=None) -> dict:
    """What changed between two recorded runs (ids), or the last two runs of recipe `last` (a name or file):
    per variant Δ PPL / KLD / decode tok/s and size, and each step run B rebuilt with why."""
    from qbuild.results.diff import diff_runs, find_record, last_two

    st = open_store(store)
    if last is not None:
        if Path(last).is_file():
            from qbuild.core.recipe import load_recipe

            last = load_recipe(last).name
        a, b = last_two(st, last)
    elif run_a and run_b:
        a, b = find_record(st, run_a), find_record(st, run_b)
    else:
        raise UserError("diff needs two run ids (RUN_A RUN_B) or --last RECIPE")
    return diff_runs(st, a, b)


def find_run(name: str | None = None, *, store=None) -> dict[str, Any]:
    from qbuild.results.report import find_run as _find

    return _find(open_store(store), name)


# --- reading and keeping the store (what `ls`, `show`, `verify`, `tag`, `gc` print) -------------------------------
def _reader(store=None, remote: str | None = None):
    """The local store, or the remote at URL `remote`: both answer the same reading calls below."""
    if remote:
        from qbuild.artifacts.remote import open_remote

        return open_remote(remote)
    return open_store(store)


def refs(*, store=None, remote: str | None = None) -> tuple[str, list[dict]]:
    """(where, rows): every ref of the local store (or of `remote`) with its digest, kind, format, size and dates; a
    ref whose object or manifest is missing or unreadable says so in `problem`."""
    from qbuild.artifacts.store import valid_files

    src = _reader(store, remote)
    rows = []
    for ref in src.list_refs():
        try:
            m = src.get_manifest(ref["digest"]) or {}
        except (OSError, ValueError, QBuildError):
            m = {}
        if not isinstance(m, dict):
            m = {}
        files = m.get("files") if valid_files(m.get("files")) else []
        rows.append({**ref, "kind": _text(m.get("kind")), "format": _text(m.get("format")),
                     "size_bytes": sum(f["size"] for f in files), "created": _text(m.get("created")),
                     **({} if m else {"problem": "object or manifest missing"})})
    return f"{'remote' if remote else 'store'} {src.display}", rows


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def show(name: str, *, store=None) -> tuple[str, dict]:
    """(digest, manifest) of a ref, digest or step key: the manifest with its path, its last rebuild check, the engines
    that load it and, when its files no longer match, `damaged`."""
    from qbuild.core.names import redact_tree
    from qbuild.formats import manifest_loads_in
    from qbuild.results.rebuild import last_check

    st = open_store(store)
    digest = st.resolve(name)
    manifest = st.manifest(digest)
    manifest["path"] = str(st.object_dir(digest))
    manifest["rebuild_check"] = last_check(st, digest) or "never (qbuild verify --rebuild)"
    if "loads_in" not in manifest:   # built before manifests recorded it: the same table answers now
        engines = manifest_loads_in(str(manifest.get("format") or ""), manifest.get("scheme"), manifest.get("info"))
        if engines is not None:
            manifest["loads_in"] = engines
    search = (manifest.get("info") or {}).get("search") or {}
    if search.get("command"):   # a searched mix: the llama-quantize line that rebuilds it without qbuild
        manifest["rebuild_command"] = search["command"]
    problems = st.check_object(digest)
    if problems:
        manifest["damaged"] = problems
    return digest, redact_tree(manifest)


def verify(names=(), *, store=None, remote: str | None = None, deep: bool = False, repair: bool = False) -> list[dict]:
    """Re-hash stored objects (all, or the named refs/digests) against their manifests: one row per object, `ok`
    and its `problems`. `repair` quarantines the damaged ones (local store); `deep` streams a remote's files."""
    if remote:
        from qbuild.artifacts.remote.cache import resolve

        r = _reader(remote=remote)
        return r.verify([resolve(r, n) for n in names] if names else None, deep=deep)
    st = open_store(store)
    if repair:
        st.require_writable("verify --repair")
    return st.verify([st.resolve(n) for n in names] if names else None, repair=repair)


def rebuild_check(names, *, store=None, progress=None, log=None) -> dict:
    """Re-execute the stored steps of a recipe (or of the named refs/digests) in scratch and compare each with the
    stored object. Returns {"steps": [...], "identical": bool, ...}; records each result beside its object."""
    from qbuild.results.rebuild import check_steps, summarize_checks

    names = tuple(names)
    if not names:
        raise UserError("verify --rebuild needs a RECIPE file or refs/digests to re-execute")
    recipe_file = len(names) == 1 and Path(names[0]).suffix in (".yaml", ".yml") and Path(names[0]).is_file()
    st = open_store(store, load(names[0])[0] if recipe_file else None)   # a recipe names its own store
    st.require_writable("verify --rebuild (it records the result beside each object)")
    rows = []
    for the_plan, checked in _plans_to_recheck(names, st):
        rows += check_steps(st, the_plan, checked, progress=progress, log=log)
    return summarize_checks(rows, st)


def _plans_to_recheck(names: tuple[str, ...], st: Store):
    """(plan, [planned steps to check]) for a recipe file, or for refs/digests (through the recipe each manifest
    names: the step's runtime paths come from planning it again)."""
    if len(names) == 1 and Path(names[0]).suffix in (".yaml", ".yml") and Path(names[0]).is_file():
        the_plan = plan(names[0], store=st)
        return [(the_plan, list(the_plan.steps))]
    wanted: dict[str, list[str]] = {}   # recipe path → keys
    for name in names:
        digest = st.resolve(name)
        manifest = st.manifest(digest)
        path = (manifest.get("recipe") or {}).get("path")
        if not path or not Path(path).is_file():
            raise UserError(f"{name}: the recipe it was built from ({path or 'not recorded'}) is not here; "
                            "give the recipe file instead")
        wanted.setdefault(path, []).append(manifest["key"])
    out = []
    for path, keys in wanted.items():
        the_plan = plan(path, store=st)
        found = {p.step.key: p for p in the_plan.steps}
        missing = [k[:12] for k in keys if k not in found]
        if missing:
            raise UserError(f"{path} no longer plans step(s) {', '.join(missing)} (the recipe or the tools changed); "
                            "nothing to re-execute them from")
        out.append((the_plan, [found[k] for k in keys]))
    return out


def tag(source: str, target: str, *, store=None, remote: str | None = None) -> str:
    """Point the ref TARGET (recipe/variant:tag) at SOURCE (a ref or a digest) in the local store or `remote`;
    returns the digest."""
    from qbuild.artifacts.store import REF_RE

    m = REF_RE.match(target)
    if not m or not m.group("tag") or any(v in (".", "..") for v in m.groups()):
        raise UserError(f"{target!r}: expected recipe/variant:tag (letters, digits, '.', '_', '-')")
    if remote:
        from qbuild.artifacts.remote.cache import resolve

        r = _reader(remote=remote)
        digest = resolve(r, source)
        r.set_ref(m.group("recipe"), m.group("variant"), m.group("tag"), digest, (r.get_manifest(digest) or {}).get("key"))
        return digest
    st = open_store(store)
    digest = st.resolve(source)
    st.set_ref(m.group("recipe"), m.group("variant"), m.group("tag"), digest, st.manifest(digest).get("key"))
    return digest


def gc(*, store=None, remote: str | None = None, keep_last: int | None = None, older_than: str | None = None,
       dry_run: bool = False, mlflow_uri: str | None = None) -> dict:
    """Collect garbage. Local store: stale scratch, unheld locks, and logs, run records and quarantined objects older
    than `older_than` (default 30d; the `keep_last` newest runs, default 20, stay). A remote: objects no ref, tag or
    registry alias reaches. Returns {"removed": [...], "bytes_freed", "dry_run", "scope": "local" | "remote"}."""
    import os

    from qbuild.artifacts.remote.gc import gc_remote, parse_age

    if not remote:
        rows = open_store(store).gc_housekeeping(parse_age(older_than or "30d"),
                                                 keep_runs=20 if keep_last is None else keep_last, dry_run=dry_run)
        return {"removed": rows, "bytes_freed": sum(r["bytes"] for r in rows), "dry_run": dry_run, "scope": "local"}
    roots: set[str] = set()
    uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        from qbuild.artifacts.mlflow_registry import alias_digests

        roots = alias_digests(uri)
    rows = gc_remote(_reader(remote=remote), roots, keep_last, older_than, dry_run)
    return {"removed": rows, "bytes_freed": sum(r.get("bytes", 0) for r in rows), "dry_run": dry_run,
            "scope": "remote"}


def register_model(name: str, model_name: str, *, alias: str | None = None, mlflow_uri: str | None = None,
                   remote: str | None = None, store=None) -> str:
    """Register the artifact NAME as a new version of an MLflow registered model; returns the version."""
    import os

    from qbuild.artifacts import mlflow_registry

    uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserError("register needs --mlflow URI or MLFLOW_TRACKING_URI")
    st = open_store(store)
    digest = st.resolve(name)
    manifest = {**st.manifest(digest), "digest": digest}
    store_url = _reader(remote=remote).url if remote else f"qbuild-file://{st.root}"
    return mlflow_registry.register(uri, model_name, manifest, store_url, manifest.get("metrics"),
                                    gates_passed=True if alias else None, alias=alias)


def keygen(path) -> tuple[Path, Path]:
    """Write an EC P-256 signing key to PATH and its public key to PATH.pub."""
    from qbuild.artifacts.signing import keygen as make_key

    return make_key(path)


# --- what is installed ----------------------------------------------------------------------------------------------
def plugins() -> dict:
    """Every registered plugin (methods, targets, runtimes, servers, remote stores) and every model format: who
    evaluates it and which engines load it."""
    from qbuild.artifacts.remote import remotes
    from qbuild.formats import FORMATS, engines_for_format
    from qbuild.plugins import Runtime, Server, Target, methods, runtimes, runtimes_for, servers, targets

    rows = []
    for kind, registry in (("method", methods), ("target", targets), ("runtime", runtimes), ("server", servers)):
        for p in registry.all():
            row = {"kind": kind, "name": p.name, "origin": p.origin, "extra": p.extra, "installed": not p.missing()}
            if isinstance(p, Runtime):
                row["formats"] = [f for f in FORMATS if p in runtimes_for(f)]
            if isinstance(p, Server):
                row["engine"] = p.engine
            if isinstance(p, Target):
                row["accepts"] = {f: list(s) if s else "any" for f, s in p.accepts.items()}
            rows.append(row)
    for cls in remotes.classes():   # remote stores are opened per URL: listed by class
        rows.append({"kind": "remote store", "name": cls.name, "origin": cls.origin, "extra": cls.extra,
                     "installed": not cls.missing(), "schemes": list(cls.schemes)})
    formats = [{"format": f.name, "description": f.description, "loads_in": list(engines_for_format(f.name)),
                "evaluated_by": [r.name for r in runtimes_for(f.name)]} for f in FORMATS.values() if f.model]
    return {"plugins": rows, "formats": formats}


def recipe_schema() -> dict:
    """The recipe's JSON Schema, with the methods and targets of installed plugins."""
    from qbuild.core.recipe import Recipe

    return Recipe.model_json_schema()


# --- backend environments -------------------------------------------------------------------------------------------
def environments() -> dict:
    """Built-in backends and the environments created on this machine."""
    from qbuild.core import envs

    return {"root": str(envs.envs_root()), "builtin": {k: list(v) for k, v in envs.BACKENDS.items()},
            "environments": envs.installed()}


def create_environments(names=(), *, recipe=None, log=None) -> list[dict]:
    """Resolve and create the environments NAMES (built-in backends) and those RECIPE's steps run in."""
    from qbuild.core import envs

    if not names and not recipe:
        raise UserError(f"name an environment ({', '.join(envs.BACKENDS)}) or give --recipe")
    wanted = [envs.backend(n) for n in names] + (backend_envs(recipe) if recipe else [])
    done = []
    for e in dict.fromkeys(wanted):
        t0 = time.perf_counter()
        existed = e.exists()
        python = envs.ensure(e, log=log or (lambda m: None))
        done.append({"name": e.name, "lock_hash": e.lock_hash, "python": python, "created": not existed,
                     "seconds": round(time.perf_counter() - t0, 2)})
    return done


def remove_environments(name: str | None) -> list:
    """Remove the environment NAME (every version of it), or every environment with None."""
    from qbuild.core import envs

    return envs.remove(name)
