"""The rtn method's worker side (imported only in a step's worker): its params as llm-compressor's
QuantizationModifier, run by llm-compressor's shared runner (qbuild/quantize/llmcompressor/run.py), shard by shard
where the plan chose it; a `search:` quantize step runs the shared runner's mixed-scheme pass."""

from __future__ import annotations

from qbuild.plugins import StepContext
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.rtn.options import model_free_scheme
from qbuild.quantize.llmcompressor.run import run_quantize, run_search_quantize


def modifiers(p: dict) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": lc.weight_args(p)}},
                                 ignore=lc.resolved_ignore(p))]


def run(ctx: StepContext) -> dict:
    return run_quantize(ctx, modifiers, model_free_scheme(ctx.params))


def run_search(ctx: StepContext) -> dict:
    """One quantize step of `search:` (a base, a probe or a candidate mix): one config group per scheme."""
    return run_search_quantize(ctx)
