"""Plan-time side of the deployment search (the recipe's `deploy:`): one candidate per combination of the space's
levers (weights × KV cache × slots × threads × batch sizes × prefix cache × speculative draft), each screened by a
`deploy-screen[<artifact>@<candidate>]` step (the serving step's runner, one short closed-loop point at the
candidate's full batch: its throughput there, its latencies and its server's peak RSS), then one `deploy` step
(qbuild.serving.deploy_step; its rules in qbuild.serving.deploy_search) that reads every screen and the quality
of every (weights, KV cache), and runs the capacity search on the candidates that can still win.

Every screen is a stored step keyed by the server's flags, the workload and the hardware, so a rerun measures
nothing and a widened space screens only its new candidates; the capacity probes are kept in the same per-user
cache as the capacity steps', under the same family, so either reuses the other's.
"""

from __future__ import annotations

import itertools

from qbuild.base.errors import RecipeError
from qbuild.contract.formats import spec
from qbuild.contract.step import OnUnavailable, Step
from qbuild.planning.evaluation import serving_quality_step
from qbuild.planning.recipe import ServingConfig
from qbuild.planning.serving import (
    IMPL_VERSION,
    draft_input,
    probe_family,
    prompts_step,
    request_context,
    served_check_inputs,
    server_for,
    wanted,
)

DEPLOY_IMPL_VERSION = 3   # 2: the front pass prunes within memory/KLD noise (deploy_search.FRONT_*); 3: strategy
# challenge (the default), and the strategy always in the params
# a candidate's name: the levers it sets, in this order, with these prefixes (kv-q8_0.p4.t2.b256.ub64.pc.d-q4km)
LEVER_NAMES = (("kv_cache_dtype", "kv-"), ("parallel", "p"), ("threads", "t"), ("batch_size", "b"),
               ("ubatch_size", "ub"), ("prefix_caching", "pc"), ("draft", "d-"))


def candidate_name(config: dict) -> str:
    parts = []
    for field, prefix in LEVER_NAMES:
        value = config.get(field)
        if value is None:
            continue
        parts.append(("pc" if value else "nopc") if field == "prefix_caching" else f"{prefix}{value}")
    return ".".join(parts) or "default"


def candidates(space, labels: list[str]) -> list[tuple[str, ServingConfig]]:
    """(artifact label, serving config) of every combination of the space's levers; a variant never drafts for
    itself."""
    out = []
    for label, kv, parallel, threads, batch, ubatch, prefix, draft in itertools.product(
            labels, space.kv_cache_dtype, space.parallel, space.threads, space.batch_size, space.ubatch_size,
            space.prefix_caching, space.draft):
        if draft == label:
            continue
        levers = {"kv_cache_dtype": kv, "parallel": parallel, "threads": threads, "batch_size": batch,
                  "ubatch_size": ubatch, "prefix_caching": prefix, "draft": draft}
        out.append((label, ServingConfig(name=candidate_name(levers), **levers,
                                         draft_max=space.draft_max if draft else None)))
    return out


def deploy_steps(ctx) -> Step | None:
    d = ctx.recipe.deploy
    if d is None:
        return None
    serving = ctx.recipe.evaluation.serving
    if serving.trace is not None:
        raise RecipeError("deploy", "the deployment search measures evaluation.serving's generated workload; a trace "
                          "is replayed by the serving steps only (remove evaluation.serving.trace or deploy:)")
    by_label = {a.label: a for a in ctx.artifacts}
    if d.space.variants == "all":
        labels = [a.label for a in ctx.artifacts
                  if not a.baseline and spec(a.step.format).model and wanted(serving, a.label)]
    else:
        labels = list(d.space.variants)
    context = request_context(serving)
    data = prompts_step(ctx, serving)
    steps = {s.name: s for s in ctx.steps}
    inputs: dict[str, Step] = {"prompts": data}
    baseline_quality = steps.get("perplexity[baseline]")
    if baseline_quality is not None:
        inputs["quality-baseline"] = baseline_quality
    listed, unavailable_any, first_server, probes = [], "", None, {}
    for i, (label, config) in enumerate(candidates(d.space, labels)):
        art = by_label[label]
        server, why = server_for(art.step.format, art.step.scheme or None, serving.engine)
        if server is None:
            raise RecipeError("deploy.space.variants", f"{label} cannot be served: {why}")
        refusal = server.refusal(config)
        if refusal:
            raise RecipeError("deploy.space", f"candidate {config.name!r} of {label} cannot be served by "
                              f"{server.name}: {refusal}")
        under_config = serving_quality_step(ctx, art, config)   # a quantized KV cache's own KLD
        quality = under_config or steps.get(f"perplexity[{label}]")
        checked = {**served_check_inputs(ctx, label, under_config),
                   **draft_input(ctx, server, art, config, "deploy.space.draft")}
        slots = config.parallel
        args = server.args(config, threads=ctx.threads, slots=slots, context=context)
        serving_params = {"config": config.canonical(), "server": server.name, "engine": server.engine,
                          "server_args": args, "context": context, "slots": slots}
        # the screen: one closed-loop point at the candidate's full batch, after one warm-up request per slot
        workload = {**serving.model_dump(include={"input_len", "output_len", "seed", "timeout_s"}),
                    "concurrency": [slots], "request_rates": None, "requests": d.screen_requests, "warmup": slots}
        if serving.prefix_tokens:
            workload["prefix_tokens"] = serving.prefix_tokens
        if serving.conversation is not None:
            workload["conversation"] = serving.conversation.model_dump()
        unavailable = server.unavailable()
        unavailable_any = unavailable_any or unavailable
        screen = ctx.add(Step(
            "serving", f"deploy-screen[{label}@{config.name}]", {"workload": workload, **serving_params},
            "qbuild.serving.bench_step:run", inputs={"model": art.step, "prompts": data, **checked},
            tools=tuple(sorted(server.tools)), threads=ctx.threads, per_hardware=True,
            env_toolchain=server.environment(), requires_gpu=server.needs_gpu, unavailable=unavailable,
            on_unavailable=OnUnavailable.SKIP, format="metrics", impl_version=IMPL_VERSION,
            runtime_args={"label": f"{label}@{config.name}", "ready_timeout_s": serving.ready_timeout_s}))
        probes, _, family = probe_family(ctx, serving, art, server, data, serving_params, checked, d.requests,
                                         d.rounds)
        first_server = first_server or server
        inputs[f"screen-{i}"] = screen
        inputs[f"model-{label}"] = art.step
        if "draft" in checked:
            inputs[f"model-{config.draft}"] = checked["draft"]
        if quality is not None:
            inputs[f"quality-{i}"] = quality
        listed.append({"label": label, **serving_params, "draft": config.draft, "family": family,
                       "screen": f"screen-{i}", "quality": f"quality-{i}" if quality is not None else None})
    if not listed:
        raise RecipeError("deploy.space.variants", "no artifact to deploy: the space names none that is served")
    params = {"candidates": listed, "slo": d.slo.bounds(),
              "bounds": {k: getattr(d, k) for k in ("max_memory_mb", "max_kld", "max_delta_ppl_pct")},
              "target_rps": d.target_rps, "max_searched": d.max_searched,
              "strategy": d.strategy,
              **({} if d.front else {"front": False}), "max_minutes": d.max_minutes,
              "max_error_pct": d.max_error_pct, "workload": probes["workload"]}   # every capacity probe's
    return ctx.add(Step("deploy", "deploy", params, "qbuild.serving.deploy_step:run", inputs=inputs,
                        tools=tuple(sorted(first_server.tools)), threads=ctx.threads, per_hardware=True,
                        env_toolchain=first_server.environment(), requires_gpu=first_server.needs_gpu,
                        unavailable=unavailable_any, on_unavailable=OnUnavailable.SKIP, format="metrics",
                        impl_version=DEPLOY_IMPL_VERSION,
                        runtime_args={"ready_timeout_s": serving.ready_timeout_s}))
