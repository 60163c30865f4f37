"""Method `int8-rtn`: round-to-nearest INT8 weights with one scale per output channel, in numpy.

Every 2-D `*.weight` tensor of the model's linear layers is stored as int8 plus a float32 scale
(`<name>.scale`); everything else is copied as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field

from qbuild.core.step import Step, StepContext
from qbuild.plugins import Method
from qbuild.quantize.base import VariantBase
from qbuild_example import FORMAT, WEIGHTS


class Int8RTNVariant(VariantBase):
    """INT8 weight-only, symmetric, one scale per output channel (no calibration)."""

    method: Literal["int8-rtn"]
    skip: list[str] = Field(default_factory=lambda: ["embed_tokens", "lm_head"],
                            description="Tensors whose name contains one of these stay in full precision.")

    def describe(self) -> str:
        return "INT8 per-channel RTN"


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
    tensors: dict = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out, quantized = {}, 0
    for name, w in tensors.items():
        if w.ndim == 2 and name.endswith(".weight") and not any(s in name for s in ctx.params["skip"]):
            w32 = w.astype(np.float32)
            scale = np.maximum(np.abs(w32).max(axis=1, keepdims=True), 1e-12) / 127.0
            out[name] = np.clip(np.rint(w32 / scale), -127, 127).astype(np.int8)
            out[name + ".scale"] = scale.astype(np.float32)
            quantized += 1
        else:
            out[name] = w
    save_file(out, str(ctx.out / WEIGHTS))
    for f in src.iterdir():  # config and tokenizer travel with the weights
        if f.is_file() and f.suffix != ".safetensors" and f.name != "manifest.json":
            shutil.copyfile(f, ctx.out / f.name)
    (ctx.out / "int8.json").write_text(json.dumps({"quantized_tensors": quantized, "scheme": "w8a16 per-channel"}))
    return {"format": FORMAT, "metrics": {"size_bytes": (ctx.out / WEIGHTS).stat().st_size,
                                          "quantized_tensors": quantized}}
