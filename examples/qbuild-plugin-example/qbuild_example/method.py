"""Method `int8-rtn`: round-to-nearest INT8 weights with one scale per output channel, in numpy, written as a
simulated-quantization checkpoint (format `hf-int8-simulated`).

Every 2-D `*.weight` tensor of the model's linear layers is rounded to the INT8 grid of its row and stored
dequantized (scale × integer, in float32), with the scales beside it in `int8_scales.safetensors`; everything else is
copied as it is. Any engine that reads a Hugging Face checkpoint loads it, and it scores exactly what an INT8 kernel
would compute, so the format is declared below as evaluated by qbuild's built-in `transformers` runtime: this plugin
needs no runtime of its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from qbuild.plugins import Field, FormatSpec, Method, Step, StepContext, VariantBase, register_format

FORMAT = "hf-int8-simulated"
SCALES = "int8_scales.safetensors"

# A new format is declared once: who evaluates it, which engines load it (at full-precision memory: the weights are
# stored dequantized) and how the model card tells people to load it.
register_format(FormatSpec(FORMAT, "HF checkpoint with INT8-grid weights stored dequantized (per-channel scales beside "
                                   "them), example plugin",
                           evaluated_by=("transformers",), loads_in=("transformers", "vllm", "sglang", "tgi")))


class Int8RTNVariant(VariantBase):
    """INT8 weight-only, symmetric, one scale per output channel (no calibration)."""

    method: Literal["int8-rtn"]
    skip: list[str] = Field(default_factory=lambda: ["embed_tokens", "lm_head"],
                            description="Tensors whose name contains one of these stay in full precision.")

    def describe(self) -> str:
        return "INT8 per-channel RTN (simulated)"


class Int8RTN(Method):
    name = "int8-rtn"
    options = Int8RTNVariant
    extra = "qbuild-plugin-example"
    requires = ("numpy", "safetensors")

    def plan(self, variant: Int8RTNVariant, ctx) -> Step:
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            "qbuild_example.method:run", inputs={"model": ctx.model()},
                            tools=("qbuild-plugin-example", "numpy", "safetensors"), threads=ctx.threads,
                            variant=variant.name, format=FORMAT, scheme="w8a16"))


def run(ctx: StepContext) -> dict:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = Path(ctx.inputs["model"])
    out, scales, quantized = {}, {}, 0
    for f in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            if w.ndim == 2 and name.endswith(".weight") and not any(s in name for s in ctx.params["skip"]):
                w32 = w.astype(np.float32)
                scale = np.maximum(np.abs(w32).max(axis=1, keepdims=True), 1e-12) / 127.0
                out[name] = (np.clip(np.rint(w32 / scale), -127, 127) * scale).astype(np.float32)
                scales[name + ".scale"] = scale.astype(np.float32)
                quantized += 1
            else:
                out[name] = w
    save_file(out, str(ctx.out / "model.safetensors"), metadata={"format": "pt"})
    save_file(scales, str(ctx.out / SCALES))
    for f in src.iterdir():  # config and tokenizer travel with the weights
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("manifest.json", "model.safetensors.index.json"):
            shutil.copyfile(f, ctx.out / f.name)
    (ctx.out / "int8.json").write_text(json.dumps({"quantized_tensors": quantized, "scheme": "w8a16 per-channel",
                                                   "stored": "dequantized (simulated)"}))
    return {"format": FORMAT, "metrics": {"size_bytes": (ctx.out / "model.safetensors").stat().st_size,
                                          "quantized_tensors": quantized}}
