"""The modelopt method's options: the variant's schema (ModelOptVariant) and ModelOpt's scheme tables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from qbuild.plugins import FormatSpec, VariantBase, register_format

TOOLS = ("nvidia-modelopt", "torch", "transformers", "safetensors")

SCHEMES = ("fp8", "int8-sq", "int4-awq", "w4a8-awq", "nvfp4", "w4a8-mxfp4-fp8", "none")
FP4_SCHEMES = ("nvfp4", "w4a8-mxfp4-fp8")   # CUDA-only in ModelOpt 0.47; HF export only
# quant_algo that ModelOpt writes into hf_quant_config.json for the FP4 schemes (TensorRT-LLM's QuantAlgo names)
FP4_QUANT_ALGO = {"nvfp4": "NVFP4", "w4a8-mxfp4-fp8": "W4A8_MXFP4_FP8"}
FP4_GROUP_SIZE = {"nvfp4": 16, "w4a8-mxfp4-fp8": 32}   # elements per FP4 scale block along the input dim
AWQ_SCHEMES = ("int4-awq", "w4a8-awq")
# schemes whose calibration only observes (amax), never rewrites a weight: with the HF export, ModelOpt 0.47 calibrates
# a model accelerate offloaded to disk and exports it a layer at a time (export_hf_checkpoint's streaming path).
# SmoothQuant and AWQ rescale weights, and ModelOpt keeps a rewritten disk-offloaded weight in host memory, so for them
# offloading bounds nothing; the FP4 schemes run on CUDA, untried with offload here.
OFFLOADABLE_SCHEMES = ("fp8", "none")
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
# ModelOpt's two exports. Its HF export (hf_quant_config.json): TensorRT-LLM's PyTorch backend loads the schemes
# below, vLLM and SGLang its FP8; no engine is known to read its int8-sq HF export (no row: nothing for any scheme).
HF_MODELOPT = register_format(FormatSpec(
    "hf-modelopt", "HF checkpoint exported by NVIDIA ModelOpt (hf_quant_config.json)", evaluated_by=("vllm",),
    loads_in_by_scheme=(("fp8", ("trtllm-pytorch", "vllm", "sglang")),
                        ("int4-awq", ("trtllm-pytorch",)),
                        ("w4a8-awq", ("trtllm-pytorch",)),
                        ("none", ("trtllm-pytorch",))),
    load_commands=(("vllm", "`vllm serve {dir} --quantization modelopt`"),
                   ("sglang", "`python -m sglang.launch_server --model-path {dir} --quantization modelopt`")))).name
# Its TensorRT-LLM checkpoint (config.json + rank<N>.safetensors): the input of trtllm-build (the tensorrt-llm target)
TRTLLM_CHECKPOINT = register_format(FormatSpec(
    "trtllm-checkpoint", "TensorRT-LLM checkpoint (input of trtllm-build)", loads_in=("trtllm-build",),
    load_commands=(("trtllm-build", "build an engine first: `trtllm-build --checkpoint_dir {dir}`"),))).name
FORMATS = {"trtllm-checkpoint": TRTLLM_CHECKPOINT, "hf": HF_MODELOPT}


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
