"""The fp8 method's plan side. FP8 (E4M3) weights and activations through llm-compressor; compressed-tensors output.

scheme: dynamic  per-channel weight scales, per-token activation scales computed at run time
                 (no calibration, seconds; llm-compressor's FP8_DYNAMIC)
scheme: static   per-tensor weight and activation scales, activation scales calibrated on the
                 shared calibration set (llm-compressor's FP8)
kv_cache: true   also calibrate FP8 KV-cache scales (needs calibration).
vLLM runs these natively on Ada/Hopper+; transformers emulates them on CPU (no speed gain).
"""

from __future__ import annotations

from qbuild.plugins import Step, methods
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.fp8.options import FP8Variant, model_free_scheme


@methods.register
class FP8(lc.LLMCompressorMethod):
    name = "fp8"
    options = FP8Variant

    def scheme(self, variant: FP8Variant) -> str:
        return f"fp8-{variant.scheme}"

    def model_free_scheme(self, p: dict) -> str | None:
        return model_free_scheme(p)

    def plan(self, variant: FP8Variant, ctx) -> Step:
        return self.quantize_step(variant, ctx, runner="qbuild.quantize.llmcompressor.fp8.run:run")
