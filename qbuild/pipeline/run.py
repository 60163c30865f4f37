"""A recipe from what a caller gives (a file, a dict, a Recipe), planned against a store; several recipes built as
one deduplicated graph by the chosen executor (local or Ray). What happens after the steps: qbuild.results.conclude."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.artifacts.access import check_verify, open_remotes, open_store, union_remotes
from qbuild.base.errors import UserError

if TYPE_CHECKING:
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.outcome import StepOutcome
    from qbuild.pipeline.plan import Plan
    from qbuild.planning.recipe import Recipe


def load(recipe, threads: int | None = None) -> tuple[Recipe, Path, Path | None]:
    """(recipe, directory relative paths resolve against, its file or None) from a path, dict or Recipe."""
    from qbuild.planning.recipe import Recipe, load_recipe, parse_recipe

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


def plan(recipe, *, store=None, threads: int | None = None, remotes: list[str] | tuple = (),
         verify: str = "fast", estimate: bool = True) -> Plan:
    """qbuild.api.plan: every step with its key, hit or miss and why, and (with `estimate`) the time of the misses."""
    from qbuild.pipeline.plan import make_plan

    check_verify(verify)
    r, base, _ = load(recipe, threads)
    st = open_store(store, r)
    if st is store:
        st = type(store)(store.root)   # the caller's store keeps its own setting
    st.repair = False   # a plan is a dry run: a damaged object is reported as a miss, never moved to quarantine
    the_plan = make_plan(r, base, st, open_remotes(r, remotes), verify)
    if not estimate:
        return the_plan
    from dataclasses import replace

    from qbuild.pipeline.estimate import estimate_plan

    return replace(the_plan, estimate=estimate_plan(the_plan.steps, st, r.name))


def validate(recipe) -> Plan:
    """Schema, files, installed backends and model shapes; builds nothing, reads no store."""
    from qbuild.contract.step import PlanStatus
    from qbuild.pipeline.plan import Plan, PlannedStep, build_steps

    r, base, _ = load(recipe)
    ctx = build_steps(r, base)
    return Plan(r, base, tuple(PlannedStep(s, PlanStatus.MISS) for s in ctx.steps), tuple(ctx.artifacts),
                dict(ctx.not_evaluated), tuple(ctx.warnings), overlap=ctx.overlap)


def backend_envs(recipe) -> list:
    """The backend environments (qbuild.contract.envs.BackendEnv) RECIPE's steps run in, resolved but not created."""
    from qbuild.pipeline.plan import build_steps

    r, base, _ = load(recipe)
    return list(dict.fromkeys(s.backend_env for s in build_steps(r, base).steps if s.backend_env is not None))


@dataclass(frozen=True)
class Built:
    """The steps of several recipes, run once as one graph: each recipe's plan and its steps' outcomes."""

    store: Store
    run_id: str                                                     # the first recipe's; each other gets its own
    started: float
    runs: tuple[tuple[Plan, list[StepOutcome], Path | None], ...]   # (plan, its steps' outcomes, recipe file)
    runner: object = None                                           # the executor, for steps added after the run
    remotes: tuple = ()                                             # the remote tiers looked up
    verify: str = "fast"


def build(recipes, *, store=None, executor: str = "local", tag: str | None = None, threads: int | None = None,
          progress=None, remotes: list[str] | tuple = (), materialize: bool = False, jobs: int | None = None,
          address: str | None = None, verify: str = "fast") -> Built:
    """Plan every recipe, merge the plans by step key (a shared step runs once) and run them with the executor."""
    from qbuild.base.names import check_name
    from qbuild.pipeline.plan import make_plan

    if executor not in ("local", "ray"):
        raise UserError(f"unknown executor {executor!r}; available: local, ray")
    if tag is not None:
        check_name(tag, "tag")
    check_verify(verify)
    loaded = [load(r, threads) for r in recipes]
    if not loaded:
        raise UserError("no recipe given")
    if store is None and len({r.store.path for r, _, _ in loaded}) > 1:
        raise UserError("these recipes name different store.path values; run them into one store with --store DIR")
    st = open_store(store, loaded[0][0])
    remote_tiers = open_remotes(None, remotes) if remotes else union_remotes([r for r, _, _ in loaded])
    if executor == "ray" and not remote_tiers:   # before planning: nodes share objects through a remote only
        from qbuild.pipeline.executor_ray import need_remote_message

        raise UserError(need_remote_message())
    plans = [make_plan(r, base, st, remote_tiers, verify) for r, base, _ in loaded]
    run_id = st.new_run_id()
    started = time.time()
    runner = _executor(executor, st, run_id, loaded, plans, remote_tiers, address=address, progress=progress,
                       jobs=jobs, materialize=materialize, verify=verify)
    done = runner.run(list(_merged(plans).values()))
    by_key = {o.step.key: o for o in done}
    runs = tuple((the_plan, [by_key[ps.step.key] for ps in the_plan.steps], path)
                 for (_, _, path), the_plan in zip(loaded, plans, strict=True))
    return Built(st, run_id, started, runs, runner, remote_tiers, verify)


def _merged(plans: list[Plan]) -> dict:
    """step key → planned step, over every plan (the first plan's entry for a shared step)."""
    merged: dict = {}
    for the_plan in plans:
        for ps in the_plan.steps:
            merged.setdefault(ps.step.key, ps)
    return merged


def _executor(kind: str, st: Store, run_id: str, loaded: list[tuple[Recipe, Path, Path | None]], plans: list[Plan],
              remote_tiers: tuple, *, address, progress, jobs, materialize: bool, verify: str):
    """The local Executor or the RayExecutor, told which recipe (file and its hash) each step comes from."""
    from qbuild.base.hashing import sha256_text
    from qbuild.pipeline.outcome import Origin

    origins: dict = {}
    for (r, _, path), the_plan in zip(loaded, plans, strict=True):
        sha = sha256_text(path.read_text()) if path and path.is_file() else None
        for ps in the_plan.steps:
            origins.setdefault(ps.step.key, Origin(r.name, str(path or "<api>"), sha))
    device = loaded[0][0].runtime.device
    limits = [limit for the_plan in plans for limit in the_plan.time_limits]
    if kind == "ray":
        from qbuild.pipeline.executor_ray import RayExecutor

        return RayExecutor(st, run_id, origins, address=address, progress=progress, device=device, jobs=jobs,
                           remotes=remote_tiers, materialize=materialize, time_limits=limits)
    from qbuild.pipeline.executor import Executor

    return Executor(st, run_id, origins, progress=progress, device=device, jobs=jobs, remotes=remote_tiers,
                    materialize=materialize, verify=verify, time_limits=limits)
