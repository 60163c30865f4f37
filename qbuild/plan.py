"""recipe → plan: a graph of steps, each with a key, looked up in the store (never imports torch)."""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from qbuild import build as build_registry
from qbuild import quantize as quantize_registry
from qbuild.artifacts.store import Hit, Store
from qbuild.calibration.plan import calibration_step, eval_data_step, overlapping_sources
from qbuild.errors import MissingBackendError, RecipeError
from qbuild.evaluate.plan import evaluation_steps
from qbuild.models.resolve import model_info, model_step
from qbuild.recipe import Recipe, locate
from qbuild.step import Step


log = logging.getLogger("qbuild")


@dataclass
class PlannedStep:
    step: Step
    status: str                  # hit | miss | source | needs-gpu (a miss this machine cannot build)
    hit: Hit | None = None
    reason: str = ""


@dataclass
class PlanContext:
    """What adapters get while planning: the recipe, shared upstream steps, and a way to add steps."""

    recipe: Recipe
    recipe_dir: Path
    steps: list[Step] = field(default_factory=list)
    _by_key: dict[str, Step] = field(default_factory=dict)
    _model: Step | None = None
    _calibration: Step | None = None
    _model_info: dict | None = None
    warnings: list[str] = field(default_factory=list)  # also logged to the "qbuild" logger

    @property
    def threads(self) -> int:
        return self.recipe.runtime.resolved_threads()

    @property
    def device(self) -> str:
        return self.recipe.runtime.device

    def add(self, step: Step) -> Step:
        """Add a step (its inputs must already be added); identical steps are shared, not repeated."""
        step.compute_key()
        if step.key in self._by_key:
            return self._by_key[step.key]
        self._by_key[step.key] = step
        self.steps.append(step)
        return step

    def model(self) -> Step:
        if self._model is None:
            self._model = self.add(model_step(self.recipe.model, self.recipe_dir))
        return self._model

    def model_info(self) -> dict:
        if self._model_info is None:
            self._model_info = model_info(self.model())
        return self._model_info

    def calibration(self) -> Step:
        """The one tokenized calibration set every calibrated method shares."""
        if self._calibration is None:
            self._calibration = self.add(calibration_step(self.recipe.calibration, self.model(), self))
        return self._calibration

    def eval_data(self, perplexity) -> Step:
        return self.add(eval_data_step(perplexity, self.model(), self))


def require_backend(requires: tuple[str, ...], extra: str, field: str, what: str) -> None:
    for mod in requires:
        if importlib.util.find_spec(mod) is None:
            raise MissingBackendError(f"{what} needs the Python module {mod!r}, which", extra, field=field)


def build_steps(recipe: Recipe, recipe_dir: Path) -> tuple[PlanContext, dict[str, Step]]:
    """All steps of the recipe in dependency order, and the artifact step of each variant."""
    try:
        return _build_steps(recipe, recipe_dir)
    except RecipeError as err:
        raise locate(err, recipe) from None


def _build_steps(recipe: Recipe, recipe_dir: Path) -> tuple[PlanContext, dict[str, Step]]:
    ctx = PlanContext(recipe, recipe_dir)
    ctx.model()
    variant_steps: dict[str, Step] = {}
    for i, v in enumerate(recipe.variants):
        adapter = quantize_registry.adapter(v.method)
        require_backend(adapter.REQUIRES, adapter.EXTRA, f"variants[{i}].method", f"method {v.method!r}")
        adapter.check(v, ctx, field=f"variants[{i}]")
        variant_steps[v.name] = adapter.plan(v, ctx)
    for i, t in enumerate(recipe.targets):
        adapter = build_registry.adapter(t.type)
        names = [v.name for v in recipe.variants] if t.variants == "all" else t.variants
        for name in names:
            adapter.plan(t, variant_steps[name], ctx, field=f"targets[{i}]")
    evaluation_steps(recipe, ctx, variant_steps)
    for warning in overlapping_sources(recipe.calibration, recipe.evaluation.perplexity, recipe_dir):
        ctx.warnings.append(warning)
        log.warning(warning)
    return ctx, variant_steps


def explain_miss(step: Step, store: Store, recipe_name: str) -> str:
    """Why a step must run: compare with the last build of the same named step for this recipe."""
    last = store.last_build(recipe_name, step.name)
    if last is None:
        return "new"
    if last.get("key") == step.key:
        return "stored object missing (deleted or damaged)"
    reasons = []
    changed = _diff(last.get("params", {}), step.params)
    if changed:
        reasons.append("params changed: " + ", ".join(changed))
    old_inputs, new_inputs = last.get("inputs", {}), step.input_keys()
    moved = sorted(r for r in set(old_inputs) | set(new_inputs) if old_inputs.get(r) != new_inputs.get(r))
    if moved:
        reasons.append("input changed: " + ", ".join(f"{r} ({step.inputs[r].name})" if r in step.inputs else r for r in moved))
    tc = _diff(last.get("toolchain", {}), step.toolchain())
    if tc:
        reasons.append("toolchain changed: " + ", ".join(tc))
    if last.get("impl", 1) != step.impl_version:
        reasons.append(f"qbuild's {step.kind} implementation changed (v{last.get('impl', 1)} → v{step.impl_version})")
    return "; ".join(reasons) or "key changed"


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, "∅"), new.get(k, "∅")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} {_short(a)} → {_short(b)}")
    return out


def _short(v) -> str:
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def make_plan(recipe: Recipe, recipe_dir: Path, store: Store) -> tuple[list[PlannedStep], dict[str, Step]]:
    ctx, variant_steps = build_steps(recipe, recipe_dir)
    planned = []
    for step in ctx.steps:
        if step.source_path is not None:
            planned.append(PlannedStep(step, "source", reason=str(step.source_path)))
            continue
        hit = store.lookup(step.key)
        if hit:
            planned.append(PlannedStep(step, "hit", hit))
        elif step.unavailable:
            planned.append(PlannedStep(step, "needs-gpu" if step.requires_gpu else "unavailable",
                                       reason=step.unavailable))
        else:
            planned.append(PlannedStep(step, "miss", reason=explain_miss(step, store, recipe.name)))
    return planned, variant_steps
