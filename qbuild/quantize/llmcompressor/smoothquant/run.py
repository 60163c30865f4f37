"""The smoothquant method's worker side (imported only in a step's worker): SmoothQuantModifier then W8A8 (GPTQ or
round-to-nearest weights), run by llm-compressor's shared runner (qbuild/quantize/llmcompressor/run.py); the step's
info then says how transformers runs the saved checkpoint's int8 activations on this machine."""

from __future__ import annotations

from qbuild.plugins import StepContext
from qbuild.quantize.llmcompressor.run import run_quantize


def modifiers(p: dict) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    smooth = SmoothQuantModifier(smoothing_strength=p["smoothing_strength"])
    if p["weights"] == "gptq":
        quant = GPTQModifier(targets="Linear", scheme="W8A8", ignore=list(p["ignore"]), dampening_frac=p["damp"])
    else:
        quant = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=list(p["ignore"]))
    return [smooth, quant]


def run(ctx: StepContext) -> dict:
    result = run_quantize(ctx, modifiers)
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
