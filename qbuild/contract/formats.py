"""Artifact formats, declared once: what each one is, which runtimes evaluate it, which serving engines load it
and with what command.

A format's declaration names the runtimes that read it (`evaluated_by`, in order of preference;
runtimes_for asks it), so a method that writes a new format transformers or llama.cpp
can read declares it in its own module (`register_format`) and is evaluated, summarised and reported
like the built-in ones, with no runtime of its own; a format nothing reads is shown as "not evaluated:
no runtime for FORMAT". `load_commands` gives the model card's command per engine.

Which engines load an artifact depends on its quantization, not only its format (vLLM reads 4- and
8-bit compressed-tensors, not 3-bit; TensorRT-LLM's PyTorch backend reads dynamic FP8, not static):
`LOADS_IN`, one row per (format, scheme), is the one table that says so. Every model artifact's
manifest records `loads_in` from it when the artifact is built, and `qbuild show` prints it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qbuild.contract.plugin import Runtime


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
    loads_in: tuple[str, ...] = ()     # a plugin format's engines, for any scheme (becomes its LOADS_IN row)
    # where engines differ by scheme: (scheme, engines) rows, each its own LOADS_IN row (loads_in: the other schemes)
    loads_in_by_scheme: tuple[tuple[str, tuple[str, ...]], ...] = ()
    load_tools: tuple[str, ...] = ()   # distributions a runtime needs to read it: they enter evaluation keys
    eval_env: str | None = None        # backend environment (qbuild.contract.envs) its evaluation runs in; None: qbuild's
    evaluated_by: tuple[str, ...] = ()  # runtimes (qbuild.contract.plugin) that read it, preferred first
    # engine → how to load it, for the model card: `{dir}` the artifact's folder, `{file}` its model file. Engines not
    # named here use HF_LOAD_COMMANDS (a Hugging Face checkpoint folder)
    load_commands: tuple[tuple[str, str], ...] = ()


FORMATS: dict[str, FormatSpec] = {}


def register_format(spec: FormatSpec) -> FormatSpec:
    known = FORMATS.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"format {spec.name!r} is already declared differently")
    FORMATS[spec.name] = spec
    if spec.loads_in:
        LOADS_IN.setdefault((spec.name, ANY), spec.loads_in)
    for scheme, engines in spec.loads_in_by_scheme:
        LOADS_IN.setdefault((spec.name, scheme), tuple(engines))
    return spec


_plugins_loaded = False


def _load_plugin_formats() -> None:
    """Methods declare their own formats in their modules: load the plugin modules once, through the registries
    (qbuild.contract.plugin, which never imports this module)."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        from qbuild.contract.plugin import load_all

        load_all()


def spec(name: str) -> FormatSpec:
    """The declaration of a format; an undeclared one is a model format nothing is known about."""
    if name not in FORMATS:
        _load_plugin_formats()
    return FORMATS.get(name) or FormatSpec(name, "undeclared format")


# --- which engines load an artifact ----------------------------------------------------------------------------
# Engine names as manifests record them. trtllm-pytorch: TensorRT-LLM's PyTorch backend (trtllm-serve, the path
# after 1.2.x); tensorrt-llm: its TensorRT engine runtime (1.2.x); trtllm-build: not an engine, the builder that
# reads a TensorRT-LLM checkpoint.
ENGINES = ("vllm", "sglang", "tgi", "lmdeploy", "transformers", "llama.cpp", "trtllm-pytorch", "tensorrt-llm",
           "exllamav2", "trtllm-build")
ANY = "*"   # the row for every scheme of a format that has no row of its own

_HF = ("vllm", "sglang", "tgi", "lmdeploy", "transformers", "trtllm-pytorch")
# vLLM and SGLang (CompressedTensorsWNA16) and TGI (WNA16Loader) take 4- and 8-bit integer weights, with or without
# zero points; LMDeploy's TurboMind reads llm-compressor W4A16 only at group sizes 32 and 128, so it is left out
_CT_INT = ("vllm", "sglang", "tgi", "transformers")
# GGUF: llama.cpp reads every type it writes. vLLM's and SGLang's GGUF kernels and gguf-py's dequantizers (what
# transformers loads GGUF through) cover F32/F16/BF16, Q4_0..Q8_0, the K-quants and the I-quants, not the ternary,
# 1-/2-bit Q1_0/Q2_0 or FP4 types.
_GGUF_WIDE = ("llama.cpp", "vllm", "sglang", "transformers")
_GGUF_WIDE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q2_K", "Q2_K_S", "Q3_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K", "Q4_K_S", "Q4_K_M",
                    "Q5_K", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
                    "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS")

# One row per (format, scheme): the engines that load *every* artifact the row covers. An engine that loads only
# some of them (a group size, a GPU generation) is left out, never guessed. GGUF rows name both llama-quantize's
# file types (Q4_K_M) and the tensor types inside a file (Q4_K): a GGUF loads where all of its tensor types load.
LOADS_IN: dict[tuple[str, str], tuple[str, ...]] = {
    (Format.HF, ANY): _HF,
    (Format.COMPRESSED_TENSORS, "w4a16"): _CT_INT,
    (Format.COMPRESSED_TENSORS, "w8a16"): _CT_INT,
    (Format.COMPRESSED_TENSORS, "w3a16"): ("transformers",),   # the serving kernels take 4 and 8 bits only
    (Format.COMPRESSED_TENSORS, "w2a16"): ("transformers",),
    # W8A8 INT8 (SmoothQuant + RTN/GPTQ): vLLM's int8 scaled-mm kernels (CUDA, and CPUInt8ScaledMMLinearKernel in its
    # CPU build, served here) and SGLang's CompressedTensorsW8A8Int8
    (Format.COMPRESSED_TENSORS, "w8a8-int8"): ("vllm", "sglang", "transformers"),
    (Format.COMPRESSED_TENSORS, "fp8-dynamic"): ("vllm", "sglang", "tgi", "transformers", "trtllm-pytorch"),
    (Format.COMPRESSED_TENSORS, "fp8-static"): ("vllm", "sglang", "tgi", "transformers"),  # PyTorch backend: no
    (Format.COMPRESSED_TENSORS, ANY): ("transformers",),         # transformers decompresses any scheme
    # GPTQ format (gptqmodel) and AutoAWQ GEMM layout: as their methods declared them, for every scheme
    (Format.GPTQ, ANY): ("vllm", "sglang", "tgi", "lmdeploy", "transformers", "exllamav2"),
    (Format.AWQ, ANY): ("vllm", "sglang", "tgi", "lmdeploy", "transformers"),
    (Format.HF_MODELOPT, "fp8"): ("trtllm-pytorch", "vllm", "sglang"),
    (Format.HF_MODELOPT, "int4-awq"): ("trtllm-pytorch",),
    (Format.HF_MODELOPT, "w4a8-awq"): ("trtllm-pytorch",),
    (Format.HF_MODELOPT, "none"): ("trtllm-pytorch",),
    (Format.HF_MODELOPT, ANY): (),                               # int8-sq HF exports: no engine known to read them
    **{(Format.GGUF, t): _GGUF_WIDE for t in _GGUF_WIDE_TYPES},
    (Format.GGUF, ANY): ("llama.cpp",),                          # TQ1_0/TQ2_0, Q1_0, Q2_0, MXFP4, NVFP4
    (Format.TRTLLM_CHECKPOINT, ANY): ("trtllm-build",),
    (Format.TRTLLM_ENGINE, ANY): ("tensorrt-llm",),              # on the SM and TensorRT-LLM version it was built for
    (Format.TRTLLM_PYTORCH, ANY): ("trtllm-pytorch",),
}


# How each engine loads a Hugging Face checkpoint folder; a format's own `load_commands` take precedence.
HF_LOAD_COMMANDS: dict[str, str] = {
    "vllm": "`vllm serve {dir}`",
    "sglang": "`python -m sglang.launch_server --model-path {dir}`",
    "tgi": "`text-generation-launcher --model-id {dir}`",
    "lmdeploy": "`lmdeploy serve api_server {dir}`",
    "transformers": "`AutoModelForCausalLM.from_pretrained('{dir}')`",
    "trtllm-pytorch": "`trtllm-serve {dir}` (PyTorch backend)",
    "exllamav2": "load `{dir}` with ExLlamaV2's model loader (GPTQ format)",
}
# transformers and vLLM read every HF-folder format here (vLLM: on a GPU, where transformers cannot); a method
# module that declares its own HF-folder format (bitsandbytes, auto-round) names them too
HF_RUNTIMES = ("transformers", "vllm")
_HF_RUNTIMES = HF_RUNTIMES

for _spec in (
    FormatSpec(Format.HF, "Hugging Face checkpoint (safetensors + config.json)", evaluated_by=_HF_RUNTIMES),
    FormatSpec(Format.COMPRESSED_TENSORS, "HF checkpoint with compressed-tensors quantization (llm-compressor)",
               load_tools=("compressed-tensors",), evaluated_by=_HF_RUNTIMES),
    FormatSpec(Format.GPTQ, "GPTQ-format HF checkpoint (quantize_config.json, v1 packing; gptqmodel)",
               load_tools=("gptqmodel", "optimum"), eval_env="gptqmodel", evaluated_by=_HF_RUNTIMES,
               load_commands=(("lmdeploy", "`lmdeploy serve api_server {dir} --model-format gptq`"),)),
    FormatSpec(Format.AWQ, "HF checkpoint in AutoAWQ's GEMM layout (4-bit, grouped, zero points; quant_method awq)",
               load_tools=("gptqmodel",), eval_env="gptqmodel",   # transformers 5 reads AWQ through gptqmodel
               evaluated_by=_HF_RUNTIMES,
               load_commands=(("lmdeploy", "`lmdeploy serve api_server {dir} --model-format awq`"),)),
    FormatSpec(Format.HF_MODELOPT, "HF checkpoint exported by NVIDIA ModelOpt (hf_quant_config.json)",
               evaluated_by=("vllm",),
               load_commands=(("vllm", "`vllm serve {dir} --quantization modelopt`"),
                              ("sglang", "`python -m sglang.launch_server --model-path {dir} --quantization modelopt`"))),
    FormatSpec(Format.GGUF, "llama.cpp GGUF file", evaluated_by=("llama.cpp",),
               load_commands=(("llama.cpp", "`llama-server -m {dir}/{file}`"),
                              ("vllm", "`vllm serve {dir}/{file} --tokenizer BASE_MODEL` (experimental GGUF loader)"),
                              ("transformers", "`AutoModelForCausalLM.from_pretrained('{dir}', gguf_file='{file}')` "
                                               "(dequantizes to full precision)"))),
    FormatSpec(Format.TRTLLM_CHECKPOINT, "TensorRT-LLM checkpoint (input of trtllm-build)",
               load_commands=(("trtllm-build", "build an engine first: `trtllm-build --checkpoint_dir {dir}`"),)),
    FormatSpec(Format.TRTLLM_ENGINE, "TensorRT-LLM engine (TensorRT backend, 1.2.x)", evaluated_by=("tensorrt-llm",),
               load_commands=(("tensorrt-llm", "`trtllm-serve {dir} --tokenizer BASE_MODEL`"),)),
    FormatSpec(Format.TRTLLM_PYTORCH, "checkpoint packaged for TensorRT-LLM's PyTorch backend",
               load_commands=(("trtllm-pytorch",
                               "`trtllm-serve {dir} --extra_llm_api_options {dir}/extra_llm_api_options.yaml`"),)),
    FormatSpec(Format.CALIBRATION, "tokenized calibration set", model=False),
    FormatSpec(Format.TOKENS, "tokenized evaluation text", model=False),
    FormatSpec(Format.METRICS, "evaluation results", model=False),
    FormatSpec(Format.LOGPROBS, "reference log-probabilities of the baseline on the evaluation tokens", model=False),
    FormatSpec(Format.IMATRIX, "llama.cpp importance matrix", model=False),
):
    register_format(_spec)



def load_command(fmt: str, engine: str, directory: str, file: str = "") -> str | None:
    """How `engine` loads an artifact of `fmt` in `directory` (model file `file`), for the model card; None where
    nothing is declared."""
    s = spec(fmt)
    template = dict(s.load_commands).get(engine) or HF_LOAD_COMMANDS.get(engine)
    if template is None:
        return None
    command = template.format(dir=directory, file=file)
    if engine == "transformers" and s.load_tools and "{file}" not in template:
        command += f" (needs the {s.load_tools[0]} package)"
    return command


def _row(fmt: str, scheme: str | None) -> tuple[str, ...]:
    spec(fmt)   # a format a plugin module declares: its row exists once the module is loaded
    return LOADS_IN.get((fmt, scheme or ANY), LOADS_IN.get((fmt, ANY), ()))


def loads_in(fmt: str, scheme: str | None = None, parts: Iterable[str] = ()) -> tuple[str, ...]:
    """The engines that load an artifact of `fmt` quantized as `scheme`. `parts`: the types its tensors really
    have (a GGUF's tensor types, mixes and fallbacks included); each narrows the answer to the engines that read
    it too."""
    engines = _row(fmt, scheme)
    for part in parts:
        engines = tuple(e for e in engines if e in _row(fmt, part))
    return engines


def engines_for_format(fmt: str) -> tuple[str, ...]:
    """Every engine that loads some artifact of `fmt` (for `qbuild plugins`), in ENGINES order."""
    found = {e for (f, _), engines in LOADS_IN.items() if f == fmt for e in engines}
    return tuple([e for e in ENGINES if e in found] + sorted(found - set(ENGINES)))


def manifest_loads_in(fmt: str, scheme: str | None, info: dict | None) -> list[str] | None:
    """`loads_in` for an artifact's manifest: None for data (calibration sets, metrics ...), which no engine loads.
    `info["part_types"]`, where a runner records it, lists the types some tensors have besides the scheme's (a
    GGUF's per-tensor overrides)."""
    if not spec(fmt).model:
        return None
    return list(loads_in(fmt, scheme, (info or {}).get("part_types") or ()))


def runtimes_for(fmt: str) -> list[Runtime]:
    """Registered runtimes that evaluate `fmt`: those its declaration names (`evaluated_by`), then any runtime that
    names it in its own `formats`; installed ones first, fallbacks after the others (declaration order otherwise)."""
    from qbuild.contract.plugin import runtimes

    declared = [runtimes.get(n) for n in spec(fmt).evaluated_by if n in runtimes]
    found = declared + [r for r in runtimes.all() if fmt in r.formats and r not in declared]
    return sorted(found, key=lambda r: (bool(r.missing()), r.fallback))
