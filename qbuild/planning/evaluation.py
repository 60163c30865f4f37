"""Plan-time side of evaluation: perplexity, KLD and throughput steps per model artifact.

One forward pass per model and evaluation: with `kld`, the baseline's pass is `reference[baseline]`
(its perplexity + its scored log-probs, an object keyed by baseline × eval data × protocol ×
runtime, so every variant and every later recipe with the same baseline reuses it), and each
variant's `perplexity[...]` step reads that object and gives PPL, KLD and top-1 from its one pass.

The runtime is chosen by the artifact's format (qbuild.contract.formats.runtimes_for). An artifact no
installed runtime can evaluate is recorded in ctx.not_evaluated, which `qbuild plan` and the run
summary show: nothing is dropped silently.

With `load_check`, each model artifact also gets a `load-check[...]` step per installed runtime that reads it
(qbuild/evaluate/loadcheck.py): greedy generation from one fixed prompt, compared with the baseline's.
"""

from __future__ import annotations

import logging

from qbuild.base.errors import RecipeError
from qbuild.contract.formats import runtimes_for, spec
from qbuild.contract.plugin import Runtime
from qbuild.contract.step import HF_PRELOAD, Step
from qbuild.planning.calibration import TOKENIZE_TOOLS

log = logging.getLogger("qbuild")

def pick_runtime(fmt: str) -> tuple[Runtime | None, str]:
    """(the runtime that evaluates `fmt`, "") or (None, why none can)."""
    found = runtimes_for(fmt)
    if not found:
        return None, f"no runtime for {fmt}"
    if found[0].missing():
        rt = found[0]
        return None, f"runtime {rt.name} for {fmt} is not installed (pip install 'qbuild[{rt.extra}]')"
    return found[0], ""


def evaluable_artifacts(ctx):
    """(artifact, the runtime that evaluates it) of every model artifact, in plan order; one no installed runtime
    reads is noted in ctx.not_evaluated (shown by `plan` and the summary), never dropped silently."""
    for art in ctx.artifacts:
        if not spec(art.step.format).model:
            continue
        rt, why = pick_runtime(art.step.format)
        if rt is None:
            ctx.note_not_evaluated(art.label, why)
            continue
        yield art, rt


# through a runtime whose numbers are the same bit for bit at any thread count (Runtime.thread_invariant: llama.cpp
# on CPU), they may take cores left idle while they run; a timing or generation step keeps the threads it was given
ELASTIC_KINDS = ("reference", "perplexity")
# v2: no timings in the objects' files (they went to the manifest), so a rebuild is bit-identical;
# reference v3: float16 log-probs + exact top-1 (qbuild.evaluate.reference_encoding), half of v2's float32 bytes
IMPL_VERSIONS = {"reference": 3, "perplexity": 2, "load-check": 2}


def runtime_step(kind: str, name: str, params: dict, runtime: Runtime, label: str, artifact: Step, inputs: dict,
                 tools, ctx, *, runner: str, **kw) -> Step:
    """A step that evaluates `artifact` through `runtime`: its plan fields, tools, format and environment. `runner`:
    written whole by the caller ("qbuild.evaluate.quality:perplexity"), where tests/test_architecture.py reads it."""
    fields = runtime.plan_fields(label, artifact, ctx, kind)
    runtime_args = {**fields.runtime_args, **kw.pop("runtime_args", {})}
    extra = {"env_toolchain": fields.env_toolchain, "requires_gpu": fields.requires_gpu,
             "unavailable": fields.unavailable}
    if fields.on_unavailable is not None:
        extra["on_unavailable"] = fields.on_unavailable
    fmt = spec(artifact.format)
    tools = tuple(sorted(set(tools) | set(runtime.tools) | set(fmt.load_tools)))
    kw.setdefault("format", "metrics")
    # a format only another environment reads (GPTQ: gptqmodel) is evaluated there; so is a model built in one
    env = artifact.backend_env or ctx.named_env(fmt.eval_env, f"evaluation (artifact {label})")
    kw.setdefault("impl_version", IMPL_VERSIONS.get(kind, 1))
    elastic = ctx.elastic_threads and kind in ELASTIC_KINDS and runtime.thread_invariant
    return ctx.add(Step(kind, name, params, runner, inputs={**inputs, **fields.extra_inputs}, tools=tools,
                        threads=ctx.threads, elastic_threads=elastic,
                        preload=runtime.preload if env is None else (),
                        backend_env=env, runtime_args=runtime_args, memory=runtime.memory(kind), gpu_capable=True, **extra,
                        **kw))


def evaluation_steps(ctx) -> None:
    """Add the evaluation steps of every model artifact in ctx.artifacts (baseline, variants, target outputs)."""
    ev = ctx.recipe.evaluation
    if ev.load_check:
        load_check_steps(ctx, ev.load_check)
    if not (ev.perplexity or ev.throughput):
        return
    ev = effective_evaluation(ctx)
    data, reference = _quality_reference(ctx, ev, note=True)
    for art, rt in evaluable_artifacts(ctx):
        skipped = rt.cannot_measure(art.label, art.step, ev)
        for reason in dict.fromkeys(skipped.values()):
            ctx.warn(reason)
        if ev.perplexity and "perplexity" not in skipped:
            if art.baseline and reference is not None and art.step.key == ctx.model().key:
                pass  # the reference step is the baseline's one pass: its perplexity comes from there
            else:
                perplexity = ev.perplexity
                if perplexity.kv_cache_dtype and perplexity.kv_cache_dtype not in rt.kv_cache_dtypes:
                    perplexity = perplexity.model_copy(update={"kv_cache_dtype": None})
                    ctx.warn(f"evaluation.perplexity.kv_cache_dtype applies to the llama.cpp runtime only: {art.label} "
                             f"is evaluated by {rt.name} with its default KV cache")
                data = data or ctx.eval_data(ev.perplexity)
                _perplexity_step(ctx, ev, perplexity, art, rt, data, None if art.baseline or "kld" in skipped
                                 else reference, f"perplexity[{art.label}]", reuse_candidates=True)
        if ev.throughput and "throughput" not in skipped:
            params = {**ev.throughput.canonical(), "runtime": rt.name, "device": ctx.device}
            # timings belong to a machine: the hardware is part of the key, so another machine never hits
            runtime_step("throughput", f"throughput[{art.label}]", params, rt, art.label, art.step, {"model": art.step}, (),
                         ctx, runner="qbuild.evaluate.throughput:run", per_hardware=True)
    if ev.runtimes and ev.perplexity:
        other_runtime_steps(ctx, ev, data or ctx.eval_data(ev.perplexity), reference)


def other_runtime_steps(ctx, ev, data: Step, reference: Step | None) -> None:
    """evaluation.runtimes: each artifact scored again through each named runtime that reads it, on the same windows
    and against the same reference, as `perplexity[<artifact>@<runtime>]` (runtime_args.also_runtime marks it: the
    summary shows it beside the artifact's own numbers, never instead of them)."""
    from qbuild.contract.plugin import runtimes

    for i, name in enumerate(ev.runtimes):
        if name not in runtimes:
            raise RecipeError(f"evaluation.runtimes[{i}]", f"{name!r} is not a runtime; known: "
                              f"{', '.join(runtimes.names())}")
        rt = runtimes.get(name)
        for art in ctx.artifacts:
            if not spec(art.step.format).model:
                continue
            own, _ = pick_runtime(art.step.format)
            if own is rt:
                continue   # its own numbers are this runtime's already
            if rt not in runtimes_for(art.step.format):
                ctx.warn(f"{art.label} not scored through {name}: {name} does not read {art.step.format}")
                continue
            skipped = rt.cannot_measure(art.label, art.step, ev)
            if "perplexity" in skipped:
                ctx.warn(f"{art.label} not scored through {name}: {skipped['perplexity']}")
                continue
            _perplexity_step(ctx, ev, ev.perplexity, art, rt, data, None if "kld" in skipped else reference,
                             f"perplexity[{art.label}@{name}]", also_runtime=name)


def measured_candidates(artifact: Step, params: dict, inputs: dict) -> dict[str, Step]:
    """The candidate files an artifact step chooses among and their measurements, when every candidate was measured
    exactly as this evaluation would measure the artifact (same params: windows, protocol, runtime; same data,
    reference and base-file inputs): {"candidate:<role>": model step, "measured:<role>": its perplexity step}, or, for
    candidates that were probes (built and measured in one step, their files never stored: probe_step),
    {"measured:<role>": the probe}. Empty when the artifact step has no such candidates (every ordinary variant) or
    one was measured otherwise.

    A search's selection (gguf-search-select) stores one finalist's file, byte for byte (it re-quantizes the probed
    one and checks its sha256), and every finalist was measured on the full evaluation windows: measuring the chosen
    file again gives the same numbers from the same bytes. Which finalist wins is only known at run time, so the
    variant's evaluation cannot be planned as that finalist's step; it is planned with every finalist's measurement
    as an input, and its runner returns the one whose file has the artifact's sha256
    (qbuild.evaluate.quality.perplexity_of_a_measured_file). Its key is still a function of hashed inputs only, and an
    ordinary variant's evaluation (no measured candidates) keeps its key."""
    rest = {role: s.key for role, s in inputs.items() if role != "model"}
    probes = {role: s for role, s in artifact.inputs.items() if is_probe(s)}
    if probes:
        for s in probes.values():
            measured_with = {r: s.inputs[r].key for r in MEASUREMENT_ROLES if r in s.inputs}
            if dict(s.params["measure"]) != params or measured_with != rest:
                return {}
        return {f"measured:{role}": s for role, s in probes.items()}
    candidates = {role: s for role, s in artifact.inputs.items() if spec(s.format).model}
    measurements = {s.inputs["model"].key: s for s in artifact.inputs.values()
                    if s.kind == "perplexity" and "model" in s.inputs}
    found = {}
    for role, candidate in candidates.items():
        m = measurements.get(candidate.key)
        if m is None or dict(m.params) != params or {r: s.key for r, s in m.inputs.items() if r != "model"} != rest:
            return {}
        found[f"candidate:{role}"], found[f"measured:{role}"] = candidate, m
    return found


MEASUREMENT_ROLES = ("data", "reference", "kld_base")   # a perplexity step's inputs besides its model


def is_probe(step: Step) -> bool:
    """A step made by probe_step: it builds a model in its scratch and stores only its measurement."""
    return isinstance(step.params.get("build"), dict) and isinstance(step.params.get("measure"), dict)


def _quality_reference(ctx, ev, note: bool = False) -> tuple[Step | None, Step | None]:
    """(eval data, the KLD reference) of the recipe's perplexity protocol: (None, None) without KLD; with `note`, a
    reference that cannot be made is noted against the baseline. Planned once: later calls get the same steps."""
    if not (ev.kld and ev.perplexity):
        return None, None
    if ev.kld_base:
        data = ctx.eval_data(ev.perplexity)
        return data, _kld_base_reference(ctx, ev, data)
    reference, why = reference_step(ctx, ev.perplexity)
    if reference is None:
        if note:
            ctx.note_not_evaluated("baseline", f"KLD needs the baseline's logits: {why}")
        return None, None
    return reference.inputs["data"], reference


def _perplexity_step(ctx, ev, perplexity, art, rt: Runtime, data: Step, reference: Step | None, name: str,
                     reuse_candidates: bool = False, **runtime_args) -> Step:
    """A `perplexity` step of `art` under the protocol `perplexity`: PPL, and KLD + top-1 from the same pass when a
    reference is given. With `reuse_candidates`, an artifact whose candidates were all measured exactly so reads
    the winner's measurement instead (measured_candidates)."""
    params = {**perplexity.canonical(), "runtime": rt.name}
    params.pop("dataset")  # identified by the eval-data input
    inputs = {"model": art.step, "data": data}
    if reference is not None:
        inputs["reference"] = reference  # KLD + top-1 from the same pass
        if ev.kld_base:
            inputs["kld_base"] = reference.inputs["kld_base"]  # windows are the file's tokens
    measured = measured_candidates(art.step, params, inputs) if reuse_candidates else {}
    if measured:
        # only what it reads (no evaluation text or reference log-probs to fetch on another node)
        return runtime_step("perplexity", name, {**params, "reuses": "candidate measurement"}, rt, art.label, art.step,
                     {"model": art.step, **measured}, (), ctx,
                     runner="qbuild.evaluate.quality:perplexity_of_a_measured_file")
    return runtime_step("perplexity", name, params, rt, art.label, art.step, inputs, (), ctx,
                 runner="qbuild.evaluate.quality:perplexity", **({"runtime_args": runtime_args} if runtime_args else {}))


# KV-cache element types that change what a model computes (f16/bf16 hold the K/V activations as the model does)
QUANTIZED_KV = ("q8_0", "q4_0", "fp8")


def kv_measured_apart(perplexity, kv_cache_dtype: str | None) -> bool:
    """Whether a serving config with this KV-cache dtype needs its own quality pass: it quantizes the KV cache, and
    not as the recipe's perplexity pass already does (else the variant's own numbers are the config's)."""
    return kv_cache_dtype in QUANTIZED_KV and kv_cache_dtype != perplexity.kv_cache_dtype


def serving_quality_step(ctx, art, config) -> Step | None:
    """The quality of served artifact `art` under serving config `config` when the config quantizes the KV cache
    other than the recipe's perplexity pass does: one more `perplexity[<artifact>@<config>]` step (the recipe's
    protocol with the config's kv_cache_dtype, flash attention on: llama.cpp quantizes V only with it, as the server
    runs), against the same reference (the baseline's f16-KV log-probs). None where the variant's own numbers are the
    config's (no or the same KV dtype, no perplexity) or the artifact's runtime cannot run that KV cache (a plan
    note says so). Steps are shared: configs with the same KV dtype read one."""
    ev = effective_evaluation(ctx)
    kv = config.kv_cache_dtype
    if not ev.perplexity or not kv_measured_apart(ev.perplexity, kv):
        return None
    rt, _ = pick_runtime(art.step.format)
    if rt is None:
        return None   # noted in ctx.not_evaluated by evaluation_steps
    if kv not in rt.kv_cache_dtypes:
        ctx.warn(f"quality of {art.label} under serving config {config.name!r} (kv_cache_dtype {kv}) not measured: "
                 f"it is evaluated by the {rt.name} runtime, which cannot run a {kv} KV cache")
        return None
    skipped = rt.cannot_measure(art.label, art.step, ev)
    if "perplexity" in skipped:
        return None
    data, reference = _quality_reference(ctx, ev)
    perplexity = ev.perplexity.model_copy(update={"kv_cache_dtype": kv, "flash_attn": True})
    return _perplexity_step(ctx, ev, perplexity, art, rt, data or ctx.eval_data(ev.perplexity),
                            None if "kld" in skipped else reference, f"perplexity[{art.label}@{config.name}]",
                            serving_kv=kv)


def effective_evaluation(ctx):
    """The recipe's evaluation with the model's own BOS convention where the recipe does not set `add_bos`
    (bos_decision); ctx.bos_decision keeps what was decided and why, for the plan and the run to state."""
    ev = ctx.recipe.evaluation
    if not ev.perplexity:
        return ev
    if getattr(ctx, "bos_decision", None) is None:   # decided once a plan: it may read the tokenizer's files
        added, why = bos_decision(ctx.model(), ev.perplexity)
        ctx.bos_decision = {"added": added, "why": why}
    added = ctx.bos_decision["added"]
    if added != ev.perplexity.add_bos:
        ev = ev.model_copy(update={"perplexity": ev.perplexity.model_copy(update={"add_bos": added})})
    return ev


def bos_decision(model: Step, perplexity) -> tuple[bool, str]:
    """(whether each window starts with BOS, why): as the recipe sets `add_bos`, else as the model's own tokenizer
    does (the same weights from a GGUF or an HF directory give the same answer), else the protocol's default, BOS,
    where the tokenizer has one. A model without a BOS token never gets one."""
    from qbuild.planning.models import model_bos

    has_bos = tokenizer_has_bos(model)
    if "add_bos" in perplexity.model_fields_set:
        if perplexity.add_bos and not has_bos:
            raise RecipeError("evaluation.perplexity.add_bos", "the model's tokenizer has no BOS token "
                              "(tokenizer_config.json: bos_token null), so no window can start with one: "
                              "set add_bos: false, or leave it out")
        return perplexity.add_bos, "evaluation.perplexity.add_bos in the recipe"
    if not has_bos:
        return False, "the model's tokenizer has no BOS token"
    adds, source = model_bos(model)
    if adds is None:
        return True, f"{source}: the protocol's default (add_bos: true)"
    return adds, f"the model's own convention ({source} is {str(adds).lower()})"


def tokenizer_has_bos(model: Step) -> bool:
    """False when an HF checkpoint's tokenizer_config.json says its tokenizer has no BOS token (`bos_token: null`,
    as Qwen's do), or when a GGUF source names no BOS token (tokenizer.ggml.bos_token_id: its import's tokenizer
    has none); True otherwise."""
    from qbuild.models.model_config import ConfigRefused, read_json_mapping

    if model.source_path is None:
        if model.kind != "import-gguf":
            return True
        from qbuild.planning.models import model_info

        return "bos_token_id" not in (info := model_info(model)) or info["bos_token_id"] is not None
    try:   # the model's file is read bounded, as every file of it is at plan time
        config = read_json_mapping(model.source_path / "tokenizer_config.json")
    except ConfigRefused:
        return True
    return "bos_token" not in config or config["bos_token"] is not None


def reference_step(ctx, perplexity, name: str = "reference[baseline]") -> tuple[Step | None, str]:
    """(the baseline's one pass with its log-probs stored, "") or (None, why it cannot be made)."""
    baseline_rt, why = pick_runtime(ctx.model().format)
    if baseline_rt is None:
        return None, why
    params = {**perplexity.canonical(), "runtime": baseline_rt.name}
    params.pop("dataset")  # identified by the eval-data input
    params.pop("kv_cache_dtype", None)   # the reference keeps the full-precision KV cache
    data = ctx.eval_data(perplexity)
    return runtime_step("reference", name, params, baseline_rt, "baseline", ctx.model(), {"model": ctx.model(), "data": data},
                 (), ctx, runner="qbuild.evaluate.quality:reference", format="logprobs"), ""


def kld_step(ctx, label: str, artifact: Step, max_windows: int | None) -> Step:
    """A `perplexity[label]` step of an intermediate model (a method's own measurement, e.g. a search's): its PPL,
    KLD and top-1 against the baseline's stored log-probs, on the recipe's evaluation text, on its first
    `max_windows` windows (None: the recipe's). Shares the recipe's reference where the windows are the same."""
    params, inputs, rt = kld_measurement(ctx, label, artifact.format, max_windows)
    return runtime_step("perplexity", f"perplexity[{label}]", params, rt, label, artifact,
                        {"model": artifact, **inputs}, (), ctx, runner="qbuild.evaluate.quality:perplexity")


def kld_measurement(ctx, label: str, fmt: str, max_windows: int | None) -> tuple[dict, dict[str, Step], Runtime]:
    """What kld_step measures a `fmt` model with: (the perplexity params, its inputs but the model: data, reference
    and a llama-perplexity base file, the runtime)."""
    ev = effective_evaluation(ctx)
    perplexity = ev.perplexity
    name = "reference[baseline]"
    if max_windows is not None and max_windows != perplexity.max_windows:
        perplexity = perplexity.model_copy(update={"max_windows": max_windows})
        name = f"reference[baseline~{max_windows}w]"
    if ev.kld_base:   # a llama-perplexity base file is the reference: its tokens are the windows
        ev = ev.model_copy(update={"perplexity": perplexity})
        reference, why = _kld_base_reference(ctx, ev, ctx.eval_data(perplexity), name), ""
    else:
        reference, why = reference_step(ctx, perplexity, name)
    rt, why_not = pick_runtime(fmt)
    if reference is None or rt is None:
        raise RecipeError("evaluation.kld", f"{label} cannot be measured: {why or why_not}")
    params = {**perplexity.canonical(), "runtime": rt.name}
    params.pop("dataset")
    inputs = {"data": reference.inputs["data"], "reference": reference}
    if ev.kld_base:
        inputs["kld_base"] = reference.inputs["kld_base"]
    return params, inputs, rt


def probe_step(ctx, kind: str, name: str, label: str, source: Step, build: dict, inputs: dict[str, Step],
               max_windows: int | None, tools: tuple[str, ...], *, runner: str, scratch: float = 1.0,
               at_once: tuple[str, int] | None = None) -> Step:
    """A probe: one step that builds a model of `source`'s format from `inputs` under the params `build`, in its own
    scratch (never stored), and measures it as kld_step would measure that model stored (same params, data and
    reference; `params.measure`); it stores the measurement only. A search's sensitivity points and candidates are
    probes (qbuild.quantize.gguf.probe), so their files never reach the store. `scratch`: the probe file's size as
    a share of `source`'s (at most; the executor holds that much disk for it while it runs); `at_once`: (group, n),
    at most n probes of the group at once."""
    measure, measured_inputs, rt = kld_measurement(ctx, label, source.format, max_windows)
    return runtime_step(kind, name, {"build": build, "measure": measure}, rt, label, source,
                        {**inputs, **measured_inputs}, tools, ctx, runner=runner, scratch=scratch,
                        at_once=at_once)


def load_check_runtimes(ctx, check, fmt: str) -> list[Runtime]:
    """The installed runtimes a load check of a `fmt` artifact uses: those named in `runtimes` (in that order) that
    read it, else every installed one that reads it."""
    from qbuild.contract.plugin import runtimes

    if check.runtimes is None:
        return [rt for rt in runtimes_for(fmt) if not rt.missing()]
    chosen = []
    for i, name in enumerate(check.runtimes):
        if name not in runtimes:
            raise RecipeError(f"evaluation.load_check.runtimes[{i}]",
                              f"{name!r} is not a runtime; known runtimes: {', '.join(runtimes.names())}")
        rt = runtimes.get(name)
        if rt in runtimes_for(fmt):
            if rt.missing():
                ctx.warn(f"load check: runtime {name} is not installed (pip install 'qbuild[{rt.extra}]'); "
                         f"{fmt} artifacts are not loaded with it")
            else:
                chosen.append(rt)
    return chosen


def load_check_steps(ctx, check) -> None:
    """A `load-check[<artifact>]` step per model artifact and runtime (`[<artifact>@<runtime>]` when several):
    greedy generation from one tokenized prompt; every check but the baseline's first reads the baseline's check
    (`reference`, the same runtime's where there is one) and counts the leading tokens that agree."""
    prompt = ctx.add(Step("load-check-prompt", "load-check-prompt", {"prompt": check.prompt, "add_special_tokens": True},
                          "qbuild.evaluate.loadcheck:prompt", inputs={"tokenizer": ctx.model()},
                          tools=TOKENIZE_TOOLS, threads=1, format="tokens", preload=HF_PRELOAD))
    baseline_checks: dict[str, Step] = {}
    for art in ctx.artifacts:
        if not spec(art.step.format).model:
            continue
        found = [rt for rt in load_check_runtimes(ctx, check, art.step.format)
                 if "load-check" not in rt.cannot_measure(art.label, art.step, ctx.recipe.evaluation)]
        if not found:
            ctx.warn(f"load check: no installed runtime{' of evaluation.load_check.runtimes' if check.runtimes else ''}"
                     f" reads {art.step.format}; {art.label} is not loaded")
            continue
        for rt in found:
            name = f"load-check[{art.label}@{rt.name}]" if len(found) > 1 else f"load-check[{art.label}]"
            inputs = {"model": art.step, "prompt": prompt}
            reference = baseline_checks.get(rt.name) or next(iter(baseline_checks.values()), None)
            if reference is not None:
                inputs["reference"] = reference
            step = runtime_step("load-check", name, {"tokens": check.tokens, "runtime": rt.name}, rt, art.label, art.step,
                         inputs, TOKENIZE_TOOLS, ctx, runner="qbuild.evaluate.loadcheck:run", runtime_args={"label": art.label})
            if art.baseline:
                baseline_checks.setdefault(rt.name, step)


def _kld_base_reference(ctx, ev, data: Step, name: str = "reference[baseline]") -> Step:
    """A user's llama-perplexity KL-divergence base file as the reference: a source (fingerprinted, never built),
    and a `reference[baseline]` step that reads the baseline's PPL off it (no model runs)."""
    from qbuild.base.fingerprint import dir_fingerprint
    from qbuild.base.hashing import sha256_text
    from qbuild.evaluate.llamacpp_kld import read_kld_base
    from qbuild.planning.models import resolve_path

    path = resolve_path(ev.kld_base, ctx.recipe_dir, "evaluation.kld_base")
    try:
        base = read_kld_base(path)
    except (OSError, ValueError) as exc:
        raise RecipeError("evaluation.kld_base", str(exc)) from None
    if base.n_ctx != ev.perplexity.context_length:
        raise RecipeError("evaluation.perplexity.context_length",
                          f"{ev.perplexity.context_length}, but {path.name} was made with -c {base.n_ctx}")
    src = ctx.add(Step("kld-base", "kld-base", {"source": "llama-perplexity"}, None, source_path=path,
                       source_digest=sha256_text("kld-base:" + dir_fingerprint(path)), format="logprobs"))
    params = {**ev.perplexity.canonical(), "runtime": "llama-perplexity-file"}
    params.pop("dataset")
    return ctx.add(Step("reference", name, params, "qbuild.evaluate.quality:reference_from_kld_base",
                        inputs={"model": ctx.model(), "kld_base": src, "data": data}, threads=1, format="logprobs"))
