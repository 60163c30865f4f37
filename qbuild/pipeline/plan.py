"""recipe → plan: a graph of steps, each with a key, looked up in the store (never imports torch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.artifacts.store import Hit, Store
from qbuild.base.errors import RecipeError
from qbuild.base.fingerprint import install_hint, package_version
from qbuild.base.hardware import gpu_devices
from qbuild.contract.plugin import methods, targets
from qbuild.contract.shapes import check_family
from qbuild.contract.step import PlanStatus, Step
from qbuild.pipeline.memory_fit import check_memory
from qbuild.planning.calibration import calibration_step, check_overlap, eval_data_step, overlapping_sources
from qbuild.planning.deploy import deploy_steps
from qbuild.planning.evaluation import evaluation_steps
from qbuild.planning.models import model_info, model_step
from qbuild.planning.recipe import Recipe, locate
from qbuild.planning.serving import serving_steps
from qbuild.planning.tasks import task_steps

if TYPE_CHECKING:
    from qbuild.artifacts.remote.cache import RemoteHit
    from qbuild.contract.envs import BackendEnv

log = logging.getLogger("qbuild")


@dataclass(frozen=True)
class Artifact:
    """A named model artifact of the plan: the baseline, a variant, or a target's output."""

    label: str                 # baseline | <variant> | <variant>.<target name>
    step: Step
    method: str                # method name, target type, or "-" for the baseline
    detail: str                # e.g. "Q4_K_M", "W4A16 g64 asym", "engine, SM 9.0"
    target: str | None = None  # the target type, for target outputs

    @property
    def baseline(self) -> bool:
        return self.label == "baseline"


@dataclass(frozen=True)
class PlannedStep:
    step: Step
    status: PlanStatus
    hit: Hit | None = None
    reason: str = ""
    remote_hit: RemoteHit | None = None   # status REMOTE_HIT: where the object is (its files are not fetched)
    reasons: tuple[dict, ...] = ()        # status MISS: why, as data ({"kind", "detail"}): run records keep it


@dataclass(frozen=True)
class Plan:
    """Everything `run` needs, built complete by make_plan."""

    recipe: Recipe
    recipe_dir: Path
    steps: tuple[PlannedStep, ...]
    artifacts: tuple[Artifact, ...]
    not_evaluated: dict[str, str]        # artifact label → why it gets no evaluation
    warnings: tuple[str, ...]
    remotes: tuple = ()                  # the remote tiers looked up (RemoteStore), in order
    estimate: object = None              # qbuild.pipeline.estimate.PlanEstimate: `qbuild plan` adds it (run does not need it)
    overlap: dict | None = None          # calibration vs evaluation text (qbuild.calibration.overlap)
    time_limits: tuple = ()              # TimeLimit: wall-time limits on sets of steps, enforced by the executor too
    protocol: dict | None = None         # the perplexity protocol as evaluated (BOS as the model has it), with `bos_why`

    @property
    def to_build(self) -> int:
        return sum(p.status == PlanStatus.MISS for p in self.steps)

    def artifact_steps(self) -> dict[str, Step]:
        return {a.label: a.step for a in self.artifacts if not a.baseline}

    def device(self, step: Step) -> str:
        """Where `step` runs: cuda for a step that needs a GPU, or one that can use it when the recipe's device gives
        one (runtime.device cuda, or auto on a machine with a GPU); cpu otherwise; "" for a source (nothing runs)."""
        if step.source_path is not None or step.source_digest is not None:
            return ""
        if step.requires_gpu:
            return "cuda"
        wanted = self.recipe.runtime.device
        if step.gpu_capable and (wanted == "cuda" or (wanted == "auto" and gpu_devices())):
            return "cuda"
        return "cpu"

    def as_dict(self) -> dict:
        estimates = self.estimate.steps if self.estimate is not None else {}
        rows = [{"step": p.step.name, "kind": p.step.kind, "status": p.status, "key": p.step.key, "reason": p.reason,
                 "device": self.device(p.step),
                 "reasons": list(p.reasons),
                 "digest": p.hit.digest if p.hit else (p.remote_hit.digest if p.remote_hit else None),
                 "env": p.step.backend_env.label if p.step.backend_env else None,
                 # what the key hashes (kind, params, input keys, toolchain): a reader can see why two keys differ
                 "key_material": {"params": dict(p.step.params), "inputs": p.step.input_keys(),
                                  "toolchain": p.step.toolchain()},
                 **({"estimate_s": None if estimates[p.step.key].seconds is None else round(estimates[p.step.key].seconds, 1),
                     "estimate_basis": estimates[p.step.key].basis} if p.step.key in estimates else {})}
                | ({"command": list(p.step.runtime_args["command"])} if "command" in p.step.runtime_args else {})
                for p in self.steps]
        out = {"recipe": self.recipe.name, "steps": rows, "to_build": self.to_build,
               "not_evaluated": [{"artifact": label, "reason": why} for label, why in self.not_evaluated.items()],
               "warnings": list(self.warnings), "overlap": self.overlap, "protocol": self.protocol}
        if self.estimate is not None:
            out["estimate"] = self.estimate.as_dict()
        return out


@dataclass(frozen=True)
class TimeLimit:
    """A planner's wall-time limit on a set of its steps (a search's `max_minutes`): checked against the estimate of
    their misses once the store has been looked up; over it, planning refuses in one line naming `field`."""

    field: str                    # the recipe field, e.g. variants[1].search.max_minutes
    minutes: float
    what: str                     # e.g. "the search for mix-q4km"
    steps: tuple[Step, ...]
    fallback: dict[str, float]    # step key → seconds where the store has no history of the step
    advice: str                   # what to lower


@dataclass
class PlanContext:
    """What plugins get while planning: the recipe, shared upstream steps, and a way to add steps."""

    recipe: Recipe
    recipe_dir: Path
    steps: list[Step] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    not_evaluated: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)   # also logged to the "qbuild" logger
    overlap: dict | None = None                         # calibration vs evaluation text, measured before any step
    bos_decision: dict | None = None                    # {added, why}: BOS on each evaluation window, and why
    _by_key: dict[str, Step] = field(default_factory=dict)
    _model: Step | None = None
    _gates: dict[str, Step] = field(default_factory=dict)   # step key → its check: what reads the step waits for it
    _calibration: Step | None = None
    _model_info: dict | None = None
    _envs: dict[str, BackendEnv] = field(default_factory=dict)
    time_limits: list[TimeLimit] = field(default_factory=list)

    @property
    def threads(self) -> int:
        return self.recipe.runtime.resolved_threads()

    @property
    def elastic_threads(self) -> bool:
        return self.recipe.runtime.elastic_threads

    @property
    def device(self) -> str:
        return self.recipe.runtime.device

    def add(self, step: Step) -> Step:
        """Add a step (its inputs must already be added); identical steps are shared, not repeated. A step that
        reads a checked step (the baseline, a GGUF conversion) waits for its check (`after`: its key does not
        change)."""
        if step.key in self._by_key:
            return self._by_key[step.key]
        checks = [self._gates[s.key] for s in step.inputs.values() if s.key in self._gates]
        if checks:
            step = replace(step, after=(*step.after, *checks))
        self._by_key[step.key] = step
        self.steps.append(step)
        return step

    def untouched_dtype(self) -> str | None:
        """The dtype in which a quantized artifact writes the matrices its scheme leaves as they were, where that is
        narrower than the model step's output: a quantized GGUF imported (dtype auto) as float32 gives float16, so
        an artifact's embeddings are not widened to 4 bytes (qbuild.models.untouched); None otherwise."""
        if self.model().kind != "import-gguf" or getattr(self.recipe.model, "dtype", None) != "auto":
            return None
        return self.model_info().get("untouched_dtype")   # set only for files `auto` imports as float32

    def artifact_steps(self) -> dict[str, Step]:
        """label → step of every named artifact but the baseline (variants, target outputs)."""
        return {a.label: a.step for a in self.artifacts if not a.baseline}

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning(message)

    def limit_time(self, field: str, minutes: float, what: str, steps, fallback: dict[str, float], advice: str) -> None:
        """Refuse the plan if `steps`' misses are estimated at more than `minutes` (TimeLimit, check_time_limit)."""
        self.time_limits.append(TimeLimit(field, minutes, what, tuple(steps), dict(fallback), advice))

    def note_not_evaluated(self, label: str, reason: str) -> None:
        self.not_evaluated[label] = reason

    def backend_env(self, variant, method) -> BackendEnv | None:
        """Where `variant`'s quantization runs: its `env:`, else the method's default environment, else None
        (qbuild's own). Resolving a uv environment reads or makes its lock (no environment is created here)."""
        option = getattr(variant, "env", None) or method.default_env
        index = next((i for i, v in enumerate(self.recipe.variants) if v.name == variant.name), 0)
        return self.named_env(option, f"variants[{index}].env", explicit=getattr(variant, "env", None) is not None)

    def named_env(self, option, field: str, explicit: bool = True) -> BackendEnv | None:
        """A BackendEnv for a built-in name, an EnvOption, or None; errors name `field`."""
        if option is None:
            return None
        from qbuild import envs

        cache_key = option if isinstance(option, str) else option.model_dump_json()
        if cache_key not in self._envs:
            try:
                if isinstance(option, str):
                    found = envs.backend(option)
                elif option.python:
                    found = envs.existing(option.python)
                else:
                    found = envs.resolve("custom", tuple(option.packages))
            except envs.EnvError as exc:
                raise RecipeError(field if explicit else field.rsplit(".", 1)[0] + ".method", str(exc)) from None
            self._envs[cache_key] = found
        return self._envs[cache_key]

    def model(self) -> Step:
        if self._model is None:
            from qbuild.planning.fidelity import import_check_step

            self._model = self.add(model_step(self.recipe.model, self.recipe_dir))
            if self._model.kind == "import-gguf":
                from qbuild.models.gguf_import import unimportable

                why = unimportable(self.model_info())
                if why:
                    raise RecipeError("model.path", f"qbuild cannot import this GGUF: {why}")
            self.gate(self._model, import_check_step(self, self._model))
        return self._model

    def gate(self, checked: Step, check: Step | None) -> None:
        """Every step added from now on that reads `checked` waits for `check` (the check's own inputs, added before
        it, do not)."""
        if check is not None:
            self._gates[checked.key] = check

    def check_conversion(self, convert: Step) -> None:
        """A GGUF conversion of an HF source is compared with the checkpoint (step convert-check) before any step
        reading it runs; repeated calls share the one check."""
        from qbuild.planning.fidelity import conversion_check_step

        self.gate(convert, conversion_check_step(self, convert))

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


def build_steps(recipe: Recipe, recipe_dir: Path) -> PlanContext:
    """All steps of the recipe in dependency order, with its named artifacts."""
    try:
        return _build_steps(recipe, recipe_dir)
    except RecipeError as err:
        raise locate(err, recipe) from None


def _build_steps(recipe: Recipe, recipe_dir: Path) -> PlanContext:
    ctx = PlanContext(recipe, recipe_dir)
    ctx.overlap = check_overlap(recipe, recipe_dir)
    if ctx.overlap and "error" in ctx.overlap:
        ctx.warn(f"calibration/evaluation overlap not measured: {ctx.overlap['error']}")
    model = ctx.model()
    if recipe.evaluation.baseline:
        ctx.artifacts.append(Artifact("baseline", model, "-", "unquantized"))
    variant_steps: dict[str, Step] = {}
    for i, v in enumerate(recipe.variants):
        method = methods.get(v.method)
        env_option = getattr(v, "env", None)
        if env_option is not None and not method.runs_in_env:
            raise RecipeError(f"variants[{i}].env", f"method {v.method!r} runs in qbuild's own environment only")
        if not (env_option or method.default_env):   # in another environment the library need not be importable here
            method.require(f"variants[{i}].method", f"method {v.method!r}")
        check_family(ctx.model_info(), method, f"variants[{i}]", v)   # an architecture the method cannot build
        method.check(v, ctx, field=f"variants[{i}]")
        variant_steps[v.name] = step = method.plan(v, ctx)
        ctx.artifacts.append(Artifact(v.name, step, v.method, v.describe()))
    for i, t in enumerate(recipe.targets):
        target = targets.get(t.type)
        target.require(f"targets[{i}].type", f"target {t.type!r}")
        names = [v.name for v in recipe.variants] if t.variants == "all" else t.variants
        for name in names:
            target.check_input(variant_steps[name], f"targets[{i}]")
            out = target.plan(t, variant_steps[name], ctx, field=f"targets[{i}]")
            ctx.artifacts.append(Artifact(out.variant or f"{name}.{t.type}", out, t.type, target.describe(out),
                                          target=t.type))
    evaluation_steps(ctx)
    task_steps(ctx)
    serving_steps(ctx)
    deploy_steps(ctx)
    for warning in overlapping_sources(recipe.calibration, recipe.evaluation.perplexity, recipe_dir):
        ctx.warn(warning)
    return ctx


def explain_miss(step: Step, store: Store, recipe_name: str) -> str:
    """Why a step must run: compare with the last build of the same named step for this recipe."""
    return "; ".join(r["detail"] for r in miss_reasons(step, store, recipe_name)) or "key changed"


def miss_reasons(step: Step, store: Store, recipe_name: str) -> list[dict]:
    """explain_miss as data: [{"kind", "detail"}], kind one of REASON_KINDS."""
    last = store.last_build(recipe_name, step.name)
    if last is None:
        return [{"kind": "new", "detail": "new"}]
    if any(q.get("key") == step.key for q in store.quarantined):
        return [{"kind": "object damaged", "detail": "stored object damaged (quarantined)"}]
    if last.get("key") == step.key:
        return [{"kind": "object missing", "detail": "stored object missing (deleted or damaged)"}]
    new = {"params": step.params, "inputs": step.input_keys(), "toolchain": step.toolchain(), "impl": step.impl_version,
           "kind": step.kind, "input_steps": {r: s.name for r, s in step.inputs.items()}}
    return change_reasons(last, new) or [{"kind": "key", "detail": "key changed"}]


# why a step was rebuilt, by what changed: the recipe, the model it reads, another input, tools, or qbuild itself
REASON_KINDS = ("new", "object missing", "object damaged", "recipe parameter", "source model digest", "input", "tool version",
                "implementation", "key")


def change_reasons(old: dict, new: dict) -> list[dict]:
    """What differs between two builds of a step: each a dict with params, inputs (role → key), toolchain, impl,
    and optionally kind and input_steps (role → step name). The source model is the input made by step "model"."""
    reasons = []
    if not all(isinstance(d.get(k, {}), dict) for d in (old, new) for k in ("params", "inputs", "toolchain", "input_steps")):
        return [{"kind": "key", "detail": "key changed"}]   # a record from another version or edited by hand
    from qbuild.base.names import redact_tree

    changed = _diff(old.get("params", {}), redact_tree(new.get("params", {})))   # history is stored redacted
    if changed:
        reasons.append({"kind": "recipe parameter", "detail": "params changed: " + ", ".join(changed)})
    old_inputs, new_inputs = old.get("inputs", {}), new.get("inputs", {})
    names = {**old.get("input_steps", {}), **new.get("input_steps", {})}
    moved = sorted(r for r in set(old_inputs) | set(new_inputs) if old_inputs.get(r) != new_inputs.get(r))
    if moved:
        reasons.append({"kind": "source model digest" if any(names.get(r) == "model" for r in moved) else "input",
                        "detail": "input changed: " + ", ".join(f"{r} ({names[r]})" if r in names else r
                                                                 for r in moved)})
    tc = _diff(old.get("toolchain", {}), new.get("toolchain", {}))
    if tc:
        reasons.append({"kind": "tool version", "detail": "toolchain changed: " + ", ".join(tc)})
    if old.get("impl", 1) != new.get("impl", 1):
        reasons.append({"kind": "implementation", "detail": f"qbuild's {new.get('kind', 'step')} implementation "
                                                            f"changed (v{old.get('impl', 1)} → v{new.get('impl', 1)})"})
    return reasons


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


def _not_installed(step: Step) -> str:
    """Why a step that runs in qbuild's own Python cannot start: packages it uses are not installed ("" if none).
    Said at plan time, before any work, instead of as an ImportError once the steps before it have run."""
    if step.backend_env is not None:   # its environment gets what it needs when it is created
        return ""
    absent = [d for d in step.tools if package_version(d) == "absent"]
    if not absent:
        return ""
    return f"needs {', '.join(absent)}, not installed here ({install_hint(absent)})"


def step_status(step: Step, store: Store, recipe_name: str, remotes: tuple = (), verify: str = "fast") -> PlannedStep:
    """The step as planned against `store` (and `remotes`): source, hit, remote hit or miss, with why it misses."""
    if step.source_path is not None:
        return PlannedStep(step, PlanStatus.SOURCE, reason=str(step.source_path))
    hit = store.lookup(step.key, verify=verify)
    if hit:
        return PlannedStep(step, PlanStatus.HIT, hit)
    if remotes:
        from qbuild.artifacts.remote.cache import lookup

        remote_hit = lookup(remotes, step.key)  # reads the action record only, never the object's files
        if remote_hit:
            return PlannedStep(step, PlanStatus.REMOTE_HIT, reason=remote_hit.where, remote_hit=remote_hit)
    if step.unavailable:
        return PlannedStep(step, PlanStatus.NEEDS_GPU if step.requires_gpu else PlanStatus.UNAVAILABLE,
                           reason=step.unavailable)
    missing = _not_installed(step)
    if missing:
        return PlannedStep(step, PlanStatus.UNAVAILABLE, reason=missing)
    reasons = miss_reasons(step, store, recipe_name)
    return PlannedStep(step, PlanStatus.MISS, reason="; ".join(r["detail"] for r in reasons) or "key changed",
                       reasons=tuple(reasons))


def make_plan(recipe: Recipe, recipe_dir: Path, store: Store, remotes: tuple = (), verify: str = "fast") -> Plan:
    """Every step with its status: local hit, else a hit in the first remote that has it, else a miss (and why).

    Every local hit is checked first (verify="fast": file set, sizes, memoized hashes; "full": re-hash)."""
    ctx = build_steps(recipe, recipe_dir)
    steps = tuple(step_status(s, store, recipe.name, tuple(remotes), verify) for s in ctx.steps)
    try:
        for limit in ctx.time_limits:
            check_time_limit(limit, steps, store, recipe.name)
        for warning in check_memory(steps, ctx.model_info(), ctx.model().source_path, recipe.variants):
            ctx.warn(warning)
    except RecipeError as err:
        raise locate(err, recipe) from None
    return Plan(recipe, recipe_dir, steps, tuple(ctx.artifacts), dict(ctx.not_evaluated), tuple(ctx.warnings),
                tuple(remotes), overlap=ctx.overlap, time_limits=tuple(ctx.time_limits), protocol=_protocol(ctx))


def _protocol(ctx: PlanContext) -> dict | None:
    """The perplexity protocol the evaluation runs under (BOS as decided for this model) and why BOS is or is not
    added: what `qbuild plan`, `run` and their JSON state."""
    from qbuild.planning.evaluation import effective_evaluation

    perplexity = effective_evaluation(ctx).perplexity
    if perplexity is None:
        return None
    return {**perplexity.canonical(), "bos_why": ctx.bos_decision["why"]}


def check_time_limit(limit: TimeLimit, planned: tuple[PlannedStep, ...], store: Store, recipe_name: str) -> None:
    """Refuse (RecipeError on limit.field) when the limit's steps still to build are estimated to take longer than
    its minutes: the store's history of the same or similar steps (qbuild.pipeline.estimate), else the planner's
    size-based guess. A limit on wall time decides only whether to start; it never changes a step or its key."""
    from qbuild.pipeline.estimate import estimate_plan

    own = {s.key for s in limit.steps}
    misses = [p for p in planned if p.step.key in own and p.status == PlanStatus.MISS]
    if not misses:
        return
    estimate = estimate_plan(misses, store, recipe_name, fallback=limit.fallback)
    minutes = estimate.total_seconds / 60
    if minutes > limit.minutes:
        guessed = sum(e.basis.startswith("no history") for e in estimate.steps.values())
        basis = ("this store's history" if not guessed else
                 "the model's size" if guessed == len(misses) else "this store's history and the model's size")
        raise RecipeError(limit.field, f"{limit.what} is estimated at {minutes:.1f} min ({len(misses)} steps to build "
                                       f"on {estimate.cores} cores, from {basis}), over max_minutes {limit.minutes:g}: "
                                       f"{limit.advice}, or raise max_minutes")
