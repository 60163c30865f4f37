"""Plan-time side of evaluation: one perplexity step per (artifact, protocol), runtime chosen by format."""

from __future__ import annotations

from qbuild.step import Step

# format → (runner, distributions the runtime uses)
RUNTIMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "hf": ("qbuild.evaluate.hf:perplexity", ("torch", "transformers")),
    "gguf": ("qbuild.evaluate.llamacpp:perplexity", ("llama-cpp-python",)),
}


def perplexity_step(label: str, artifact: Step, data: Step, perplexity, ctx, extra_tools: tuple[str, ...] = ()) -> Step | None:
    if artifact.format not in RUNTIMES:
        return None
    runner, tools = RUNTIMES[artifact.format]
    params = {**perplexity.canonical(), "runtime": artifact.format}
    params.pop("dataset")  # identified by the eval-data input
    return ctx.add(Step("perplexity", f"perplexity[{label}]", params, runner,
                        inputs={"model": artifact, "data": data}, tools=tools + extra_tools,
                        threads=ctx.threads, format="metrics"))


def evaluation_steps(recipe, ctx, variant_steps: dict[str, Step]) -> dict[str, Step]:
    ev = recipe.evaluation
    out: dict[str, Step] = {}
    if ev.perplexity is None:
        return out
    data = ctx.eval_data(ev.perplexity)
    if ev.baseline:
        out["baseline"] = perplexity_step("baseline", ctx.model(), data, ev.perplexity, ctx)
    for name, step in variant_steps.items():
        s = perplexity_step(name, step, data, ev.perplexity, ctx, getattr(step, "eval_tools", ()))
        if s is not None:
            out[name] = s
    return out
