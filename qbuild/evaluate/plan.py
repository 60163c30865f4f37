"""Plan-time side of evaluation: quality and speed steps per artifact, runtime chosen by its format."""

from __future__ import annotations

from qbuild.step import Step

# artifact format → (runtime class in runtimes.py, distributions it uses: they enter evaluation keys)
RUNTIMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "hf": ("qbuild.evaluate.runtimes:TransformersRuntime", ("torch", "transformers")),
    "gguf": ("qbuild.evaluate.runtimes:LlamaCppRuntime", ("llama-cpp-python",)),
}


def _runtime(artifact: Step) -> tuple[str, tuple[str, ...]] | None:
    if artifact.format not in RUNTIMES:
        return None
    return artifact.format, RUNTIMES[artifact.format][1] + tuple(getattr(artifact, "eval_tools", ()))


def perplexity_step(label: str, artifact: Step, data: Step, perplexity, ctx) -> Step | None:
    rt = _runtime(artifact)
    if rt is None:
        return None
    params = {**perplexity.canonical(), "runtime": rt[0]}
    params.pop("dataset")  # identified by the eval-data input
    return ctx.add(Step("perplexity", f"perplexity[{label}]", params, "qbuild.evaluate.quality:perplexity",
                        inputs={"model": artifact, "data": data}, tools=rt[1], threads=ctx.threads, format="metrics"))


def divergence_step(label: str, artifact: Step, baseline: Step, data: Step, perplexity, ctx) -> Step | None:
    rt, base_rt = _runtime(artifact), _runtime(baseline)
    if rt is None or base_rt is None:
        return None
    params = {**perplexity.canonical(), "runtime": rt[0], "baseline_runtime": base_rt[0]}
    params.pop("dataset")
    return ctx.add(Step("divergence", f"kld[{label}]", params, "qbuild.evaluate.quality:divergence",
                        inputs={"model": artifact, "baseline": baseline, "data": data},
                        tools=tuple(sorted(set(rt[1] + base_rt[1]))), threads=ctx.threads, format="metrics"))


def throughput_step(label: str, artifact: Step, throughput, ctx) -> Step | None:
    rt = _runtime(artifact)
    if rt is None:
        return None
    params = {**throughput.canonical(), "runtime": rt[0], "device": ctx.device}
    # timings belong to a machine: the hardware is part of the key, so another machine never hits
    return ctx.add(Step("throughput", f"throughput[{label}]", params, "qbuild.evaluate.throughput:run",
                        inputs={"model": artifact}, tools=rt[1], threads=ctx.threads, per_hardware=True,
                        format="metrics"))


def evaluation_steps(recipe, ctx, variant_steps: dict[str, Step]) -> None:
    ev = recipe.evaluation
    artifacts = ({"baseline": ctx.model()} if ev.baseline else {}) | variant_steps
    data = ctx.eval_data(ev.perplexity) if ev.perplexity else None
    for label, artifact in artifacts.items():
        if ev.perplexity:
            perplexity_step(label, artifact, data, ev.perplexity, ctx)
            if ev.kld and label != "baseline":
                divergence_step(label, artifact, ctx.model(), data, ev.perplexity, ctx)
        if ev.throughput:
            throughput_step(label, artifact, ev.throughput, ctx)
