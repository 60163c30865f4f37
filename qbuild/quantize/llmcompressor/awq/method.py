"""The awq method's plan side. AWQ through llm-compressor: activation-aware channel scaling, then integer weights (W4A16 etc.).

llm-compressor's AWQModifier searches per-channel scales on the shared calibration set and a
QuantizationModifier then rounds the scaled weights; output is compressed-tensors (vLLM,
transformers). AutoAWQ is deprecated and points here.

`checkpoint_format: autoawq` adds a `convert` step that rewrites that output, bit for bit, into
AutoAWQ's GEMM layout (gemm.py, run by run.py's `run_convert`), which LMDeploy and TGI load too; the variant's
artifact is then the converted checkpoint (format `awq`).
"""

from __future__ import annotations

from qbuild.plugins import RecipeError, Step, methods
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.awq.options import AWQ_FORMAT, BITS, CONVERT_TOOLS, VALUES_PER_WORD, AWQVariant


def check_autoawq(variant: AWQVariant, info: dict, field: str) -> None:
    """AutoAWQ's GEMM layout holds 4-bit grouped weights with output channels packed 8 to an int32."""
    why = "checkpoint_format autoawq (AutoAWQ's GEMM layout) holds"
    if variant.bits != BITS:
        raise RecipeError(f"{field}.bits", f"{why} {BITS}-bit weights only, got bits {variant.bits}; "
                                           f"use bits: {BITS} or checkpoint_format: compressed-tensors")
    if not variant.group_size:
        raise RecipeError(f"{field}.group_size", f"{why} group-quantized weights only, not per-channel; set a group_size "
                                                 "(e.g. 128) or use checkpoint_format: compressed-tensors")
    cfg = info.get("text_config") or info
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    outputs = {"hidden_size": cfg.get("hidden_size"), "intermediate_size": cfg.get("intermediate_size"),
               "num_key_value_heads*head_dim": kv_heads * head_dim if kv_heads and head_dim else None}
    odd = {name: size for name, size in outputs.items() if size and size % VALUES_PER_WORD}
    if odd:
        shown = ", ".join(f"{name}={size}" for name, size in odd.items())
        raise RecipeError(f"{field}.checkpoint_format", f"{why} output channels packed {VALUES_PER_WORD} to an int32, "
                                                        f"and {shown} is not a multiple of {VALUES_PER_WORD}; "
                                                        "use checkpoint_format: compressed-tensors")


@methods.register
class AWQ(lc.LLMCompressorMethod):
    name = "awq"
    options = AWQVariant
    unsupported_families = (lc.ASYMMETRIC_QWEN3_MOE, lc.MIXTRAL_EXPERTS)

    def check(self, variant: AWQVariant, ctx, field: str) -> None:
        if variant.checkpoint_format == "autoawq":
            check_autoawq(variant, ctx.model_info(), field)
        super().check(variant, ctx, field)

    def plan(self, variant: AWQVariant, ctx) -> Step:
        quantized = self.quantize_step(variant, ctx, runner="qbuild.quantize.llmcompressor.awq.run:run")
        if variant.checkpoint_format != "autoawq":
            return quantized
        # a pure function of the quantize step's output: its key is that output's key and the converter's tools
        return ctx.add(Step("convert", f"convert[{variant.name}]", {"to": "autoawq-gemm"},
                            "qbuild.quantize.llmcompressor.awq.run:run_convert", inputs={"quantized": quantized},
                            tools=CONVERT_TOOLS, variant=variant.name, format=AWQ_FORMAT, scheme=quantized.scheme))
