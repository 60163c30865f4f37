"""Round-to-nearest baseline: the same integer weight scheme as GPTQ/AWQ, no calibration.

It shows what calibration buys: compare a GPTQ or AWQ variant with an RTN variant of equal bits,
group size and symmetry. Runs llm-compressor's QuantizationModifier (data-free, seconds).
With `search:` it mixes W4A16 and W8A16 per layer under a bits or KLD budget (qbuild/quantize/llmcompressor/search.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.contract.plugin import methods
from qbuild.contract.step import Step
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.search import CTSearch, check_search, plan_search
from qbuild.quantize.untouched import with_untouched_dtype


class RTNVariant(lc.IntWeightVariant):
    """Round-to-nearest integer weights (min/max scales per group), no calibration data."""

    method: Literal["rtn"]
    search: CTSearch | None = Field(
        None, description="Mix W4A16 / W8A16 per layer to reach an average-bits or KLD budget, chosen from measured "
                          "KL divergence (docs/mixed-precision.md, compressed-tensors); `bits` is then not given.")

    def describe(self) -> str:
        if self.search is not None:
            g = f"g{self.group_size}" if self.group_size else "per-channel"
            return f"RTN {self.search.describe()} {'/'.join(self.search.schemes)} {g}"
        return "RTN " + super().describe()

    def quant_params(self) -> dict:
        data = super().quant_params()
        if data.get("search") is None:
            data.pop("search", None)   # variants without a search keep their earlier keys
        return data


@methods.register
class RTN(lc.LLMCompressorMethod):
    name = "rtn"
    options = RTNVariant
    unsupported_families = (lc.ASYMMETRIC_QWEN3_MOE, lc.MIXTRAL_EXPERTS)

    def modifiers(self, p: dict) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return [QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": lc.weight_args(p)}},
                                     ignore=lc.resolved_ignore(p))]

    def model_free_scheme(self, p: dict) -> dict | None:
        return None if p.get("search") else {"weights": lc.weight_args(p)}

    def check(self, variant: RTNVariant, ctx, field: str) -> None:
        super().check(variant, ctx, field)
        if variant.search is not None:
            check_search(variant, ctx, field)

    def scheme(self, variant) -> str:
        return "w8a16" if variant.search is not None else super().scheme(variant)

    def plan(self, variant: RTNVariant, ctx) -> Step:
        if variant.search is None:
            return super().plan(variant, ctx)
        auto_ignore, _ = lc.check_int_weights(variant, ctx, "variants")
        env = ctx.backend_env(variant, self)

        def quantize_step(name: str, params: dict, extra: dict) -> Step:
            if auto_ignore:
                params = {**params, "auto_ignore": list(auto_ignore)}
            params = with_untouched_dtype(params, ctx)
            return ctx.add(Step("quantize", name, params, "qbuild.quantize.llmcompressor.search:run_quantize",
                                inputs={"model": ctx.model(), **extra}, tools=lc.TOOLS, threads=ctx.threads,
                                format=lc.COMPRESSED_TENSORS, scheme="w8a16", backend_env=env,
                                memory="offloads-to-disk"))

        return plan_search(variant, ctx, quantize_step)
