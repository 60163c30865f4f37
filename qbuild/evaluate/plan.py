"""Plan-time side of evaluation: quality and speed steps per artifact, runtime chosen by its format."""

from __future__ import annotations

import logging

from qbuild.build import tensorrt_llm as trt
from qbuild.build import trtllm_env
from qbuild.errors import RecipeError
from qbuild.step import Step

log = logging.getLogger("qbuild")

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
    if rt[0] == "gguf" and any(bs != 1 for bs in throughput.batch_sizes):
        raise RecipeError("evaluation.throughput.batch_sizes",
                          f"variant {label!r} is GGUF, and the llama.cpp runtime measures batch size 1 only "
                          f"(got {throughput.batch_sizes})")
    params = {**throughput.canonical(), "runtime": rt[0], "device": ctx.device}
    # timings belong to a machine: the hardware is part of the key, so another machine never hits
    return ctx.add(Step("throughput", f"throughput[{label}]", params, "qbuild.evaluate.throughput:run",
                        inputs={"model": artifact}, tools=rt[1], threads=ctx.threads, per_hardware=True,
                        format="metrics"))


# --- TensorRT-LLM engines: run in the TensorRT-LLM interpreter, on a GPU (qbuild/evaluate/trtllm.py) -----
ENGINE_RUNTIME = "tensorrt-llm"
ENGINE_RUNNERS = {"perplexity": "qbuild.evaluate.trtllm:perplexity", "divergence": "qbuild.evaluate.trtllm:divergence",
                  "throughput": "qbuild.evaluate.trtllm:throughput"}


def _engine_checks(label: str, engine: Step, ev) -> list[str]:
    """Evaluation settings the engine cannot serve: RecipeError. Returns what to leave out, with why."""
    s, skipped = engine.params, []
    if ev.perplexity:
        if not s.get("gather_context_logits"):
            skipped.append(f"engine {label!r}: no perplexity/KLD, it is built without gather_context_logits "
                           f"(set gather_context_logits: true on the target to measure them; it changes the engine key)")
        else:
            n = ev.perplexity.context_length
            if n > s["max_input_len"] or n + 1 > s["max_seq_len"] or n > s["max_num_tokens"]:
                raise RecipeError("evaluation.perplexity.context_length",
                                  f"{n} does not fit engine {label!r} (max_input_len {s['max_input_len']}, max_seq_len "
                                  f"{s['max_seq_len']} ≥ context_length + 1, max_num_tokens {s['max_num_tokens']})")
    if ev.throughput:
        t = ev.throughput
        if t.input_len > s["max_input_len"] or t.input_len + t.output_len > s["max_seq_len"]:
            raise RecipeError("evaluation.throughput.input_len",
                              f"input_len {t.input_len} + output_len {t.output_len} does not fit engine {label!r} "
                              f"(max_input_len {s['max_input_len']}, max_seq_len {s['max_seq_len']})")
        if max(t.batch_sizes) > s["max_batch_size"]:
            raise RecipeError("evaluation.throughput.batch_sizes",
                              f"{t.batch_sizes} exceeds engine {label!r}'s max_batch_size {s['max_batch_size']}")
    return skipped


def engine_evaluation_steps(label: str, engine: Step, data: Step | None, ev, ctx) -> None:
    """Perplexity, KLD and throughput of one engine, each keyed like the engine (SM + TensorRT-LLM env) and
    available exactly where the engine is (needs-gpu / on_missing_gpu copied from it)."""
    for warning in _engine_checks(label, engine, ev):
        ctx.warnings.append(warning)
        log.warning(warning)
    source = ctx.model()  # its HF config + tokenizer: the LLM API and trtllm-bench read them, the engine has neither
    if ev.perplexity and engine.params.get("gather_context_logits"):
        params = {**ev.perplexity.canonical(), "runtime": ENGINE_RUNTIME}
        params.pop("dataset")
        ctx.add(trt.engine_dependent(engine, "perplexity", f"perplexity[{label}]", params, ENGINE_RUNNERS["perplexity"],
                                     {"model": engine, "tokenizer": source, "data": data},
                                     threads=ctx.threads, format="metrics"))
        base_rt = _runtime(source)
        if ev.kld and base_rt is not None:
            params = {**params, "baseline_runtime": base_rt[0]}
            ctx.add(trt.engine_dependent(engine, "divergence", f"kld[{label}]", params, ENGINE_RUNNERS["divergence"],
                                         {"model": engine, "tokenizer": source, "baseline": source, "data": data},
                                         tools=base_rt[1], threads=ctx.threads, format="metrics"))
    if ev.throughput:
        gpu = trtllm_env.gpu()
        params = {**ev.throughput.canonical(), "runtime": ENGINE_RUNTIME}
        # timings belong to a machine: the GPU model (and, via per_hardware, the CPU) enter the key
        ctx.add(trt.engine_dependent(engine, "throughput", f"throughput[{label}]", params, ENGINE_RUNNERS["throughput"],
                                     {"model": engine, "tokenizer": source},
                                     extra_env={"gpu.name": gpu.name if gpu else "unknown"},
                                     threads=ctx.threads, per_hardware=True, format="metrics"))


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
    # build targets' engines ("<variant>.<target name>", like their refs)
    for engine in [s for s in ctx.steps if s.format == trt.ENGINE_FORMAT]:
        engine_evaluation_steps(engine.variant, engine, data, ev, ctx)
