"""Plan-time side of serving: a `serving[<artifact>@<config>]` step per served artifact and serving config.

The server is chosen by what loads the artifact (qbuild.contract.formats.loads_in → the `Server` plugins of those engines):
the first one this machine can run, else the first one (planned `needs-gpu` / `unavailable` and skipped, so a
CPU machine still builds and serves the rest). A serving config a server cannot express is refused here, in one
line. The step's key holds the workload, the config, the server's flags, the server's version and build, and the
hardware (it is a timing step: it runs alone). A config that quantizes the KV cache (llama.cpp q8_0/q4_0) also gets
the artifact's quality under that cache (qbuild.planning.evaluation.serving_quality_step), shown beside its serving numbers.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from qbuild.base.errors import RecipeError
from qbuild.contract.formats import loads_in, spec
from qbuild.contract.plugin import Server, servers
from qbuild.contract.step import OnUnavailable, Step
from qbuild.planning.evaluation import serving_quality_step
from qbuild.planning.recipe import longest

CAPACITY_IMPL_VERSION = 4   # 2: probes record the server's throughput while full (a rate above it misses); 3: with
# its interval, and rounds added while it is within noise of the rate; 4: a request past timeout_s in all (not per
# read) fails, and a malformed or oversized answer is one failed request (it failed the step)
IMPL_VERSION = 3   # 2: KV-cache bytes per token from the model's shape (llama.cpp's log line counts per stream)
# 3: a point's warm-up requests lead into the measured ones without a pause (it was measured from an idle server)
WORKLOAD_FIELDS = ("concurrency", "request_rates", "requests", "warmup", "input_len", "output_len", "seed", "timeout_s")


def server_for(fmt: str, scheme: str | None, engine: str | None) -> tuple[Server | None, str]:
    """(the server that serves an artifact of fmt/scheme, "") or (None, why none does)."""
    engines = loads_in(fmt, scheme)
    known = [s for e in engines for s in servers.all() if s.engine == e]
    if engine is not None:
        if engine not in servers:
            raise RecipeError("evaluation.serving.engine",
                              f"{engine!r} is not a server; known servers: {', '.join(servers.names())}")
        known = [s for s in known if s.name == engine]
        if not known:
            return None, f"{engine} does not load {fmt}{' ' + scheme if scheme else ''}"
    if not known:
        return None, f"no server loads {fmt}{' ' + scheme if scheme else ''}"
    refused = {s.name: s.cannot_serve(fmt, scheme) for s in known}
    known = [s for s in known if not refused[s.name]]
    if not known:
        return None, "; ".join(why for why in refused.values() if why)
    return next((s for s in known if not s.unavailable()), known[0]), ""


def wanted(serving, label: str) -> bool:
    return serving.variants == "all" or label in serving.variants or label.split(".")[0] in serving.variants


def serving_steps(ctx) -> None:
    serving = ctx.recipe.evaluation.serving
    if serving is None:
        return
    data = None
    context = request_context(serving)
    slots = max(serving.concurrency)
    trace = _trace(serving, ctx.recipe_dir)
    if trace is not None:   # room for the trace's longest request too
        context = max(context, serving.prefix_tokens + trace["longest"] + 8)
    for art in ctx.artifacts:
        if not spec(art.step.format).model or not wanted(serving, art.label):
            continue
        server, why = server_for(art.step.format, art.step.scheme or None, serving.engine)
        if server is None:
            ctx.warn(f"not served: {art.label}: {why}")
            continue
        caveat = server.caveat(art.step.format, art.step.scheme or None)
        if caveat:
            ctx.warn(f"{art.label} served by {server.name}: {caveat}")
        unavailable = server.unavailable()
        workload = serving.model_dump(include=set(WORKLOAD_FIELDS))   # a length range as {min, max}
        if serving.rampup_s:   # left out at its default, like other new switches
            workload["rampup_s"] = serving.rampup_s
        if serving.prefix_tokens:
            workload["prefix_tokens"] = serving.prefix_tokens
        if serving.conversation is not None:
            workload["conversation"] = serving.conversation.model_dump()
        if serving.rounds != 1:   # left out at 1: one round is what was measured before rounds existed
            workload["rounds"] = serving.rounds
        if trace is not None:   # identified by its contents; the runner reads the file
            workload["trace"] = {"sha256": trace["sha256"], "requests": len(trace["requests"])}
        for i, config in enumerate(serving.configs):
            refusal = server.refusal(config)
            if refusal:
                raise RecipeError(f"evaluation.serving.configs[{i}]",
                                  f"config {config.name!r} cannot be served by {server.name} (variant {art.label!r}): "
                                  f"{refusal} (evaluation.serving.variants picks what is served)")
            if data is None:
                data = prompts_step(ctx, serving)
            # a quantized KV cache's quality cost, beside its serving numbers; the served check expects it
            under_config = serving_quality_step(ctx, art, config)
            checked = {**served_check_inputs(ctx, art.label, under_config),
                       **draft_input(ctx, server, art, config, f"evaluation.serving.configs[{i}].draft")}
            threads = ctx.threads
            args = server.args(config, threads=threads, slots=slots, context=context)
            params = {"workload": workload, "config": config.canonical(), "server": server.name,
                      "engine": server.engine, "server_args": args, "context": context, "slots": slots}
            ctx.add(Step("serving", f"serving[{art.label}@{config.name}]", params, "qbuild.serving.bench_step:run",
                         inputs={"model": art.step, "prompts": data, **checked}, tools=tuple(sorted(server.tools)),
                         threads=threads, per_hardware=True, env_toolchain=server.environment(),
                         requires_gpu=server.needs_gpu, unavailable=unavailable, on_unavailable=OnUnavailable.SKIP,
                         format="metrics", impl_version=IMPL_VERSION,
                         runtime_args={"label": art.label, "ready_timeout_s": serving.ready_timeout_s,
                                       **({"trace_path": str(trace["path"])} if trace else {})}))
            if serving.capacity is not None:
                capacity_step(ctx, serving, art, config, server, data, params, unavailable, checked)


def request_context(serving) -> int:
    """Context tokens per request (with conversations: its last turn, every earlier input and output resent), with
    room for BOS/templates and, per turn, for an output that tokenizes back to a few more tokens than were generated."""
    turns = serving.conversation.turns if serving.conversation else 1
    return serving.prefix_tokens + turns * (longest(serving.input_len) + longest(serving.output_len) + 8)


def prompts_step(ctx, serving) -> Step:
    """The evaluation corpus, tokenized whole: prompts are windows of it."""
    from qbuild.planning.calibration import eval_data_step

    return ctx.add(replace(eval_data_step(SimpleNamespace(
        dataset=serving.dataset, context_length=longest(serving.input_len), max_windows=None, add_bos=False),
        ctx.model(), ctx), name="serving-prompts"))


def draft_input(ctx, server: Server, art, config, field: str) -> dict[str, Step]:
    """{"draft": the artifact config.draft names} for a speculative config ({} without one); refused in one line
    where it is the served artifact itself or another server would serve it."""
    if config.draft is None:
        return {}
    found = {a.label: a for a in ctx.artifacts}.get(config.draft)
    if found is None:
        raise RecipeError(field, f"{config.draft!r} is not an artifact of this recipe")
    if found.label == art.label:
        raise RecipeError(field, f"{art.label} cannot be its own draft")
    draft_server, why = server_for(found.step.format, found.step.scheme or None, server.name)
    if draft_server is None or draft_server.name != server.name:
        raise RecipeError(field, f"draft {config.draft!r} cannot be loaded by {server.name}: {why}")
    return {"draft": found.step}


def served_check_inputs(ctx, label: str, under_config: Step | None) -> dict[str, Step]:
    """What the served check (qbuild.serving.served_check) compares a served artifact with: the baseline's stored
    log-probs (`reference[baseline]` and its evaluation text) and the artifact's own offline KLD: under the serving
    config's KV cache where that is measured apart (`under_config`), else `perplexity[<label>]` (the baseline needs
    none). Empty, with a note, where the recipe measures no KLD: the server is then not checked."""
    steps = {s.name: s for s in ctx.steps}
    reference = steps.get("reference[baseline]")
    measured = under_config if under_config is not None else steps.get(f"perplexity[{label}]")
    if reference is None or reference.runner != "qbuild.evaluate.quality:reference" or (
            label != "baseline" and (measured is None or getattr(measured.inputs.get("reference"), "key", None) != reference.key)):
        ctx.warn(f"{label} is served unchecked: the served check compares the server with the offline KLD "
                 "(evaluation.kld: true, evaluation.baseline: true)")
        return {}
    found = {"reference": reference, "reference_data": reference.inputs["data"]}
    if label != "baseline" or under_config is not None:
        found["divergence"] = measured
    return found


def _trace(serving, recipe_dir) -> dict | None:
    """The recipe's trace, read and checked at plan time: its path, digest, requests and longest request (tokens)."""
    if serving.trace is None:
        return None
    from qbuild.planning.models import resolve_path
    from qbuild.serving.trace import TraceError, read_trace, trace_digest

    path = resolve_path(serving.trace, recipe_dir, "evaluation.serving.trace")
    try:
        requests = read_trace(path)
    except TraceError as exc:
        raise RecipeError("evaluation.serving.trace", str(exc)) from None
    longest_request = max(r.get("input_len", 0) + r["output_len"] for r in requests)
    return {"path": path, "sha256": trace_digest(path), "requests": requests, "longest": longest_request}


def capacity_step(ctx, serving, art, config, server: Server, data: Step, serving_params: dict, unavailable: str,
                  checked: dict[str, Step]) -> Step:
    """`capacity[<artifact>@<config>]`: the capacity search (qbuild.serving.capacity_step) on the serving step's server,
    flags and prompts. Its probes are identified by everything but the SLOs and the budget (`probe_family`, the key
    a step of those alone would have), so a search under another SLO finds the ones it can reuse."""
    cap = serving.capacity
    probes, common, family = probe_family(ctx, serving, art, server, data, serving_params, checked, cap.requests,
                                          cap.rounds)
    search = {"slo": cap.slo.bounds(), "max_minutes": cap.max_minutes, "max_error_pct": cap.max_error_pct,
              "start_rps": cap.start_rps}
    return ctx.add(Step("capacity", f"capacity[{art.label}@{config.name}]", {**probes, "capacity": search},
                        "qbuild.serving.capacity_step:run", **common, requires_gpu=server.needs_gpu, unavailable=unavailable,
                        on_unavailable=OnUnavailable.SKIP, format="metrics",
                        runtime_args={"label": art.label, "ready_timeout_s": serving.ready_timeout_s,
                                      "probe_family": family}))


def probe_family(ctx, serving, art, server: Server, data: Step, serving_params: dict, inputs: dict[str, Step],
                 requests: int, rounds: int) -> tuple[dict, dict, str]:
    """What a capacity probe of an artifact's server measures (its params), the step fields every search of it
    shares (`common`), and the probes' family: the key a step of those alone would have (the probe cache's folder;
    the deployment search shares it with the capacity steps)."""
    workload = {**serving.model_dump(include={"input_len", "output_len", "seed", "timeout_s", "warmup",
                                               "prefix_tokens"}),
                "requests": requests, "rounds": rounds}
    if serving.conversation is not None:   # left out when off: searches without one keep their keys and probes
        workload["conversation"] = serving.conversation.model_dump()
    probes = {k: serving_params[k] for k in ("config", "server", "engine", "server_args", "context", "slots")}
    probes["workload"] = workload
    common = dict(inputs={"model": art.step, "prompts": data, **inputs}, tools=tuple(sorted(server.tools)),
                  threads=ctx.threads, per_hardware=True, env_toolchain=server.environment(),
                  impl_version=CAPACITY_IMPL_VERSION)
    return probes, common, Step("capacity-probes", "capacity-probes", probes, None, **common).key
