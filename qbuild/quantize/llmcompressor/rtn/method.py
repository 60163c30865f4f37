"""The rtn method's plan side. Round-to-nearest baseline: the same integer weight scheme as GPTQ/AWQ, no calibration.

It shows what calibration buys: compare a GPTQ or AWQ variant with an RTN variant of equal bits,
group size and symmetry. Runs llm-compressor's QuantizationModifier (data-free, seconds).
With `search:` it mixes W4A16 and W8A16 per layer under a bits or KLD budget (qbuild/quantize/llmcompressor/search.py).
"""

from __future__ import annotations

from qbuild.plugin_services import with_untouched_dtype
from qbuild.plugins import Step, methods
from qbuild.quantize import llmcompressor as lc
from qbuild.quantize.llmcompressor.rtn.options import RTNVariant, model_free_scheme


@methods.register
class RTN(lc.LLMCompressorMethod):
    name = "rtn"
    options = RTNVariant
    unsupported_families = (lc.ASYMMETRIC_QWEN3_MOE, lc.MIXTRAL_EXPERTS)

    def model_free_scheme(self, p: dict) -> dict | None:
        return model_free_scheme(p)

    def check(self, variant: RTNVariant, ctx, field: str) -> None:
        super().check(variant, ctx, field)
        if variant.search is not None:
            lc.check_search(variant, ctx, field)

    def scheme(self, variant) -> str:
        return "w8a16" if variant.search is not None else super().scheme(variant)

    def plan(self, variant: RTNVariant, ctx) -> Step:
        if variant.search is None:
            return self.quantize_step(variant, ctx, runner="qbuild.quantize.llmcompressor.rtn.run:run")
        auto_ignore, _ = lc.check_int_weights(variant, ctx, "variants")
        env = ctx.backend_env(variant, self)

        def quantize_step(name: str, params: dict, extra: dict) -> Step:
            if auto_ignore:
                params = {**params, "auto_ignore": list(auto_ignore)}
            params = with_untouched_dtype(params, ctx)
            return ctx.add(Step("quantize", name, params, "qbuild.quantize.llmcompressor.rtn.run:run_search",
                                inputs={"model": ctx.model(), **extra}, tools=lc.TOOLS, threads=ctx.threads,
                                format=lc.COMPRESSED_TENSORS, scheme="w8a16", backend_env=env,
                                memory="offloads-to-disk"))

        return lc.plan_search(variant, ctx, quantize_step)
