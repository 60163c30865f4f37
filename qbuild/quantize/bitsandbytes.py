"""bitsandbytes NF4/FP4 (4-bit) and LLM.int8 (8-bit) through transformers' BitsAndBytesConfig.

No calibration: transformers quantizes the Linear layers while loading the model (quantize-on-load),
and `save_pretrained` writes a serialized bitsandbytes checkpoint (packed weights + quant state, and a
`quantization_config` with `quant_method: bitsandbytes` in config.json). transformers and vLLM load it
as it is (vLLM reads the config and needs no `--quantization` flag).

bitsandbytes 0.50 has a CPU backend: both NF4 and LLM.int8 quantize, save and run on CPU here, so the
transformers runtime evaluates the artifact like any other (no speed-up on CPU: the int8/4-bit matmuls
dequantize). LLM.int8 casts activations to fp16 for its int8 matmul, on CPU too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from qbuild.base.files import dir_size
from qbuild.contract.formats import HF_RUNTIMES, FormatSpec, register_format
from qbuild.contract.plugin import Method, methods
from qbuild.contract.step import Step, StepContext
from qbuild.contract.variant import VariantBase

TOOLS = ("bitsandbytes", "torch", "transformers", "accelerate", "safetensors")
# the method's own format: an HF folder with serialized bitsandbytes weights, which transformers and vLLM load
FORMAT = register_format(FormatSpec("bitsandbytes", "HF checkpoint with serialized bitsandbytes weights (NF4/FP4 or "
                                    "LLM.int8)", load_tools=("bitsandbytes",), evaluated_by=HF_RUNTIMES,
                                    loads_in=("transformers", "vllm"))).name
FOUR_BIT = ("nf4", "fp4")


class BitsAndBytesVariant(VariantBase):
    """bitsandbytes quantize-on-load: NF4/FP4 4-bit weights (QLoRA's format) or LLM.int8 8-bit weights."""

    method: Literal["bitsandbytes"]
    scheme: Literal["nf4", "fp4", "int8"] = Field(
        "nf4", description="nf4 (4-bit NormalFloat), fp4 (4-bit float) or int8 (LLM.int8: int8 weights, "
                           "fp16 outlier columns above `threshold`).")
    double_quant: bool | None = Field(
        None, description="4-bit only: also quantize the per-block scales (saves ~0.4 bit/weight). Default true.")
    compute_dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None, description="4-bit only: dtype the dequantized weights are multiplied in. Default bfloat16.")
    threshold: float | None = Field(
        None, gt=0, description="int8 only: activation magnitude above which a column runs in fp16 (LLM.int8's "
                                "outlier threshold). Default 6.0.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Dtype of the layers left unquantized (embeddings, norms, lm_head); auto = the source's.")
    skip_modules: list[str] = Field(default_factory=lambda: ["lm_head"],
                                    description="Modules kept in full precision (llm_int8_skip_modules).")

    @model_validator(mode="after")
    def _scheme_options(self):
        """Options of the other bit width are errors; unset ones get their default, so the key is explicit."""
        four_bit = {"double_quant": True, "compute_dtype": "bfloat16"}
        eight_bit = {"threshold": 6.0}
        mine, other = (four_bit, eight_bit) if self.scheme in FOUR_BIT else (eight_bit, four_bit)
        for name in other:
            if getattr(self, name) is not None:
                raise ValueError(f"{name} applies to {'int8' if name in eight_bit else 'nf4/fp4'} only, not {self.scheme}")
        for name, default in mine.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        return self

    def quant_params(self) -> dict:
        data = super().quant_params()
        return {k: v for k, v in data.items() if v is not None}   # the other bit width's options: not part of the key

    def describe(self) -> str:
        if self.scheme == "int8":
            return f"LLM.int8 (threshold {self.threshold:g})"
        return f"{self.scheme.upper()}{' double-quant' if self.double_quant else ''} compute {self.compute_dtype}"


@methods.register
class BitsAndBytes(Method):
    name = "bitsandbytes"
    options = BitsAndBytesVariant
    extra = "bitsandbytes"
    requires = ("bitsandbytes", "torch", "transformers", "accelerate")

    def plan(self, variant: BitsAndBytesVariant, ctx) -> Step:
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            "qbuild.quantize.bitsandbytes:run", inputs={"model": ctx.model()}, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=FORMAT,
                            scheme=variant.scheme, memory="whole-model", gpu_capable=True))


# --- worker side ------------------------------------------------------------------------------------
def bnb_config(p: dict):
    import torch
    from transformers import BitsAndBytesConfig

    if p["scheme"] == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=p["threshold"],
                                  llm_int8_skip_modules=list(p["skip_modules"]))
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=p["scheme"],
                              bnb_4bit_use_double_quant=p["double_quant"],
                              bnb_4bit_compute_dtype=getattr(torch, p["compute_dtype"]),
                              llm_int8_skip_modules=list(p["skip_modules"]))


def run(ctx: StepContext) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = ctx.params
    src = Path(ctx.inputs["model"])
    device = ctx.torch_device()
    ctx.progress(0, 2, f"loading + quantizing ({p['scheme']}) on {device}")
    dtype = "auto" if p["dtype"] == "auto" else getattr(torch, p["dtype"])
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=bnb_config(p), dtype=dtype,
                                                 device_map=device)
    # Saved before any forward pass: bitsandbytes 0.50.2's CPU backend repacks 4-bit weights in place on the
    # first forward, and a model saved after that reloads with different logits.
    ctx.progress(1, 2, "saving the bitsandbytes checkpoint")
    model.save_pretrained(str(ctx.out))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(ctx.out))
    qc = json.loads((ctx.out / "config.json").read_text()).get("quantization_config", {})
    if qc.get("quant_method") != "bitsandbytes":
        raise RuntimeError(f"save_pretrained wrote no bitsandbytes quantization_config ({qc})")
    quantized = sum(1 for m in model.modules() if type(m).__module__.startswith("bitsandbytes"))
    ctx.progress(2, 2, "done")
    from importlib.metadata import version

    return {"format": FORMAT, "metrics": {"size_bytes": dir_size(ctx.out)},
            "info": {"quantized_linear_layers": quantized, "device": device, "bitsandbytes": version("bitsandbytes"),
                     "threads": ctx.threads}}
