"""How long a plan's misses will take, from the store's own history of similar steps.

Every stored object's manifest records how long its step took (`timings.seconds`, on the machine that built
it). A miss is estimated from, in this order:
  1. the same step of the same recipe built before (a new seed, a new toolchain): its last build's time;
  2. a stored step of the same kind and runner, or of the same kind and quantization method (the recipe's method
     name outlives a runner's module path), with the most parameters in common (another GPTQ variant of the same
     model, another GGUF type);
  3. nothing: "no history" (counted and said, never guessed).
Where both the estimated step's model and the historical step's model are known, the time is scaled by
the ratio of their sizes (quantization and evaluation are roughly linear in the weights). The total is the
plan's misses scheduled as the executor schedules them: each step takes its threads' worth of the machine's
cores, a timing step runs alone, and a step starts when its inputs are done. It reads manifests only (no
torch, no model), and only when the plan has misses, so a cached plan stays instant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from qbuild.artifacts.store import MANIFEST, Store, read_json
from qbuild.base.files import dir_size
from qbuild.base.units import human_seconds


@dataclass(frozen=True)
class StepEstimate:
    seconds: float | None
    basis: str                   # "same step", "similar step (N/M params equal)", "no history"
    from_step: str | None = None  # the step (name) whose time it comes from


@dataclass(frozen=True)
class PlanEstimate:
    steps: dict[str, StepEstimate]   # step key -> its estimate (misses only)
    total_seconds: float             # wall time of the misses with history, scheduled on `cores`
    serial_seconds: float
    unknown: int                     # misses without history (not in the total)
    cores: int
    cold_seconds: float | None = None   # the whole recipe on an empty store: stored steps at their own build times
    cold_excluded: int = 0              # steps left out of it: this machine cannot build them (or their inputs)

    def as_dict(self) -> dict:
        return {"total_s": round(self.total_seconds, 1), "serial_s": round(self.serial_seconds, 1),
                "steps_without_history": self.unknown, "cores": self.cores,
                "cold_s": None if self.cold_seconds is None else round(self.cold_seconds, 1),
                "cold_excluded": self.cold_excluded}


def _history(store: Store) -> list[dict]:
    """(kind, name, runner, recipe, params, seconds, model size, created) of every stored object that has timings."""
    rows = []
    for obj in store.objects():
        m = read_json(obj / MANIFEST)
        if not m or not isinstance(m.get("timings"), dict):
            continue
        seconds = m["timings"].get("seconds")
        if not isinstance(seconds, int | float) or seconds <= 0:
            continue
        model = (m.get("inputs") or {}).get("model") or {}
        rows.append({"kind": m.get("kind"), "name": m.get("name"), "runner": m.get("runner"),
                     "recipe": (m.get("recipe") or {}).get("name") if isinstance(m.get("recipe"), dict) else None,
                     "params": m.get("params") if isinstance(m.get("params"), dict) else {},
                     "seconds": float(seconds), "model_digest": model.get("digest") if isinstance(model, dict) else None,
                     "created": str(m.get("created") or "")})
    return rows


def _object_size(store: Store, digest: str | None, memo: dict) -> int | None:
    if not digest:
        return None
    if digest not in memo:
        try:
            m = read_json(store.object_dir(digest) / MANIFEST)
        except ValueError:
            m = None
        memo[digest] = sum(f.get("size", 0) for f in m["files"]) if m and isinstance(m.get("files"), list) else None
    return memo[digest]


def _dir_size(path: Path) -> int | None:
    try:
        return dir_size(path)
    except OSError:
        return None


def _param_overlap(a: dict, b: dict) -> tuple[int, int]:
    keys = set(a) | set(b)
    return sum(a.get(k) == b.get(k) for k in keys), len(keys)


def _tokens_ratio(mine: dict, theirs: dict) -> float:
    """How many more tokens an evaluation step scores than a historical one (max_windows × context_length, where both
    give them as numbers; a probe's under its `measure` params): an evaluation pass is about linear in them. 1.0 where
    either does not say."""
    def tokens(p: dict) -> float | None:
        p = p["measure"] if isinstance(p.get("measure"), dict) else p
        windows, length = p.get("max_windows"), p.get("context_length")
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (windows, length))
        return float(windows * length) if ok else None

    a, b = tokens(mine), tokens(theirs)
    return a / b if a and b else 1.0


def estimate_plan(planned, store: Store, recipe_name: str, cores: int | None = None,
                  fallback: dict[str, float] | None = None) -> PlanEstimate:
    """Estimates for the misses of `planned` (PlannedStep rows of a Plan) and the plan's total. `fallback`: step key
    → seconds to use where the store has no history of it (a planner's own size-based guess); counted as known."""
    from qbuild.contract.step import PlanStatus

    cores = max(1, cores or os.cpu_count() or 1)
    misses = [p for p in planned if p.status == PlanStatus.MISS]
    if not misses:
        return PlanEstimate({}, 0.0, 0.0, 0, cores, *_cold(planned, {}, cores))
    history = _history(store)
    sizes: dict = {}
    digests = {p.step.key: (p.hit.digest if p.hit else None) for p in planned}

    def model_size(step) -> int | None:
        model = step.inputs.get("model")
        if model is None:
            return None
        if model.source_path is not None:
            return _dir_size(model.source_path)
        return _object_size(store, digests.get(model.key), sizes)

    out: dict[str, StepEstimate] = {}
    for p in misses:
        s = p.step
        same = [h for h in history if h["kind"] == s.kind and h["name"] == s.name and h["recipe"] == recipe_name]
        basis, best = None, None
        if same:
            best, basis = max(same, key=lambda h: h["created"]), "same step, built before"
        else:
            method = s.params.get("method")
            similar = [h for h in history if h["kind"] == s.kind and (
                h["runner"] == s.runner or (method is not None and h["params"].get("method") == method))]
            if similar:
                params = dict(s.params)
                best = max(similar, key=lambda h: (_param_overlap(params, h["params"])[0], h["created"]))
                equal, total = _param_overlap(dict(s.params), best["params"])
                basis = f"similar step ({equal}/{total} params equal)"
        if best is None:
            guess = (fallback or {}).get(s.key)
            out[s.key] = StepEstimate(guess, "no history" if guess is None else "no history: size-based guess")
            continue
        seconds = best["seconds"]
        mine, theirs = model_size(s), _object_size(store, best["model_digest"], sizes)
        if mine and theirs and mine != theirs:
            seconds *= mine / theirs
            basis += f", scaled by model size x{mine / theirs:.2f}"
        tokens = _tokens_ratio(dict(s.params), best["params"])
        if tokens != 1.0:   # an evaluation of 2 windows is not as long as one of 8 (a search's sensitivity passes)
            seconds *= tokens
            basis += f", scaled by evaluated tokens x{tokens:.2f}"
        out[s.key] = StepEstimate(seconds, basis, best["name"])
    total = _schedule([p.step for p in misses], out, cores)
    serial = sum(e.seconds for e in out.values() if e.seconds is not None)
    return PlanEstimate(out, total, serial, sum(e.seconds is None for e in out.values()), cores,
                        *_cold(planned, out, cores))


def _cold(planned, misses: dict[str, StepEstimate], cores: int) -> tuple[float | None, int]:
    """How long the whole recipe takes on an empty store here: each stored step at the time its own build took (its
    manifest's timings), each miss at its estimate, scheduled as the executor runs them; and how many steps are left
    out because this machine cannot build them or their inputs (a run skips or refuses those). None when a step has
    no time (a miss without history, a step stored before timings were recorded)."""
    from qbuild.contract.step import PlanStatus

    times: dict[str, StepEstimate] = {}
    steps, blocked = [], set()
    for p in planned:   # in plan order: a step's inputs come before it
        if p.status == PlanStatus.SOURCE:
            continue
        if p.status in (PlanStatus.NEEDS_GPU, PlanStatus.UNAVAILABLE) or \
                any(i.key in blocked for i in p.step.prerequisites()):
            blocked.add(p.step.key)
            continue
        if p.status == PlanStatus.MISS:
            est = misses.get(p.step.key)
        else:
            record = p.hit.record if p.hit else (p.remote_hit.record if p.remote_hit else None)
            seconds = ((record or {}).get("timings") or {}).get("seconds")
            est = StepEstimate(float(seconds), "its own build") if isinstance(seconds, int | float) else None
        if est is None or est.seconds is None:
            return None, len(blocked)
        times[p.step.key] = est
        steps.append(p.step)
    return (_schedule(steps, times, cores) if steps else None), len(blocked)


def _schedule(steps, estimates: dict[str, StepEstimate], cores: int) -> float:
    """Wall time of `steps` run the executor's way: a step starts when its inputs are done and its threads fit in
    the free cores; a timing step (per_hardware) runs alone. Steps without an estimate take no time."""
    pending = {s.key: s for s in steps}
    done_at: dict[str, float] = {}
    running: list[tuple[float, str, int, bool]] = []   # (end, key, cores, alone)
    now, free = 0.0, cores
    while pending or running:
        started = True
        while started:
            started = False
            if any(alone for *_, alone in running):
                break
            for key, s in list(pending.items()):
                if any(i.key in pending or (i.key not in done_at and any(r[1] == i.key for r in running))
                       for i in s.prerequisites()):
                    continue
                need = min(max(s.threads, 1), cores)
                if s.per_hardware and running:
                    continue
                if running and need > free:
                    continue
                est = estimates.get(key)
                running.append((now + (est.seconds if est and est.seconds else 0.0), key, need, s.per_hardware))
                free -= need
                del pending[key]
                started = True
                if s.per_hardware:
                    break
        if not running:   # only steps waiting on inputs outside this set: they are done already
            for key in list(pending):
                done_at[key] = now
                del pending[key]
            continue
        running.sort()
        end, key, need, _ = running.pop(0)
        now, free = end, free + need
        done_at[key] = end
    return now


def history_note(estimate: PlanEstimate) -> str:
    """`qbuild plan`'s lines: the total and what it rests on, and how long a cold build here would take."""
    lines = []
    if estimate.steps:
        known = len(estimate.steps) - estimate.unknown
        line = (f"estimated {human_seconds(estimate.total_seconds)} for {known} step(s) on {estimate.cores} core(s), "
                f"from this store's history")
        if estimate.unknown:
            line += f"; {estimate.unknown} step(s) have no history yet (not counted)"
        lines.append(line)
    if estimate.cold_seconds is not None:
        lines.append(f"a cold build of the whole recipe (an empty store) would take about "
                     f"{human_seconds(estimate.cold_seconds)} on {estimate.cores} core(s): each stored step at its own "
                     f"build time" + (f" ({estimate.cold_excluded} step(s) this machine cannot build not counted)"
                                      if estimate.cold_excluded else ""))
    return "\n".join(lines)


__all__ = ["estimate_plan", "PlanEstimate", "StepEstimate", "history_note", "human_seconds"]
