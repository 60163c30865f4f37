"""The bitsandbytes method's worker side (imported only in a step's worker): load the model quantized by
transformers' BitsAndBytesConfig, save the serialized bitsandbytes checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.plugin_services import narrow_untouched
from qbuild.plugins import StepContext, dir_size
from qbuild.quantize.bitsandbytes.options import FORMAT


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
    narrowed = narrow_untouched(ctx)
    ctx.progress(2, 2, "done")
    from importlib.metadata import version

    return {"format": FORMAT, "metrics": {"size_bytes": dir_size(ctx.out)},
            "info": {"quantized_linear_layers": quantized, "device": device, "bitsandbytes": version("bitsandbytes"),
                     "threads": ctx.threads, **narrowed}}
