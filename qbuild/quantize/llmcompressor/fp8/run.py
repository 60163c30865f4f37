"""The fp8 method's worker side (imported only in a step's worker): its params as llm-compressor's
QuantizationModifier (FP8 or FP8_DYNAMIC, optionally FP8 KV-cache scales), run by llm-compressor's shared runner
(qbuild/quantize/llmcompressor/run.py), shard by shard where the plan chose it."""

from __future__ import annotations

from qbuild.plugins import StepContext
from qbuild.quantize.llmcompressor.fp8.options import model_free_scheme
from qbuild.quantize.llmcompressor.run import run_quantize


def modifiers(p: dict) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    kv = {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                              "symmetric": True}} if p["kv_cache"] else {}
    scheme = "FP8_DYNAMIC" if p["scheme"] == "dynamic" else "FP8"
    return [QuantizationModifier(targets=["Linear"], scheme=scheme, ignore=list(p["ignore"]), **kv)]


def run(ctx: StepContext) -> dict:
    return run_quantize(ctx, modifiers, model_free_scheme(ctx.params))
