"""The awq method's worker side (imported only in a step's worker): AWQModifier then a QuantizationModifier, run by
llm-compressor's shared runner (qbuild/quantize/llmcompressor/run.py), and the `convert` step of `checkpoint_format:
autoawq` (gemm.py: compressed-tensors → AutoAWQ's GEMM layout, bit for bit)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from qbuild.plugins import StepContext, dir_size, loads_in
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.awq.gemm import convert_checkpoint
from qbuild.quantize.llmcompressor.awq.options import AWQ_FORMAT
from qbuild.quantize.llmcompressor.run import run_quantize


@contextlib.contextmanager
def cpu_pin_memory_workaround():
    """llm-compressor 0.14.0.1: AWQ pins its cached activations (`IntermediatesCache.pin_memory`) to
    speed up host→GPU copies, and `Tensor.pin_memory()` raises on a machine without an accelerator.
    Pinning is only an optimisation, so with no accelerator we make it a no-op for the duration of the
    step. Remove once upstream guards it.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.__dict__["pin_memory"]
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def modifiers(p: dict) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    # scale_dtype only when set (checkpoint_format autoawq), so the default recipe is what it always was
    weights = lc.weight_args(p, **({"scale_dtype": p["scale_dtype"]} if p.get("scale_dtype") else {}))
    return [AWQModifier(duo_scaling=p["duo_scaling"], n_grid=p["n_grid"]),
            QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                 ignore=lc.resolved_ignore(p))]


def run(ctx: StepContext) -> dict:
    return run_quantize(ctx, modifiers, workarounds=cpu_pin_memory_workaround())


def run_convert(ctx: StepContext) -> dict:
    """The convert step: the quantize step's compressed-tensors output → an AutoAWQ GEMM checkpoint."""
    src = Path(ctx.inputs["quantized"])
    ctx.progress(0, 1, "converting to AutoAWQ GEMM")
    facts = convert_checkpoint(src, ctx.out, log=ctx.log)
    ctx.progress(1, 1, "converted")
    return {"format": AWQ_FORMAT, "metrics": {"size_bytes": dir_size(ctx.out)},
            "info": {"checkpoint_format": "autoawq-gemm", "converted_from": "compressed-tensors pack-quantized",
                     "loads_in": list(loads_in(AWQ_FORMAT)), **facts}}
