"""The gptq method's worker side (imported only in a step's worker): its params as llm-compressor's GPTQModifier,
run by llm-compressor's shared runner (qbuild/quantize/llmcompressor/run.py)."""

from __future__ import annotations

from qbuild.plugins import StepContext
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.run import run_quantize


def modifiers(p: dict) -> list:
    from llmcompressor.modifiers.gptq import GPTQModifier

    weights = lc.weight_args(p)
    return [GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                         ignore=lc.resolved_ignore(p), dampening_frac=p["damp"], block_size=p["block_size"],
                         actorder=p.get("actorder"))]


def run(ctx: StepContext) -> dict:
    return run_quantize(ctx, modifiers)
