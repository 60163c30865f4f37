"""The autoround method's options: the variant's schema (AutoRoundVariant) and the formats its exports are, the
auto-round format declared here (imported at plan time: no torch, no auto-round)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qbuild.plugin_services import COMPRESSED_TENSORS
from qbuild.plugins import HF_RUNTIMES, FormatSpec, IntWeightVariant, register_format

TOOLS = ("auto-round", "torch", "transformers", "accelerate", "safetensors")
# AutoRound's own export (quant_method auto-round), declared here: transformers, vLLM and SGLang load it
AUTO_ROUND = register_format(FormatSpec("auto-round", "HF checkpoint in AutoRound's format (quant_method auto-round)",
                                        load_tools=("auto-round",), evaluated_by=HF_RUNTIMES,
                                        loads_in=("transformers", "vllm", "sglang"))).name
# its other exports are formats other plugins declare (llm-compressor's, gptqmodel's, awq's), named here: a
# method module imported from here would register its method ahead of this one
FORMATS = {"auto_round": AUTO_ROUND, "llm_compressor": COMPRESSED_TENSORS, "auto_gptq": "gptq", "auto_awq": "awq"}


class AutoRoundVariant(IntWeightVariant):
    """AutoRound (SignRound): weight-only integer quantization with tuned rounding, W{bits}A16."""

    method: Literal["autoround"]
    iters: int = Field(200, ge=0, le=10000, description="Signed-gradient steps per block (0 = AutoRound's "
                                                         "optimized round-to-nearest, no tuning).")
    lr: float | None = Field(None, gt=0, description="Learning rate of the rounding offsets; default 1/iters.")
    batch_size: int = Field(8, ge=1, description="Calibration samples per tuning step.")
    format: Literal["auto_round", "llm_compressor", "auto_gptq", "auto_awq"] = Field(
        "auto_round", description="Export layout: auto_round (transformers, vLLM, SGLang), llm_compressor "
                                  "(compressed-tensors), auto_gptq (GPTQ), auto_awq (AWQ GEMM).")

    @model_validator(mode="after")
    def _format_fits_scheme(self):
        if self.format == "auto_awq":   # the AutoAWQ GEMM layout: 4-bit, grouped, with zero points
            if self.bits != 4:
                raise ValueError(f"format auto_awq packs 4-bit weights only (AWQ GEMM kernels), not {self.bits}")
            if self.sym or self.group_size is None:
                raise ValueError("format auto_awq stores grouped weights with zero points: set sym: false and a "
                                 "group_size")
        return self

    def needs_calibration(self) -> bool:
        return True   # iters: 0 still reads calibration activations (auto-round's optimized RTN weighs by them)

    def describe(self) -> str:
        return f"AutoRound {super().describe()} ({self.iters} iters, {self.format})"
