"""NVIDIA ModelOpt: FP8, INT8-SmoothQuant, INT4-AWQ, W4A8-AWQ, NVFP4 and W4A8-MXFP4, exported for TensorRT-LLM.

One step, `quantize[<variant>]`: load the HF model, calibrate ModelOpt's quantizers on the shared
calibration set, export either a TensorRT-LLM checkpoint (config.json + rank<N>.safetensors, the
input of `trtllm-build`) or a Hugging Face checkpoint with hf_quant_config.json (what TensorRT-LLM's
PyTorch backend loads), then validate the export against the source model and record every fix
(see qbuild/models/checkpoint.py: ModelOpt 0.47 writes no rotary_base, for one).
Runs on CPU; ModelOpt is imported only inside the step's worker process.

NVFP4 and W4A8-MXFP4 (MXFP4 weights, FP8 activations) are exported as HF checkpoints for TensorRT-LLM's
PyTorch backend, whose Linear layers run exactly these two FP4 layouts (QuantAlgo NVFP4 and
W4A8_MXFP4_FP8; plain W4A4 MXFP4 has no dense-layer kernel there, so ModelOpt's MXFP4_DEFAULT_CFG is not
offered). ModelOpt 0.47 fake-quantizes FP4 only on CUDA (its dynamic block quantizer asserts CUDA
tensors, the MX kernels are a CUDA extension), so these steps need a GPU: without one `qbuild plan`
shows them as needs-gpu, and `on_missing_gpu: skip` builds the rest of the recipe. Any CUDA GPU can
quantize; serving the result needs Blackwell (SM 10.x) kernels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from qbuild.base.errors import RecipeError
from qbuild.build import trtllm_env
from qbuild.contract.formats import Format
from qbuild.contract.plugin import Method, methods
from qbuild.contract.step import OnUnavailable, Step, StepContext
from qbuild.contract.variant import VariantBase
from qbuild.models.checkpoint import QUANT_ALGO, linear_in_features

TOOLS = ("nvidia-modelopt", "torch", "transformers", "safetensors")

SCHEMES = ("fp8", "int8-sq", "int4-awq", "w4a8-awq", "nvfp4", "w4a8-mxfp4-fp8", "none")
FP4_SCHEMES = ("nvfp4", "w4a8-mxfp4-fp8")   # CUDA-only in ModelOpt 0.47; HF export only
# quant_algo that ModelOpt writes into hf_quant_config.json for the FP4 schemes (TensorRT-LLM's QuantAlgo names)
FP4_QUANT_ALGO = {"nvfp4": "NVFP4", "w4a8-mxfp4-fp8": "W4A8_MXFP4_FP8"}
FP4_GROUP_SIZE = {"nvfp4": 16, "w4a8-mxfp4-fp8": 32}   # elements per FP4 scale block along the input dim
AWQ_SCHEMES = ("int4-awq", "w4a8-awq")
AWQ_BLOCK_SIZES = (64, 128)  # group sizes TensorRT-LLM's weight-only/W4A8 AWQ kernels take
# HF model_type -> ModelOpt's TensorRT-LLM decoder_type, for the types whose checkpoint ModelOpt 0.37-0.47 writes
# without tensorrt_llm importable (the `modelopt` environment): convert_to_tensorrt_llm_config
# (modelopt/torch/export/tensorrt_llm_utils.py) raises NotImplementedError for any decoder but
# gpt/gemma/llama/qwen/mpt/recurrentgemma/dbrx/mllama/enc-dec. qwen checkpoints get qwen_type/attn_bias written
# by the checkpoint validation (qbuild/models/checkpoint.py).
DECODER_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen", "qwen3": "qwen", "gemma": "gemma",
                 "gpt2": "gpt"}
# decoder types ModelOpt recognises (and earlier qbuild offered) whose TensorRT-LLM checkpoint export raises there
EXPORT_RAISES = {"gemma2": "gemma2", "phi3": "phi3"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
FORMATS = {"trtllm-checkpoint": Format.TRTLLM_CHECKPOINT, "hf": Format.HF_MODELOPT}


class ModelOptVariant(VariantBase):
    """A model quantized by NVIDIA ModelOpt, exported for TensorRT-LLM."""

    method: Literal["modelopt"]
    scheme: Literal["fp8", "int8-sq", "int4-awq", "w4a8-awq", "nvfp4", "w4a8-mxfp4-fp8", "none"] = Field(
        description="fp8 (W8A8 FP8 per-tensor), int8-sq (INT8 SmoothQuant), int4-awq (W4A16 AWQ), "
        "w4a8-awq (INT4 weights, FP8 activations), nvfp4 (W4A4 NVFP4, 16-element blocks; needs a GPU), "
        "w4a8-mxfp4-fp8 (MXFP4 weights, FP8 activations; needs a GPU), none (unquantized export).")
    block_size: int | None = Field(
        None, description="AWQ group size along the input dimension (64 or 128; default 128). AWQ schemes only.")
    dtype: Literal["float16", "bfloat16"] = Field("float16", description="Dtype of the layers left unquantized.")
    export: Literal["trtllm-checkpoint", "hf"] | None = Field(
        None, description="trtllm-checkpoint: input of trtllm-build (tensorrt-llm target); "
        "hf: HF checkpoint + hf_quant_config.json (trtllm-pytorch target). Default: hf for nvfp4 and "
        "w4a8-mxfp4-fp8 (the only export offered for them), trtllm-checkpoint otherwise.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks of the TensorRT-LLM checkpoint.")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel ranks of the TensorRT-LLM checkpoint.")
    on_missing_gpu: Literal["fail", "skip"] = Field(
        "fail", description="nvfp4 / w4a8-mxfp4-fp8 without a GPU here: fail (exit 2 before any work) or skip this "
        "variant (and what needs it) and build the rest.")

    @model_validator(mode="after")
    def _block_size(self):
        if self.export is None:   # resolved here, so the key holds the export actually made
            object.__setattr__(self, "export", "hf" if self.scheme in FP4_SCHEMES else "trtllm-checkpoint")
        elif self.scheme in FP4_SCHEMES and self.export != "hf":
            raise ValueError(f"scheme {self.scheme} is exported as an HF checkpoint for TensorRT-LLM's PyTorch "
                             "backend only: use export: hf (or leave export unset)")
        if self.scheme in AWQ_SCHEMES:
            if self.block_size is None:
                object.__setattr__(self, "block_size", 128)
            elif self.block_size not in AWQ_BLOCK_SIZES:
                raise ValueError(f"block_size {self.block_size} is not supported; allowed: 64, 128")
        elif self.block_size is not None:
            raise ValueError(f"block_size applies to int4-awq and w4a8-awq only, not {self.scheme}")
        if self.export == "hf" and (self.tp_size, self.pp_size) != (1, 1):
            raise ValueError("tp_size/pp_size apply to export: trtllm-checkpoint; an hf export is sharded at load time")
        return self

    def needs_calibration(self) -> bool:
        return self.scheme != "none"

    def quant_params(self) -> dict:
        data = super().quant_params()
        data.pop("on_missing_gpu")   # what to do on this machine, not what the checkpoint is
        return data

    def describe(self) -> str:
        label = {"fp8": "FP8", "int8-sq": "INT8-SQ", "int4-awq": "INT4-AWQ", "w4a8-awq": "W4A8-AWQ",
                 "nvfp4": "NVFP4", "w4a8-mxfp4-fp8": "W4A8-MXFP4", "none": self.dtype}[self.scheme]
        return f"{label} g{self.block_size}" if self.block_size else label


@methods.register
class ModelOpt(Method):
    name = "modelopt"
    options = ModelOptVariant
    extra = "modelopt"
    requires = ("modelopt", "torch", "transformers")

    def check(self, variant: ModelOptVariant, ctx, field: str) -> None:
        info = ctx.model_info()
        model_type = info.get("model_type")
        if variant.export == "trtllm-checkpoint" and model_type in EXPORT_RAISES:
            raise RecipeError(f"{field}.export", f"ModelOpt's TensorRT-LLM checkpoint export raises NotImplementedError "
                              f"for {model_type} (decoder {EXPORT_RAISES[model_type]!r}) where tensorrt_llm is not "
                              "importable; use export: hf on this variant and a target of type: trtllm-pytorch "
                              "(TensorRT-LLM's PyTorch backend loads the HF checkpoint)")
        if variant.export == "trtllm-checkpoint" and model_type not in DECODER_TYPES:
            raise RecipeError(f"{field}.export", f"ModelOpt's TensorRT-LLM export does not map model_type "
                              f"{model_type!r}; supported: {', '.join(sorted(DECODER_TYPES))} (or use export: hf)")
        if variant.block_size:
            dims = linear_in_features(info)
            bad = {name: d for name, d in dims.items() if d % variant.block_size}
            if bad:
                fits = [b for b in AWQ_BLOCK_SIZES if all(d % b == 0 for d in dims.values())]
                what = ", ".join(f"{n} = {d}" for n, d in bad.items())
                allowed = ", ".join(map(str, fits)) if fits else "none of " + ", ".join(map(str, AWQ_BLOCK_SIZES))
                raise RecipeError(f"{field}.block_size", f"{variant.block_size} does not divide {what}; "
                                  f"block sizes that fit this model: {allowed}")
        heads = info.get("num_attention_heads", 1)
        kv = info.get("num_key_value_heads") or heads
        if variant.tp_size > 1 and (heads % variant.tp_size or kv % variant.tp_size):
            raise RecipeError(f"{field}.tp_size", f"{variant.tp_size} does not divide num_attention_heads={heads} "
                              f"and num_key_value_heads={kv}")
        if variant.pp_size > info.get("num_hidden_layers", 1):
            raise RecipeError(f"{field}.pp_size", f"{variant.pp_size} exceeds num_hidden_layers={info.get('num_hidden_layers')}")

    def plan(self, variant: ModelOptVariant, ctx) -> Step:
        model = ctx.model()
        inputs = {"model": model}
        if variant.needs_calibration():
            inputs["calibration"] = ctx.calibration()
        gpu = {}
        if variant.scheme in FP4_SCHEMES:
            why = "" if trtllm_env.gpu() else (f"needs a CUDA GPU: ModelOpt {_modelopt_version()} fake-quantizes "
                                               f"{variant.scheme} only on CUDA; none found here (nvidia-smi)")
            gpu = {"requires_gpu": True, "unavailable": why, "on_unavailable": OnUnavailable(variant.on_missing_gpu)}
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            "qbuild.quantize.modelopt:run", inputs=inputs, tools=TOOLS, threads=ctx.threads,
                            variant=variant.name, format=FORMATS[variant.export], scheme=variant.scheme,
                            memory="whole-model", **gpu))


def _modelopt_version() -> str:
    from qbuild.base.fingerprint import package_version

    return package_version("nvidia-modelopt")


# --- worker side ------------------------------------------------------------------------------------
def quant_config(params: dict) -> dict:
    """ModelOpt's preset for the scheme, with the AWQ block size applied."""
    import copy

    import modelopt.torch.quantization as mtq

    preset = {"fp8": mtq.FP8_DEFAULT_CFG, "int8-sq": mtq.INT8_SMOOTHQUANT_CFG, "int4-awq": mtq.INT4_AWQ_CFG,
              "w4a8-awq": mtq.W4A8_AWQ_BETA_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG,
              "w4a8-mxfp4-fp8": mtq.W4A8_MXFP4_FP8_CFG}[params["scheme"]]
    cfg = copy.deepcopy(preset)
    if params.get("block_size"):
        entries = cfg["quant_cfg"]
        for entry in entries if isinstance(entries, list) else entries.values():
            attrs = entry.get("cfg", entry) if isinstance(entry, dict) else entry
            for attr in attrs if isinstance(attrs, list) else [attrs]:
                if isinstance(attr, dict) and isinstance(attr.get("block_sizes"), dict):
                    attr["block_sizes"][-1] = params["block_size"]
    return cfg


def run(ctx: StepContext) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from qbuild.models.checkpoint import validate_hf_export, validate_trtllm_checkpoint

    p = ctx.params
    src = Path(ctx.inputs["model"])
    src_cfg = json.loads((src / "config.json").read_text())
    ctx.progress(0, 3, "loading model")
    if p["scheme"] in FP4_SCHEMES:   # CUDA-only in ModelOpt; calibrate in the export dtype (memory)
        device, load_dtype = "cuda", getattr(torch, p["dtype"])
    else:
        device, load_dtype = "cpu", torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=load_dtype).to(device).eval()
    if p["scheme"] != "none":
        import modelopt.torch.quantization as mtq

        from qbuild.calibration.build import load_calibration

        ids, mask = load_calibration(Path(ctx.inputs["calibration"]))
        n = len(ids)

        def forward_loop(m):
            for i in range(n):
                m(input_ids=torch.from_numpy(ids[i: i + 1]).long().to(device),
                  attention_mask=torch.from_numpy(mask[i: i + 1]).long().to(device))
                ctx.progress(i + 1, n, f"calibrating {p['scheme']}")

        with torch.no_grad():
            model = mtq.quantize(model, quant_config(p), forward_loop)
    dtype = getattr(torch, p["dtype"])
    ctx.progress(1, 3, f"exporting {p['export']}")
    with torch.no_grad():
        if p["export"] == "trtllm-checkpoint":
            from modelopt.torch.export import export_tensorrt_llm_checkpoint

            export_tensorrt_llm_checkpoint(model, DECODER_TYPES[src_cfg["model_type"]], dtype=dtype,
                                           export_dir=str(ctx.out), inference_tensor_parallel=p["tp_size"],
                                           inference_pipeline_parallel=p["pp_size"])
        else:
            from modelopt.torch.export import export_hf_checkpoint

            export_hf_checkpoint(model.to(dtype), export_dir=str(ctx.out))
    for name in TOKENIZER_FILES:  # the engine/runtime needs the tokenizer next to the weights
        if (src / name).is_file() and not (ctx.out / name).exists():
            shutil.copyfile(src / name, ctx.out / name)
    ctx.progress(2, 3, "validating against the source model")
    if p["export"] == "trtllm-checkpoint":
        fixes = validate_trtllm_checkpoint(ctx.out, src_cfg, quant_algo=QUANT_ALGO[p["scheme"]],
                                           group_size=p.get("block_size"), tp_size=p["tp_size"], pp_size=p["pp_size"])
    else:
        fixes = validate_hf_export(ctx.out, src_cfg)
        if p["scheme"] in FP4_SCHEMES:
            check_fp4_export(ctx.out, p["scheme"])
    for f in fixes:
        ctx.log(f"fixed {f['field']}: {f['was']!r} -> {f['now']!r} ({f['why']})")
    ctx.progress(3, 3, "done")
    from importlib.metadata import version

    size = sum(f.stat().st_size for f in ctx.out.rglob("*") if f.is_file())
    algo = FP4_QUANT_ALGO.get(p["scheme"]) or QUANT_ALGO[p["scheme"]]
    return {"format": FORMATS[p["export"]], "metrics": {"size_bytes": size},
            "info": {"quant_algo": algo, "device": device, "checkpoint_fixes": fixes,
                     "validated_against_source": True, "modelopt": version("nvidia-modelopt")}}


def check_fp4_export(ckpt: Path, scheme: str) -> dict:
    """The export declares what TensorRT-LLM's PyTorch backend will run: quant_algo and block size (raises if not)."""
    hfq = ckpt / "hf_quant_config.json"
    if not hfq.is_file():
        raise ValueError(f"{scheme} export has no hf_quant_config.json: TensorRT-LLM could not tell it is quantized")
    quant = json.loads(hfq.read_text()).get("quantization") or {}
    want_algo, want_group = FP4_QUANT_ALGO[scheme], FP4_GROUP_SIZE[scheme]
    if quant.get("quant_algo") != want_algo or quant.get("group_size") != want_group:
        raise ValueError(f"{scheme} export declares quant_algo {quant.get('quant_algo')!r}, group_size "
                         f"{quant.get('group_size')!r}; TensorRT-LLM expects {want_algo!r}, {want_group}")
    return quant
