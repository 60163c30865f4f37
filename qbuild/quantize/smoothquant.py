"""SmoothQuant + INT8 W8A8 through llm-compressor; compressed-tensors output (vLLM, SGLang, transformers).

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

from typing import Literal

from pydantic import Field

from qbuild.contract.plugin import methods
from qbuild.contract.step import StepContext
from qbuild.contract.variant import VariantBase
from qbuild.quantize import llmcompressor as lc


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


@methods.register
class SmoothQuant(lc.LLMCompressorMethod):
    name = "smoothquant"
    options = SmoothQuantVariant

    def scheme(self, variant: SmoothQuantVariant) -> str:
        return "w8a8-int8"

    def modifiers(self, p: dict) -> list:
        from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        smooth = SmoothQuantModifier(smoothing_strength=p["smoothing_strength"])
        if p["weights"] == "gptq":
            quant = GPTQModifier(targets="Linear", scheme="W8A8", ignore=list(p["ignore"]), dampening_frac=p["damp"])
        else:
            quant = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=list(p["ignore"]))
        return [smooth, quant]

    def run(self, ctx: StepContext) -> dict:
        result = super().run(ctx)
        result["info"]["activations"] = activation_emulation(ctx.out)
        return result


def activation_emulation(checkpoint) -> str:
    """How transformers (with compressed-tensors) runs this checkpoint's int8 activations on this machine.

    Measured, not assumed: the saved checkpoint is loaded as the evaluation loads it, one forward pass runs
    (compressed-tensors decompresses the weights on the first one), and the first quantized projection's
    output is compared with the same product computed from float activations and the decompressed weight."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    layer = next(m for n, m in model.named_modules() if n.endswith("q_proj"))
    seen = {}
    hook = layer.register_forward_hook(lambda mod, args, out: seen.update(x=args[0].detach(), y=out.detach()))
    ids = torch.arange(1000, 1016).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        model(ids)
        hook.remove()
        float_act = torch.nn.functional.linear(seen["x"], layer.weight.float(), layer.bias)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.allclose(seen["y"], float_act, rtol=1e-5, atol=1e-6):
        return f"int8 activations NOT emulated by transformers on {device}: only the weights are int8 in this evaluation"
    return f"int8 per-token dynamic activations fake-quantized by compressed-tensors on {device} (emulated; no int8 speed-up)"
