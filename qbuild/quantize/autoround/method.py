"""The autoround method's plan side. AutoRound (Intel's auto-round): integer weights tuned by signed gradient
descent (SignRound).

For each decoder block, AutoRound learns the rounding offsets and clipping ranges of its weights
by `iters` steps of signed gradient descent on the block's output error over the shared calibration
set, then exports in one of the formats auto-round writes:

  format: auto_round       auto-round's own layout (default): transformers (with auto-round installed),
                           vLLM and SGLang load it; evaluated here by the transformers runtime (on CPU
                           through auto-round's torch kernels, which run in float16)
  format: llm_compressor   compressed-tensors (pack-quantized): vLLM, SGLang, transformers
  format: auto_gptq        the GPTQ layout (quant_method gptq): vLLM, SGLang, TGI; transformers reads it through
                           gptqmodel, so it is evaluated in the `gptqmodel` backend environment
  format: auto_awq         the AutoAWQ GEMM layout (quant_method awq; 4-bit, sym: false): vLLM, SGLang, TGI;
                           evaluated in the `gptqmodel` environment too

Tuning runs on CPU (slowly: keep iters and samples small there).
"""

from __future__ import annotations

from qbuild.plugin_services import with_untouched_dtype
from qbuild.plugins import Method, Step, check_int_weights, methods
from qbuild.quantize.autoround.options import FORMATS, TOOLS, AutoRoundVariant


@methods.register
class AutoRound(Method):
    name = "autoround"
    options = AutoRoundVariant
    extra = "autoround"
    requires = ("auto_round", "torch", "transformers")
    runs_in_env = True   # `env: auto-round` (or your own auto-round version) runs the tuning outside qbuild's environment

    def check(self, variant: AutoRoundVariant, ctx, field: str) -> None:
        _, note = check_int_weights(variant, ctx, field)
        if note:
            ctx.warn(note)

    def plan(self, variant: AutoRoundVariant, ctx) -> Step:
        params = with_untouched_dtype(variant.quant_params(), ctx)
        auto_ignore, _ = check_int_weights(variant, ctx, "variants")   # check() has reported it
        if auto_ignore:
            params["auto_ignore"] = list(auto_ignore)
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", params, "qbuild.quantize.autoround.run:run",
                            inputs={"model": ctx.model(), "calibration": ctx.calibration()}, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=FORMATS[variant.format],
                            scheme=f"w{variant.bits}a16", backend_env=ctx.backend_env(variant, self),
                            memory="whole-model", gpu_capable=True))
