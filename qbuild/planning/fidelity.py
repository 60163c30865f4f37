"""Planning of the fidelity checks (qbuild/models/import_check.py runs them): `import-check` for a GGUF source, held to
its file; `convert-check[<type>]` for an HF source's GGUF conversion, held to the checkpoint. PlanContext.gate makes
every step that reads the checked step wait for its check."""

from __future__ import annotations

from qbuild.contract.step import HF_PRELOAD, Step
from qbuild.planning.recipe import Perplexity

CHECK_WINDOWS = 2          # the first evaluation windows the distributions are compared on
TOOLS = ("torch", "transformers", "tokenizers", "gguf", "llama-cpp-python")


def _protocol(ctx) -> Perplexity:
    """The evaluation's perplexity protocol as the evaluation resolves it (BOS as the model's own tokenizer adds it),
    or its defaults where the recipe measures no perplexity: the check reads the same eval-data step."""
    from qbuild.planning.evaluation import bos_decision, effective_evaluation

    perplexity = effective_evaluation(ctx).perplexity
    if perplexity is not None:
        return perplexity
    return Perplexity(add_bos=bos_decision(ctx.model(), Perplexity())[0])


def _compared_on(ctx) -> tuple[Step, dict]:
    """The eval-data step a check reads and the protocol params it compares on: the first CHECK_WINDOWS windows."""
    perplexity = _protocol(ctx)
    data = ctx.eval_data(perplexity)
    return data, {"protocol": perplexity.protocol, "context_length": perplexity.context_length,
                  "stride": perplexity.stride, "add_bos": perplexity.add_bos,
                  "windows": min(CHECK_WINDOWS, perplexity.max_windows or CHECK_WINDOWS),
                  "dataset": data.params["dataset"]}


def import_check_step(ctx, model: Step) -> Step | None:
    """The `import-check` step of a GGUF import (None for other model sources): on the recipe's evaluation text and
    protocol (its defaults where the recipe measures no perplexity), first CHECK_WINDOWS windows."""
    if model.kind != "import-gguf":
        return None

    data, params = _compared_on(ctx)
    params["dtype"] = model.params["dtype"]
    return ctx.add(Step("import-check", "import-check", params, "qbuild.models.import_check:run",
                        inputs={"model": model, "data": data}, tools=TOOLS, threads=ctx.threads,
                        preload=HF_PRELOAD, format="metrics", impl_version=2, memory="layer-streamed", gpu_capable=True,
                        # impl 2: perplexity agreement
                        runtime_args={"gguf_path": model.runtime_args["gguf_path"],
                                      "sources": data.runtime_args["sources"]}))


def conversion_check_step(ctx, convert: Step) -> Step | None:
    """The `convert-check[<type>]` step of an HF source's GGUF conversion (None for a GGUF source, whose import-check
    already holds the baseline to its file): the same comparison, the converted file through llama.cpp against the
    checkpoint through transformers, so no GGUF variant is built on a conversion that does not reproduce it."""
    model = ctx.model()
    if model.kind == "import-gguf":
        return None

    data, params = _compared_on(ctx)
    params["outtype"] = convert.params["outtype"]
    return ctx.add(Step("convert-check", f"convert-check[{convert.params['outtype']}]", params,
                        "qbuild.models.import_check:run_convert_check",
                        inputs={"model": model, "data": data, "gguf": convert}, tools=TOOLS, threads=ctx.threads,
                        preload=HF_PRELOAD, format="metrics", memory="layer-streamed", gpu_capable=True,
                        runtime_args={"sources": data.runtime_args["sources"]}))


