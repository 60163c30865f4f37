"""GPTQ through llm-compressor's GPTQModifier: integer weights (W2/3/4/8 A16), compressed-tensors output.

GPTQ quantizes one decoder layer at a time, correcting the not-yet-quantized columns with the
layer's input Hessian from the shared calibration set. Output loads in vLLM and transformers.
(The GPTQ-format backend through gptqmodel needs its own environment: see README, dependency notes.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.contract.plugin import methods
from qbuild.quantize import llmcompressor as lc


class GPTQVariant(lc.IntWeightVariant):
    """GPTQ (Frantar et al.): calibrated weight-only integer quantization."""

    method: Literal["gptq"]
    damp: float = Field(0.01, gt=0, lt=1, description="Hessian dampening, as a fraction of its mean diagonal.")
    actorder: Literal["static", "group", "weight"] | None = Field(
        "static", description="Activation ordering (desc_act): static/weight keep the runtime layout; "
                              "group reorders groups (slower kernels); null = off.")
    block_size: int = Field(128, ge=1, description="Columns updated per GPTQ block.")

    def needs_calibration(self) -> bool:
        return True

    def describe(self) -> str:
        return "GPTQ " + super().describe()


@methods.register
class GPTQ(lc.LLMCompressorMethod):
    name = "gptq"
    options = GPTQVariant
    unsupported_families = (lc.ASYMMETRIC_QWEN3_MOE, lc.MIXTRAL_EXPERTS)

    def modifiers(self, p: dict) -> list:
        from llmcompressor.modifiers.gptq import GPTQModifier

        weights = lc.weight_args(p)
        return [GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                             ignore=lc.resolved_ignore(p), dampening_frac=p["damp"], block_size=p["block_size"],
                             actorder=p.get("actorder"))]
