"""`selection.on_uncertain: measure_more`: add rounds to the candidates in doubt before deciding.

A candidate is in doubt when one of its latency/throughput bounds is within noise (its 95 % interval straddles
the bound), or when it is tied with the best under max_throughput (overlapping intervals). For each one, a pass
plans one more serving step of its (artifact, config), `serving[<artifact>@<config>]+<first round>`: the same
server, flags and workload, `measure_more_rounds` rounds that go on where the earlier ones ended (their own prompts
and arrivals). The summary pools every round of a point over all its steps, and selection is judged again; passes go
on while something is in doubt and `measure_more_minutes` is not spent (checked before each pass). What is still in
doubt then is rejected, as under on_uncertain: reject.

The added steps are steps like any other (stored, keyed, rerun builds nothing). `qbuild select` follows the same
passes from the store and stops where the run stopped (the next pass's steps are not stored), so it gives the same
verdict without measuring.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

MAX_PASSES = 20   # a bound on the loop whatever the budget: each pass at least doubles nothing, so it must end


def in_doubt(selection: dict) -> list[tuple[str, str]]:
    """(variant, config) of every candidate with a bound within noise, or in a tie, in the verdict's order."""
    found: list[tuple[str, str]] = []
    for c in [selection.get("selected"), *selection.get("rejected", [])]:
        if c and c.get("uncertain"):
            found.append((c["variant"], str(c["config"])))
    for c in (selection.get("tie") or {}).get("candidates") or []:
        found.append((c["variant"], str(c["config"])))
    return list(dict.fromkeys(found))


def more_steps(steps: list, doubt: list[tuple[str, str]], rounds: int) -> list:
    """One more serving step per candidate in doubt: its rounds follow those of every serving step it has."""
    from qbuild.contract.step import Step

    by_candidate: dict[tuple[str, str], list[Step]] = {}
    for s in steps:
        if s.kind == "serving":
            key = (s.runtime_args.get("label"), s.params["config"]["name"])
            by_candidate.setdefault(key, []).append(s)
    out = []
    for variant, config in doubt:
        have = by_candidate.get((variant, config))
        if not have:
            continue
        base = have[0]
        done = sum(s.params["workload"].get("rounds", 1) for s in have)
        workload = {**base.params["workload"], "rounds": rounds, "first_round": done}
        out.append(replace(base, name=f"{base.name.split('+')[0]}+{done}", params={**base.params, "workload": workload},
                           after=()))
    return out


def settle(the_plan, outcomes: list, run_steps: Callable[[list], list | None], budget_s: float | None):
    """Passes of added rounds until nothing is in doubt, the budget is spent, or `run_steps` (the steps →
    their outcomes, or None: not measured) stops. The plan and outcomes with the added steps."""
    from qbuild.results.summary import summarize

    recipe = the_plan.recipe
    started = time.monotonic()
    for _ in range(MAX_PASSES):
        if budget_s is not None and time.monotonic() - started >= budget_s:
            break
        selection = summarize(the_plan, outcomes)["selection"]
        steps = more_steps([ps.step for ps in the_plan.steps], in_doubt(selection), recipe.selection.measure_more_rounds)
        if not steps:
            break
        result = run_steps(steps)
        if result is None:
            break
        planned, new = result
        the_plan = replace(the_plan, steps=(*the_plan.steps, *planned))
        outcomes = [*outcomes, *new]
    return the_plan, outcomes


def measure_more(built, the_plan, outcomes: list) -> tuple:
    """After a run (qbuild.pipeline.run.Built): passes of added serving rounds for the candidates in doubt, run by the
    same executor, within the selection's budget. Nothing when a step of the run failed."""
    from qbuild.contract.step import Outcome
    from qbuild.pipeline.plan import step_status

    if any(o.status == Outcome.FAILED for o in outcomes):
        return the_plan, outcomes
    name = the_plan.recipe.name

    def execute(steps):
        # the executor starts a step once its inputs are resolved in the same call: they go along (stored by now)
        planned = [step_status(s, built.store, name, built.remotes, built.verify)
                   for s in (*prerequisites(steps), *steps)]
        keys = {s.key for s in steps}
        return [ps for ps in planned if ps.step.key in keys], [o for o in built.runner.run(planned) if o.step.key in keys]

    return settle(the_plan, outcomes, execute, the_plan.recipe.selection.measure_more_minutes * 60)


def from_store(store, the_plan, outcomes: list) -> tuple:
    """`qbuild select`: the passes the run made, read from the store; they stop where the run stopped."""
    from qbuild.contract.step import Outcome, PlanStatus
    from qbuild.pipeline.outcome import StepOutcome
    from qbuild.pipeline.plan import step_status

    def stored(steps):
        planned = [step_status(s, store, the_plan.recipe.name) for s in steps]
        if any(ps.status != PlanStatus.HIT for ps in planned):
            return None
        return planned, [StepOutcome(ps.step, Outcome.CACHED, ps.hit.path, ps.hit.digest, record=ps.hit.record)
                         for ps in planned]

    return settle(the_plan, outcomes, stored, None)


def prerequisites(steps) -> list:
    """Every step the given ones need, transitively, inputs first, each once."""
    seen: dict = {}

    def visit(step) -> None:
        for p in step.prerequisites():
            if p.key not in seen:
                visit(p)
                seen[p.key] = p
    for s in steps:
        visit(s)
    return list(seen.values())
