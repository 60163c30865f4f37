"""Artifact formats, declared once: what each one is and which serving engines load it.

Which runtime can *evaluate* a format is declared by the runtimes themselves (`Runtime.formats`,
qbuild/plugins.py); `runtimes_for()` asks them. Evaluation planning, the summary and `qbuild plan`
use this module only, so a new format (from a plugin: `register_format`) is evaluated, summarised
and reported like the built-in ones, or shown as "not evaluated: no runtime for FORMAT".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Format(StrEnum):
    HF = "hf"                                   # a plain Hugging Face checkpoint (the baseline)
    COMPRESSED_TENSORS = "compressed-tensors"   # llm-compressor's output: HF dir + compressed-tensors config
    AWQ = "awq"                                 # AutoAWQ GEMM layout: HF dir with qweight/qzeros/scales, quant_method awq
    HF_MODELOPT = "hf-modelopt"                 # ModelOpt's HF export (hf_quant_config.json)
    GPTQ = "gptq"                               # GPTQ format (quantize_config.json, v1 packing): gptqmodel's output
    GGUF = "gguf"                               # one llama.cpp .gguf file
    TRTLLM_CHECKPOINT = "trtllm-checkpoint"     # config.json + rank<N>.safetensors, input of trtllm-build
    TRTLLM_ENGINE = "trtllm-engine"             # a TensorRT engine dir (TensorRT-LLM 1.2.x)
    TRTLLM_PYTORCH = "trtllm-pytorch"           # checkpoint + extra_llm_api_options.yaml (PyTorch backend)
    BITSANDBYTES = "bitsandbytes"               # HF dir, quant_method bitsandbytes (NF4/FP4 or LLM.int8)
    AUTO_ROUND = "auto-round"                   # HF dir, quant_method auto-round (AutoRound's own export)
    # data, not models: never evaluated or summarised as a variant
    CALIBRATION = "calibration"
    TOKENS = "tokens"
    METRICS = "metrics"
    LOGPROBS = "logprobs"                       # a baseline's reference log-probabilities (KLD)
    IMATRIX = "imatrix"


@dataclass(frozen=True)
class FormatSpec:
    name: str
    description: str
    model: bool = True                 # a model artifact: evaluated and given a summary row
    loads_in: tuple[str, ...] = ()     # serving engines / libraries that load it
    load_tools: tuple[str, ...] = ()   # distributions a runtime needs to read it: they enter evaluation keys
    eval_env: str | None = None        # backend environment (qbuild.envs) its evaluation runs in; None: qbuild's


FORMATS: dict[str, FormatSpec] = {}


def register_format(spec: FormatSpec) -> FormatSpec:
    known = FORMATS.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"format {spec.name!r} is already declared differently")
    FORMATS[spec.name] = spec
    return spec


def spec(name: str) -> FormatSpec:
    """The declaration of a format; an undeclared one is a model format nothing is known about."""
    return FORMATS.get(name) or FormatSpec(name, "undeclared format")


for _spec in (
    FormatSpec(Format.HF, "Hugging Face checkpoint (safetensors + config.json)",
               loads_in=("transformers", "vllm", "sglang", "tgi", "lmdeploy", "trtllm-pytorch")),
    FormatSpec(Format.COMPRESSED_TENSORS, "HF checkpoint with compressed-tensors quantization (llm-compressor)",
               loads_in=("vllm", "sglang", "transformers"), load_tools=("compressed-tensors",)),
    FormatSpec(Format.GPTQ, "GPTQ-format HF checkpoint (quantize_config.json, v1 packing; gptqmodel)",
               loads_in=("vllm", "sglang", "tgi", "lmdeploy", "transformers", "exllamav2"),
               load_tools=("gptqmodel", "optimum"), eval_env="gptqmodel"),
    FormatSpec(Format.AWQ, "HF checkpoint in AutoAWQ's GEMM layout (4-bit, grouped, zero points; quant_method awq)",
               loads_in=("vllm", "sglang", "tgi", "lmdeploy", "transformers"),
               load_tools=("gptqmodel",), eval_env="gptqmodel"),   # transformers 5 reads AWQ through gptqmodel
    FormatSpec(Format.HF_MODELOPT, "HF checkpoint exported by NVIDIA ModelOpt (hf_quant_config.json)",
               loads_in=("trtllm-pytorch", "vllm", "sglang")),
    FormatSpec(Format.GGUF, "llama.cpp GGUF file", loads_in=("llama.cpp", "ollama", "lm-studio")),
    FormatSpec(Format.TRTLLM_CHECKPOINT, "TensorRT-LLM checkpoint (input of trtllm-build)",
               loads_in=("trtllm-build",)),
    FormatSpec(Format.TRTLLM_ENGINE, "TensorRT-LLM engine (TensorRT backend, 1.2.x)", loads_in=("tensorrt-llm",)),
    FormatSpec(Format.TRTLLM_PYTORCH, "checkpoint packaged for TensorRT-LLM's PyTorch backend",
               loads_in=("trtllm-serve", "tensorrt-llm")),
    FormatSpec(Format.BITSANDBYTES, "HF checkpoint with serialized bitsandbytes weights (NF4/FP4 or LLM.int8)",
               loads_in=("transformers", "vllm"), load_tools=("bitsandbytes",)),
    FormatSpec(Format.AUTO_ROUND, "HF checkpoint in AutoRound's format (quant_method auto-round)",
               loads_in=("transformers", "vllm", "sglang"), load_tools=("auto-round",)),
    FormatSpec(Format.CALIBRATION, "tokenized calibration set", model=False),
    FormatSpec(Format.TOKENS, "tokenized evaluation text", model=False),
    FormatSpec(Format.METRICS, "evaluation results", model=False),
    FormatSpec(Format.LOGPROBS, "reference log-probabilities of the baseline on the evaluation tokens", model=False),
    FormatSpec(Format.IMATRIX, "llama.cpp importance matrix", model=False),
):
    register_format(_spec)
