"""The bitsandbytes method's options: the variant's schema (BitsAndBytesVariant) and the format it writes, declared
here (imported at plan time: no torch, no bitsandbytes)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qbuild.plugins import HF_RUNTIMES, FormatSpec, VariantBase, register_format

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
