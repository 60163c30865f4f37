"""The bitsandbytes method's plan side. bitsandbytes NF4/FP4 (4-bit) and LLM.int8 (8-bit) through transformers'
BitsAndBytesConfig.

No calibration: transformers quantizes the Linear layers while loading the model (quantize-on-load),
and `save_pretrained` writes a serialized bitsandbytes checkpoint (packed weights + quant state, and a
`quantization_config` with `quant_method: bitsandbytes` in config.json). transformers and vLLM load it
as it is (vLLM reads the config and needs no `--quantization` flag).

bitsandbytes 0.50 has a CPU backend: both NF4 and LLM.int8 quantize, save and run on CPU here, so the
transformers runtime evaluates the artifact like any other (no speed-up on CPU: the int8/4-bit matmuls
dequantize). LLM.int8 casts activations to fp16 for its int8 matmul, on CPU too.
"""

from __future__ import annotations

from qbuild.plugin_services import with_untouched_dtype
from qbuild.plugins import Method, Step, methods
from qbuild.quantize.bitsandbytes.options import FORMAT, TOOLS, BitsAndBytesVariant


@methods.register
class BitsAndBytes(Method):
    name = "bitsandbytes"
    options = BitsAndBytesVariant
    extra = "bitsandbytes"
    requires = ("bitsandbytes", "torch", "transformers", "accelerate")

    def plan(self, variant: BitsAndBytesVariant, ctx) -> Step:
        params = variant.quant_params()   # its own dtype, where the recipe sets one, decides the untouched tensors'
        params = with_untouched_dtype(params, ctx) if params.get("dtype") == "auto" else params
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", params,
                            "qbuild.quantize.bitsandbytes.run:run", inputs={"model": ctx.model()}, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=FORMAT,
                            scheme=variant.scheme, memory="whole-model", gpu_capable=True))
