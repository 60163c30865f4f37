"""The gptq method's plan side. GPTQ through llm-compressor's GPTQModifier: integer weights (W2/3/4/8 A16),
compressed-tensors output.

GPTQ quantizes one decoder layer at a time, correcting the not-yet-quantized columns with the
layer's input Hessian from the shared calibration set. Output loads in vLLM and transformers.
(The GPTQ-format backend through gptqmodel needs its own environment: see README, dependency notes.)
"""

from __future__ import annotations

from qbuild.plugins import Step, methods
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.gptq.options import GPTQVariant


@methods.register
class GPTQ(lc.LLMCompressorMethod):
    name = "gptq"
    options = GPTQVariant
    unsupported_families = (lc.ASYMMETRIC_QWEN3_MOE, lc.MIXTRAL_EXPERTS)

    def plan(self, variant: GPTQVariant, ctx) -> Step:
        return self.quantize_step(variant, ctx, runner="qbuild.quantize.llmcompressor.gptq.run:run")
