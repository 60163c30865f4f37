"""What a run is once its steps are done: refs, summary, gates, the rebuild check, write-through to remotes,
registration, tracking and the run record (RunResult); and a recipe's `selection:` judged from the store alone."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.base.errors import EXIT_GATE_FAILED, EXIT_STEP_FAILED, QBuildError, UserError

if TYPE_CHECKING:
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.outcome import StepOutcome
    from qbuild.pipeline.plan import Plan
    from qbuild.planning.recipe import Recipe

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
        from qbuild.contract.step import Outcome

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


def finish(st: Store, the_plan: Plan, outcomes: list[StepOutcome], run_id: str, path: Path | None, started: float,
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
    from qbuild.base.errors import first_line
    from qbuild.base.names import redact_tree
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
    from qbuild.base.fingerprint import cpu_model
    from qbuild.contract.step import Outcome
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
    from qbuild.base.names import redact_tree

    summary = redact_tree(summary)   # no password in a URL reaches --json, the run record or a report
    if st.quarantined:
        summary["quarantined"] = list(st.quarantined)
    st.write_run(run_id, redact_tree({**summary, "recipe_path": str(path.resolve()) if path else None,
                                      "resolved_recipe": r.canonical(), "finished": time.time()}))
    return RunResult(run_id, the_plan, tuple(outcomes), summary, tuple(gate_rows))


def set_refs(store: Store, the_plan: Plan, outcomes: list[StepOutcome], tag: str | None) -> list[str]:
    """recipe/<artifact>:latest (+ tags) for every named artifact this run has, built or cached; returns the tags.

    A remote hit gets its local ref too: the name resolves, and `pull` fetches the object when asked."""
    from qbuild.contract.step import Outcome

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
    from qbuild.base.names import redact_url
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


def select(recipe, *, store=None, threads: int | None = None) -> dict:
    """The `selection:` of RECIPE judged from the store, building nothing: {selected: {variant, config, ...} | None,
    rejected: [{variant, config, why}], passed}. Every step the selection reads must be stored (run RECIPE first)."""
    summary, missing = _stored_summary(recipe, store, threads, "selection",
                                       "the recipe has no selection: section (SLOs, bounds and an objective)")
    result = dict(summary["selection"])
    if missing:
        result["not_stored"] = missing
    return result


def deployment(recipe, *, store=None, threads: int | None = None) -> dict:
    """The `deploy:` search's answer from the store, building nothing: {chosen | None, ties, replicas, front,
    candidates, ...}, or {status: missing} when the recipe has not been run."""
    summary, missing = _stored_summary(recipe, store, threads, "deploy",
                                       "the recipe has no deploy: section (the SLOs and the space to search)")
    result = dict(summary.get("deploy") or {})
    if missing:
        result["not_stored"] = missing
    return result


def _stored_summary(recipe, store, threads, section: str, absent: str) -> tuple[dict, list[str]]:
    """The summary of RECIPE from what the store holds, and the steps it does not hold."""
    from qbuild.artifacts.access import open_store
    from qbuild.contract.step import Outcome, PlanStatus
    from qbuild.pipeline.outcome import StepOutcome
    from qbuild.pipeline.plan import make_plan
    from qbuild.pipeline.run import load
    from qbuild.results.summary import summarize

    r, base, _ = load(recipe, threads)
    if getattr(r, section) is None:
        raise UserError(f"{r.name}: {absent}")
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
    if r.selection is not None and r.selection.on_uncertain == "measure_more" and not missing:
        from qbuild.results.measure_more import from_store  # the passes the run made, from the store

        the_plan, outcomes = from_store(st, the_plan, outcomes)
    return summarize(the_plan, outcomes), missing
