"""AWQ through llm-compressor: activation-aware channel scaling, then integer weights (W4A16 etc.).

llm-compressor's AWQModifier searches per-channel scales on the shared calibration set and a
QuantizationModifier then rounds the scaled weights; output is compressed-tensors (vLLM,
transformers). AutoAWQ is deprecated and points here.

`checkpoint_format: autoawq` adds a `convert` step that rewrites that output, bit for bit, into
AutoAWQ's GEMM layout (qbuild/quantize/awq_gemm.py), which LMDeploy and TGI load too; the variant's
artifact is then the converted checkpoint (format `awq`).
"""

from __future__ import annotations

import contextlib
from typing import Literal

from pydantic import Field

from qbuild.base.errors import RecipeError
from qbuild.contract.plugin import methods
from qbuild.contract.step import Step
from qbuild.quantize import awq_gemm
from qbuild.quantize import llmcompressor as lc


class AWQVariant(lc.IntWeightVariant):
    """AWQ (Lin et al.): calibrated weight-only integer quantization by activation-aware scaling."""

    method: Literal["awq"]
    sym: bool = Field(False, description="Symmetric weights; AWQ is normally asymmetric (zero points).")
    duo_scaling: bool | Literal["both"] = Field(
        True, description="Scale search uses activations and weights (true), activations only (false), or both halves.")
    n_grid: int = Field(20, ge=1, le=200, description="Grid points of the per-mapping scale search.")
    checkpoint_format: Literal["compressed-tensors", "autoawq"] = Field(
        "compressed-tensors", description="compressed-tensors (vLLM, SGLang, transformers), or autoawq: AutoAWQ's "
                                          "GEMM layout (also LMDeploy, TGI), converted exactly; needs bits 4 and a group_size.")

    def needs_calibration(self) -> bool:
        return True

    def describe(self) -> str:
        return "AWQ " + super().describe() + (" (AutoAWQ GEMM)" if self.checkpoint_format == "autoawq" else "")

    def quant_params(self) -> dict:
        """What the quantize step computes. The checkpoint format is not part of it (the convert step is), except
        that AutoAWQ stores float16 scales: for an exact conversion the scales are computed as float16 numbers
        from the start. The default format leaves the params as they were before the option existed (same keys)."""
        data = super().quant_params()
        if data.pop("checkpoint_format") == "autoawq":
            data["scale_dtype"] = "float16"
        return data


@contextlib.contextmanager
def cpu_pin_memory_workaround():
    """llm-compressor 0.14.0.1: AWQ pins its cached activations (`IntermediatesCache.pin_memory`) to
    speed up host→GPU copies, and `Tensor.pin_memory()` raises on a machine without an accelerator.
    Pinning is only an optimisation, so with no accelerator we make it a no-op for the duration of the
    step. Remove once upstream guards it.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.__dict__["pin_memory"]
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def check_autoawq(variant: AWQVariant, info: dict, field: str) -> None:
    """AutoAWQ's GEMM layout holds 4-bit grouped weights with output channels packed 8 to an int32."""
    why = "checkpoint_format autoawq (AutoAWQ's GEMM layout) holds"
    if variant.bits != awq_gemm.BITS:
        raise RecipeError(f"{field}.bits", f"{why} {awq_gemm.BITS}-bit weights only, got bits {variant.bits}; "
                                           f"use bits: {awq_gemm.BITS} or checkpoint_format: compressed-tensors")
    if not variant.group_size:
        raise RecipeError(f"{field}.group_size", f"{why} group-quantized weights only, not per-channel; set a group_size "
                                                 "(e.g. 128) or use checkpoint_format: compressed-tensors")
    cfg = info.get("text_config") or info
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    outputs = {"hidden_size": cfg.get("hidden_size"), "intermediate_size": cfg.get("intermediate_size"),
               "num_key_value_heads*head_dim": kv_heads * head_dim if kv_heads and head_dim else None}
    odd = {name: size for name, size in outputs.items() if size and size % awq_gemm.VALUES_PER_WORD}
    if odd:
        shown = ", ".join(f"{name}={size}" for name, size in odd.items())
        raise RecipeError(f"{field}.checkpoint_format", f"{why} output channels packed {awq_gemm.VALUES_PER_WORD} to an int32, "
                                                        f"and {shown} is not a multiple of {awq_gemm.VALUES_PER_WORD}; "
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
        quantized = super().plan(variant, ctx)
        if variant.checkpoint_format != "autoawq":
            return quantized
        # a pure function of the quantize step's output: its key is that output's key and the converter's tools
        return ctx.add(Step("convert", f"convert[{variant.name}]", {"to": "autoawq-gemm"},
                            "qbuild.quantize.awq_gemm:run_convert", inputs={"quantized": quantized},
                            tools=awq_gemm.TOOLS, variant=variant.name, format=awq_gemm.AWQ, scheme=quantized.scheme))

    def modifiers(self, p: dict) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        # scale_dtype only when set (checkpoint_format autoawq), so the default recipe is what it always was
        weights = lc.weight_args(p, **({"scale_dtype": p["scale_dtype"]} if p.get("scale_dtype") else {}))
        return [AWQModifier(duo_scaling=p["duo_scaling"], n_grid=p["n_grid"]),
                QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                     ignore=lc.resolved_ignore(p))]

    def workarounds(self):
        return cpu_pin_memory_workaround()
