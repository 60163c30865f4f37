"""GGUF through llama.cpp: convert the HF checkpoint with llama.cpp's converter, quantize in-process.

Two steps: `gguf-convert` (shared by every GGUF variant of a model) and `quantize[<variant>]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from qbuild.quantize.base import VariantBase
from qbuild.step import Step, StepContext

EXTRA = "gguf"
REQUIRES = ("llama_cpp", "gguf")
TOOLS = ("llama-cpp-python",)
CONVERT_TOOLS = ("llama-cpp-python", "torch", "transformers", "safetensors")

# llama-quantize's types (llama_ftype names without LLAMA_FTYPE_MOSTLY_); checked against llama_cpp at run time
TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
)
OUTPUT_FILE = "model.gguf"


class Variant(VariantBase):
    """A GGUF file of one llama.cpp quantization type."""

    method: Literal["gguf"]
    type: str = Field(description="llama.cpp quantization type, e.g. F16, Q8_0, Q4_K_M, IQ4_XS.")
    convert_type: Literal["f32", "f16", "bf16"] = Field(
        "f16", description="Type of the intermediate GGUF written by convert_hf_to_gguf.py before quantizing."
    )

    def describe(self) -> str:
        return self.type

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        up = v.upper()
        if up not in TYPES:
            raise ValueError(f"{v!r} is not a llama.cpp quantization type; allowed: {', '.join(TYPES)}")
        return up


def check(variant: Variant, ctx, field: str) -> None:
    """Nothing shape-dependent for the types supported so far: llama.cpp falls back per tensor."""


def plan(variant: Variant, ctx) -> Step:
    model = ctx.model()
    convert = ctx.add(Step("gguf-convert", f"gguf-convert[{variant.convert_type}]", {"outtype": variant.convert_type},
                           "qbuild.quantize.gguf:run_convert", inputs={"model": model}, tools=CONVERT_TOOLS,
                           threads=ctx.threads, format="gguf"))
    return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                        "qbuild.quantize.gguf:run_quantize", inputs={"gguf": convert}, tools=TOOLS,
                        threads=ctx.threads, variant=variant.name, format="gguf"))


def run_convert(ctx: StepContext) -> dict:
    from qbuild.quantize.llamacpp_tools import run_converter

    ctx.progress(0, 1, "convert_hf_to_gguf.py")
    out = ctx.out / OUTPUT_FILE
    run_converter(Path(ctx.inputs["model"]), out, ctx.params["outtype"], log=ctx.log)
    ctx.progress(1, 1, "converted")
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size}}


def run_quantize(ctx: StepContext) -> dict:
    import llama_cpp

    src = Path(ctx.inputs["gguf"]) / OUTPUT_FILE
    out = ctx.out / OUTPUT_FILE
    name = ctx.params["type"]
    ftype = llama_cpp.LLAMA_FTYPE_ALL_F32 if name == "F32" else getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}", None)
    if ftype is None:
        raise ValueError(f"this llama.cpp build ({llama_cpp.__version__}) has no type {name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = ctx.threads
    ctx.progress(0, 1, f"llama_model_quantize {name}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({name}) returned {rc}")
    ctx.progress(1, 1, "quantized")
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size},
            "info": {"gguf_type": name, "llama_cpp_python": llama_cpp.__version__}}
