"""The smoothquant method's options: the variant's schema (SmoothQuantVariant). Imported at plan time: no torch, no
llm-compressor."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.plugins import VariantBase


class SmoothQuantVariant(VariantBase):
    """SmoothQuant activation smoothing, then INT8 weights (per channel) and INT8 activations (per token, dynamic)."""

    method: Literal["smoothquant"]
    smoothing_strength: float = Field(
        0.8, ge=0, le=1, description="SmoothQuant's α: how much of the activation range moves into the weights "
                                     "(0 = none, 1 = all; 0.8 suits most LLMs, 0.5 the smaller ones).")
    weights: Literal["gptq", "rtn"] = Field(
        "gptq", description="How the int8 weights are rounded: gptq (calibrated, default) or rtn (round to nearest).")
    damp: float = Field(0.01, gt=0, lt=1, description="GPTQ Hessian dampening, as a fraction of its mean diagonal.")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"],
                              description="Modules kept in full precision: exact names or 're:<regex>'.")

    def needs_calibration(self) -> bool:
        return True  # the smoothing scales come from calibration activations

    def describe(self) -> str:
        return f"SmoothQuant α{self.smoothing_strength:g} W8A8 INT8 ({self.weights.upper()})"
