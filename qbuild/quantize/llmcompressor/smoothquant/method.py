"""The smoothquant method's plan side. SmoothQuant + INT8 W8A8 through llm-compressor; compressed-tensors output
(vLLM, SGLang, transformers).

SmoothQuant (Xiao et al.) moves activation outliers into the weights with a per-channel scale
(`smoothing_strength` = its α) computed on the shared calibration set; the weights are then rounded
to int8, one scale per output channel, by GPTQ (default) or round-to-nearest, and activations are
quantized to int8 per token at run time (dynamic, nothing calibrated for them): llm-compressor's
W8A8 preset. vLLM runs it with int8 GEMM kernels.

On CPU, transformers loads the checkpoint through compressed-tensors, which decompresses the int8
weights and fake-quantizes the activations per token in the forward pass, so the measured perplexity
includes the activation rounding (the quantize step checks this on the saved checkpoint and records it
in its manifest's info); there is no int8 speed-up on CPU.
"""

from __future__ import annotations

from qbuild.plugins import Step, methods
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.smoothquant.options import SmoothQuantVariant


@methods.register
class SmoothQuant(lc.LLMCompressorMethod):
    name = "smoothquant"
    options = SmoothQuantVariant

    def scheme(self, variant: SmoothQuantVariant) -> str:
        return "w8a8-int8"

    def plan(self, variant: SmoothQuantVariant, ctx) -> Step:
        return self.quantize_step(variant, ctx, runner="qbuild.quantize.llmcompressor.smoothquant.run:run")
