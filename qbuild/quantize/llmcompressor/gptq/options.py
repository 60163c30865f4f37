"""The gptq method's options: the variant's schema (GPTQVariant). Imported at plan time: no torch, no llm-compressor."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

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
