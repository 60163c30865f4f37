"""Plan-time side of evaluation: perplexity, KLD and throughput steps per model artifact.

The runtime is chosen by the artifact's format (qbuild.plugins.runtimes_for). An artifact no
installed runtime can evaluate is recorded in ctx.not_evaluated, which `qbuild plan` and the run
summary show: nothing is dropped silently.
"""

from __future__ import annotations

import logging

from qbuild.formats import spec
from qbuild.plugins import Runtime, runtimes_for
from qbuild.step import Step

log = logging.getLogger("qbuild")

RUNNERS = {"perplexity": "qbuild.evaluate.quality:perplexity", "divergence": "qbuild.evaluate.quality:divergence",
           "throughput": "qbuild.evaluate.throughput:run"}


def pick_runtime(fmt: str) -> tuple[Runtime | None, str]:
    """(the runtime that evaluates `fmt`, "") or (None, why none can)."""
    found = runtimes_for(fmt)
    if not found:
        return None, f"no runtime for {fmt}"
    if found[0].missing():
        rt = found[0]
        return None, f"runtime {rt.name} for {fmt} is not installed (pip install 'qbuild[{rt.extra}]')"
    return found[0], ""


def _step(kind: str, name: str, params: dict, runtime: Runtime, label: str, artifact: Step, inputs: dict, tools,
          ctx, **kw) -> Step:
    fields = runtime.plan_fields(label, artifact, ctx, kind)
    extra_inputs = fields.pop("extra_inputs", {})
    tools = tuple(sorted(set(tools) | set(runtime.tools) | set(spec(artifact.format).load_tools)))
    return ctx.add(Step(kind, name, params, RUNNERS[kind], inputs={**inputs, **extra_inputs}, tools=tools,
                        threads=ctx.threads, format="metrics", **fields, **kw))


def evaluation_steps(ctx) -> None:
    """Add the evaluation steps of every model artifact in ctx.artifacts (baseline, variants, target outputs)."""
    ev = ctx.recipe.evaluation
    if not (ev.perplexity or ev.throughput):
        return
    data = None  # the tokenized evaluation text, planned on first use: no step builds data that nothing reads
    baseline_rt = None
    if ev.kld:
        baseline_rt, why = pick_runtime(ctx.model().format)
        if baseline_rt is None:
            ctx.note_not_evaluated("baseline", f"KLD needs the baseline's logits: {why}")
    for art in ctx.artifacts:
        if not spec(art.step.format).model:
            continue
        rt, why = pick_runtime(art.step.format)
        if rt is None:
            ctx.note_not_evaluated(art.label, why)
            continue
        skipped = rt.cannot_measure(art.label, art.step, ev)
        for reason in dict.fromkeys(skipped.values()):
            ctx.warn(reason)
        if ev.perplexity and "perplexity" not in skipped:
            params = {**ev.perplexity.canonical(), "runtime": rt.name}
            params.pop("dataset")  # identified by the eval-data input
            data = data or ctx.eval_data(ev.perplexity)
            _step("perplexity", f"perplexity[{art.label}]", params, rt, art.label, art.step,
                  {"model": art.step, "data": data}, (), ctx)
            if ev.kld and not art.baseline and baseline_rt is not None and "kld" not in skipped:
                _step("divergence", f"kld[{art.label}]", {**params, "baseline_runtime": baseline_rt.name}, rt,
                      art.label, art.step, {"model": art.step, "baseline": ctx.model(), "data": data},
                      baseline_rt.tools + spec(ctx.model().format).load_tools, ctx)
        if ev.throughput and "throughput" not in skipped:
            params = {**ev.throughput.canonical(), "runtime": rt.name, "device": ctx.device}
            # timings belong to a machine: the hardware is part of the key, so another machine never hits
            _step("throughput", f"throughput[{art.label}]", params, rt, art.label, art.step, {"model": art.step}, (),
                  ctx, per_hardware=True)
