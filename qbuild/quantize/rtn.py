"""Round-to-nearest baseline: the same integer weight scheme as GPTQ/AWQ, no calibration.

It shows what calibration buys: compare a GPTQ or AWQ variant with an RTN variant of equal bits,
group size and symmetry. Runs llm-compressor's QuantizationModifier (data-free, seconds).
"""

from __future__ import annotations

from typing import Literal

from qbuild.quantize import llmcompressor as lc

EXTRA = lc.EXTRA
REQUIRES = lc.REQUIRES


class Variant(lc.IntWeightVariant):
    """Round-to-nearest integer weights (min/max scales per group), no calibration data."""

    method: Literal["rtn"]

    def describe(self) -> str:
        return "RTN " + super().describe()


def check(variant: Variant, ctx, field: str) -> None:
    lc.check_int_weights(variant, ctx, field)


def plan(variant: Variant, ctx):
    auto = lc.check_int_weights(variant, ctx, "variants")
    return lc.plan_step(variant, ctx, "qbuild.quantize.rtn:run", auto)


def build_recipe(p: dict) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": lc.weight_args(p)}},
                                 ignore=lc.resolved_ignore(p))]


run = lc.runner(build_recipe)
