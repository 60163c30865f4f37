"""FP8 (E4M3) weights and activations through llm-compressor; compressed-tensors output.

scheme: dynamic  per-channel weight scales, per-token activation scales computed at run time
                 (no calibration, seconds; llm-compressor's FP8_DYNAMIC)
scheme: static   per-tensor weight and activation scales, activation scales calibrated on the
                 shared calibration set (llm-compressor's FP8)
kv_cache: true   also calibrate FP8 KV-cache scales (needs calibration).
vLLM runs these natively on Ada/Hopper+; transformers emulates them on CPU (no speed gain).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.contract.plugin import methods
from qbuild.contract.variant import VariantBase
from qbuild.quantize import llmcompressor as lc


class FP8Variant(VariantBase):
    """FP8 W8A8 (E4M3) with dynamic or calibrated static activation scales."""

    method: Literal["fp8"]
    scheme: Literal["dynamic", "static"] = Field(
        "dynamic", description="dynamic: per-token activation scales at run time, no calibration; "
                               "static: per-tensor activation scales calibrated once.")
    kv_cache: bool = Field(False, description="Also quantize the KV cache to FP8 with calibrated scales.")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"],
                              description="Modules kept in full precision: exact names or 're:<regex>'.")

    def needs_calibration(self) -> bool:
        return self.scheme == "static" or self.kv_cache

    def describe(self) -> str:
        return f"FP8 {self.scheme}" + (" +KV" if self.kv_cache else "")


@methods.register
class FP8(lc.LLMCompressorMethod):
    name = "fp8"
    options = FP8Variant

    def scheme(self, variant: FP8Variant) -> str:
        return f"fp8-{variant.scheme}"

    def model_free_scheme(self, p: dict) -> str | None:
        return "FP8_DYNAMIC" if p["scheme"] == "dynamic" and not p["kv_cache"] else None

    def modifiers(self, p: dict) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        kv = {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                  "symmetric": True}} if p["kv_cache"] else {}
        scheme = "FP8_DYNAMIC" if p["scheme"] == "dynamic" else "FP8"
        return [QuantizationModifier(targets=["Linear"], scheme=scheme, ignore=list(p["ignore"]), **kv)]
