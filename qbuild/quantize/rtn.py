"""Round-to-nearest baseline: the same integer weight scheme as GPTQ/AWQ, no calibration.

It shows what calibration buys: compare a GPTQ or AWQ variant with an RTN variant of equal bits,
group size and symmetry. Runs llm-compressor's QuantizationModifier (data-free, seconds).
"""

from __future__ import annotations

from typing import Literal

from qbuild.plugins import methods
from qbuild.quantize import llmcompressor as lc


class RTNVariant(lc.IntWeightVariant):
    """Round-to-nearest integer weights (min/max scales per group), no calibration data."""

    method: Literal["rtn"]

    def describe(self) -> str:
        return "RTN " + super().describe()


@methods.register
class RTN(lc.LLMCompressorMethod):
    name = "rtn"
    options = RTNVariant

    def modifiers(self, p: dict) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return [QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": lc.weight_args(p)}},
                                     ignore=lc.resolved_ignore(p))]
