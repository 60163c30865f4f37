"""The gguf method's options: the variant's schema (GGUFVariant, TensorType) and llama.cpp's type tables (the types
llama-quantize offers, block sizes and fallbacks), written out so that planning imports nothing of llama.cpp."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from qbuild.plugins import FormatSpec, StrictModel, VariantBase, register_format
from qbuild.quantize.gguf.search_options import GGUFSearch

TOOLS = ("llama-cpp-python",)
CONVERT_TOOLS = ("llama-cpp-python", "torch", "transformers", "safetensors")
IMATRIX_TOOLS = ("llama-cpp-python", "tokenizers", "transformers", "safetensors", "gguf")   # + the llama-imatrix build id
IMATRIX_IMPL = 2   # 2: llama-imatrix (1 was torch hooks on the HF model: other numbers, so another key)
IMATRIX_FILE = "imatrix.safetensors"
IMATRIX_REF = "imatrix"   # the imatrix's ref: RECIPE/imatrix[-<convert_type>]:TAG (qbuild ls / show / pull)

# The format this method writes: one llama.cpp .gguf file. llama.cpp reads every type it writes; vLLM's and SGLang's
# GGUF kernels and gguf-py's dequantizers (what transformers loads GGUF through) cover F32/F16/BF16, Q4_0..Q8_0, the
# K-quants and the I-quants, not the ternary, 1-/2-bit Q1_0/Q2_0 or FP4 types. The rows name both llama-quantize's
# file types (Q4_K_M) and the tensor types inside a file (Q4_K): a GGUF loads where all of its tensor types load.
_WIDELY_LOADED = ("llama.cpp", "vllm", "sglang", "transformers")
_WIDELY_LOADED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                        "Q2_K", "Q2_K_S", "Q3_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K", "Q4_K_S", "Q4_K_M",
                        "Q5_K", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
                        "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS")
FORMAT = register_format(FormatSpec(
    "gguf", "llama.cpp GGUF file", evaluated_by=("llama.cpp",),
    loads_in=("llama.cpp",),                       # the other types: TQ1_0/TQ2_0, Q1_0, Q2_0, MXFP4, NVFP4
    loads_in_by_scheme=tuple((t, _WIDELY_LOADED) for t in _WIDELY_LOADED_TYPES),
    load_commands=(("llama.cpp", "`llama-server -m {dir}/{file}`"),
                   ("vllm", "`vllm serve {dir}/{file} --tokenizer BASE_MODEL` (experimental GGUF loader)"),
                   ("transformers", "`AutoModelForCausalLM.from_pretrained('{dir}', gguf_file='{file}')` "
                                    "(dequantizes to full precision)")))).name
# the importance matrix the imatrix step writes: data (shared by a model's GGUF variants), not a model
IMATRIX_FORMAT = register_format(FormatSpec("imatrix", "llama.cpp importance matrix", model=False)).name

# Every type llama-quantize offers in the pinned llama.cpp (tools/quantize/quantize.cpp QUANT_OPTIONS: the
# llama_ftype names without LLAMA_FTYPE_MOSTLY_; tests/test_plan_checks.py checks this against the installed
# llama_cpp). Left out: COPY (copies tensors unchanged; the converter already wrote them) and NVFP4, which
# llama_model_quantize cannot produce (llama_ftype_get_default_type has no case for it; it is only converted).
TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q1_0", "Q2_0", "MXFP4_MOE",
    "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
)
TYPE_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}   # llama-quantize's own aliases
OUTPUT_FILE = "model.gguf"
# llama-quantize refuses these without an importance matrix (quality collapses)
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K_S")
# ggml tensor types llama.cpp can quantize a tensor to (ggml_quantize_chunk), for per-tensor overrides and
# output/embedding types; checked against the installed llama_cpp's GGML_TYPE_* by the tests
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q1_0", "Q2_0", "Q2_K", "Q3_K", "Q4_K",
                "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
                "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")
TENSOR_NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S")
# The fields of the pinned llama.cpp's llama_model_quantize_params: none targets a file size or bits per weight
# (dry_run only reports the size a type would give), so a size target is qbuild's own search (gguf/search.py).
QUANTIZE_PARAMS = ("nthread", "ftype", "output_tensor_type", "token_embedding_type", "allow_requantize",
                   "quantize_output_tensor", "only_copy", "pure", "keep_split", "dry_run", "imatrix", "kv_overrides",
                   "tt_overrides", "prune_layers", "max_buf_size")
NO_SIZE_TARGET = ("llama.cpp has no size or bits-per-weight target; use search: {max_size_mb: N} or "
                  "search: {max_bpw: N} (and no type): qbuild picks per-tensor types by measured KL divergence")

# The type each llama_ftype quantizes to by default (llama.cpp src/llama-quant.cpp, llama_ftype_get_default_type)
# and what a tensor whose row does not fit that type's blocks gets instead (tensor_type_fallback): llama.cpp
# exposes neither through its C API, so these mirror the pinned source; a type absent from FALLBACK with blocks
# wider than 32 columns has no fallback and the quantization aborts.
DEFAULT_TENSOR_TYPE = {
    "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S", "IQ3_XS": "IQ3_S", "IQ3_M": "IQ3_S",
    "MXFP4_MOE": "MXFP4",
}
FALLBACK = {**dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), "IQ4_NL"),
            **dict.fromkeys(("Q2_0", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0"), "Q4_0"),
            "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _tensor_type(v: str | None) -> str | None:
    if v is None:
        return None
    up = v.upper()
    if up not in TENSOR_TYPES:
        raise ValueError(f"{v!r} is not a ggml tensor type; allowed: {', '.join(TENSOR_TYPES)}")
    return up


class TensorType(StrictModel):
    """Quantize the tensors whose GGUF name matches `pattern` (a regex, searched) to `type`."""

    pattern: str = Field(description="Regex on GGUF tensor names, e.g. 'ffn_down' or 'blk\\.(0|1)\\.'.")
    type: str = Field(description="ggml tensor type, e.g. Q8_0, Q6_K, F16.")

    @field_validator("pattern")
    @classmethod
    def _regex(cls, v: str) -> str:
        import re

        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a valid regex: {exc}") from None
        return v

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        return _tensor_type(v)


class GGUFVariant(VariantBase):
    """A GGUF file of one llama.cpp quantization type, or per-tensor types searched for a budget (`search:`)."""

    method: Literal["gguf"]
    type: str | None = Field(None, description="llama.cpp quantization type, e.g. F16, Q8_0, Q4_K_M, IQ4_XS "
                                                "(required unless `search` is given).")
    search: GGUFSearch | None = Field(
        None, description="Reach a size, bits-per-weight or KLD budget with per-tensor types chosen from measured KL "
                          "divergence (docs/mixed-precision.md); replaces `type`.")
    convert_type: Literal["f32", "f16", "bf16"] = Field(
        "f16", description="Type of the intermediate GGUF written by convert_hf_to_gguf.py before quantizing."
    )
    imatrix: bool | None = Field(
        None, description="Use an importance matrix computed from the shared calibration set. "
                          f"Default: only for the types that need one ({', '.join(NEEDS_IMATRIX)}).")
    output_type: str | None = Field(None, description="ggml type of output.weight (llama-quantize --output-tensor-type).")
    embedding_type: str | None = Field(None, description="ggml type of token_embd.weight (--token-embedding-type).")
    tensor_types: list[TensorType] = Field(
        default_factory=list, description="Per-tensor type overrides, first match wins (--tensor-type).")
    target_bpw: float | None = Field(None, description="Not available: " + NO_SIZE_TARGET + ".")
    target_size_mb: float | None = Field(None, description="Not available: " + NO_SIZE_TARGET + ".")

    def uses_imatrix(self) -> bool:
        if self.imatrix is not None:
            return self.imatrix
        overrides = [t.type for t in self.tensor_types] + [self.output_type, self.embedding_type]
        overrides += (self.search.types or []) if self.search else []
        return self.type in NEEDS_IMATRIX or any(t in TENSOR_NEEDS_IMATRIX for t in overrides)

    def needs_calibration(self) -> bool:
        return self.uses_imatrix()

    def describe(self) -> str:
        extra = [f"{t.pattern}={t.type}" for t in self.tensor_types]
        if self.output_type:
            extra.append(f"output={self.output_type}")
        if self.embedding_type:
            extra.append(f"embd={self.embedding_type}")
        head = self.search.describe() if self.search else self.type
        return " ".join([head + (" imatrix" if self.uses_imatrix() else "")] + extra)

    def quant_params(self) -> dict:
        data = super().quant_params()
        data["imatrix"] = self.uses_imatrix()  # resolved: the implied default is part of the key, not None
        # options at their defaults are left out, so variants that use none of them keep their earlier keys
        for key, default in (("imatrix", False), ("output_type", None), ("embedding_type", None), ("tensor_types", []),
                             ("target_bpw", None), ("target_size_mb", None), ("search", None)):
            if data.get(key) == default:
                data.pop(key, None)
        return data

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str | None) -> str | None:
        if v is None:
            return v
        up = v.upper()
        up = TYPE_ALIASES.get(up, up)   # Q4_K is Q4_K_M: the same file, so the same key
        if up not in TYPES:
            raise ValueError(f"{v!r} is not a llama.cpp quantization type; allowed: {', '.join(TYPES)}")
        return up

    @field_validator("target_bpw", "target_size_mb")
    @classmethod
    def _no_size_target(cls, v):
        if v is not None:
            raise ValueError(NO_SIZE_TARGET)
        return v

    @field_validator("output_type", "embedding_type")
    @classmethod
    def _known_tensor_type(cls, v):
        return _tensor_type(v)

    @model_validator(mode="after")
    def _type_or_search(self):
        if (self.type is None) == (self.search is None):
            raise ValueError("give either type (one llama.cpp type) or search (a budget the types are searched for)"
                             if self.type is None else "give type or search, not both")
        if self.search is not None:
            for t in self.search.types or []:
                _tensor_type(t)
            if self.tensor_types or self.output_type or self.embedding_type:
                raise ValueError("search chooses every tensor's type: remove tensor_types / output_type / "
                                 "embedding_type (or give search.types)")
        return self

    @model_validator(mode="after")
    def _imatrix_when_required(self):
        if self.imatrix is False:
            overrides = [t.type for t in self.tensor_types] + [self.output_type, self.embedding_type]
            needy = [t for t in [self.type] + overrides if t in NEEDS_IMATRIX or t in TENSOR_NEEDS_IMATRIX]
            if needy:
                raise ValueError(f"type {needy[0]} needs an importance matrix; remove 'imatrix: false' "
                                 f"(types that need one: {', '.join(NEEDS_IMATRIX)})")
        return self


# Columns per quantization block of each ggml type (a row's length must be a multiple). Written out so that
# planning imports nothing; tests check every entry against gguf-py's GGML_QUANT_SIZES.
BLOCK_SIZE = {**dict.fromkeys(("F32", "F16", "BF16"), 1),
              **dict.fromkeys(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"), 32),
              "Q2_0": 64, "NVFP4": 64, "Q1_0": 128}


def block_size(ggml_type: str) -> int:
    """Columns per quantization block of a ggml type (row length must be a multiple)."""
    return BLOCK_SIZE.get(ggml_type, 256)  # K-quants, IQ1/2/3, IQ4_XS, TQ


def fallback_type(ggml_type: str, columns: int) -> str | None:
    """The type llama.cpp stores a tensor of `columns` columns in when `ggml_type` was chosen for it; None where it
    has no fallback and aborts the quantization."""
    if columns % block_size(ggml_type) == 0:
        return ggml_type
    if ggml_type in FALLBACK:
        new = FALLBACK[ggml_type]
    elif block_size(ggml_type) <= 32:
        new = ggml_type
    else:
        return None
    return new if columns % block_size(new) == 0 else "F16"
