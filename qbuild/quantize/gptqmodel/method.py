"""The gptqmodel method's plan side. GPTQ through gptqmodel, writing the GPTQ format: the checkpoint TGI, LMDeploy,
ExLlamaV2, transformers and vLLM (gptq_marlin) load — `quantize_config.json` / `quantization_config: {quant_method:
gptq}`, v1 packing.

llm-compressor's GPTQ (gptq.py) writes compressed-tensors, which TGI and LMDeploy do not read. gptqmodel
cannot share qbuild's environment (7.6.0 pins numpy 2.2.6; 7.7 needs torch ≥ 2.14.1), so this method runs
in its own backend environment, `gptqmodel` (qbuild/envs/), created with uv on first use; so does the
evaluation of its output (the `gptq` format's eval_env). Calibration is the shared calibration artifact.
"""

from __future__ import annotations

from qbuild.plugin_services import with_untouched_dtype
from qbuild.plugins import Method, Step, check_group_size, methods
from qbuild.quantize.gptqmodel.options import GPTQ, TOOLS, GPTQModelVariant


@methods.register
class GPTQModel(Method):
    name = "gptqmodel"
    options = GPTQModelVariant
    extra = "gptqmodel environment"
    requires = ("gptqmodel",)   # checked only when the variant runs in qbuild's environment (it does not by default)
    runs_in_env = True
    default_env = "gptqmodel"

    def check(self, variant: GPTQModelVariant, ctx, field: str) -> None:
        # gptqmodel groups columns like compressed-tensors: a group size must divide each layer's input dim
        check_group_size(variant.group_size, ctx.model_info(), ["lm_head"], field, method="gptqmodel", escapes=())

    def plan(self, variant: GPTQModelVariant, ctx) -> Step:
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", with_untouched_dtype(variant.quant_params(), ctx),
                            "qbuild.quantize.gptqmodel.run:run",
                            inputs={"model": ctx.model(), "calibration": ctx.calibration()},
                            tools=TOOLS, threads=ctx.threads, variant=variant.name, format=GPTQ,
                            scheme=f"w{variant.bits}a16", backend_env=ctx.backend_env(variant, self),
                            memory="whole-model", gpu_capable=True))
