"""GGUF through llama.cpp: convert the HF checkpoint with llama.cpp's converter, quantize in-process.

Steps: `gguf-convert` (shared by every GGUF variant of a model), `imatrix` (importance matrix from the
shared calibration set, shared by every GGUF variant that uses one) and `quantize[<variant>]`.

Importance matrix: the `imatrix` step runs llama.cpp's own `llama-imatrix` (built from the vendored source of the
installed llama-cpp-python, qbuild/serving/llamacpp_build.py) on the converted GGUF over the shared calibration
tokens, and stores the per-column mean of the squared matmul inputs keyed by GGUF tensor name. It is passed to
llama_model_quantize through `params.imatrix`, and its provenance is written into the GGUF metadata
(quantize.imatrix.*) and the manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from qbuild.base.errors import RecipeError
from qbuild.base.schema_base import StrictModel
from qbuild.contract.formats import Format
from qbuild.contract.plugin import Method, methods
from qbuild.contract.step import Step, StepContext
from qbuild.contract.variant import VariantBase
from qbuild.models.shapes import check_patterns, checkpoint_weight_names, config_linear_names
from qbuild.quantize.gguf_search import GGUFSearch, check_search, plan_search

TOOLS = ("llama-cpp-python",)
CONVERT_TOOLS = ("llama-cpp-python", "torch", "transformers", "safetensors")
IMATRIX_TOOLS = ("llama-cpp-python", "tokenizers", "transformers", "safetensors", "gguf")   # + the llama-imatrix build id
IMATRIX_IMPL = 2   # 2: llama-imatrix (1 was torch hooks on the HF model: other numbers, so another key)
IMATRIX_FILE = "imatrix.safetensors"
IMATRIX_REF = "imatrix"   # the imatrix's ref: RECIPE/imatrix[-<convert_type>]:TAG (qbuild ls / show / pull)

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
# (dry_run only reports the size a type would give), so a size target is qbuild's own search (gguf_search.py).
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


def gguf_tensor_columns(info: dict) -> dict[str, int]:
    """Row length (ncols) of the GGUF tensors of a llama-style model, from its HF config (no torch)."""
    cfg = info.get("text_config") or info
    hidden = cfg.get("hidden_size")
    if not hidden:
        return {}
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (hidden // heads if heads else hidden)
    cols = {"token_embd.weight": hidden, "output.weight": hidden}
    for i in range(int(cfg.get("num_hidden_layers") or 0)):
        for t in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            cols[f"blk.{i}.{t}.weight"] = hidden
        cols[f"blk.{i}.attn_output.weight"] = (heads or 1) * head_dim
        if cfg.get("intermediate_size"):
            cols[f"blk.{i}.ffn_down.weight"] = cfg["intermediate_size"]
    return cols


def imatrix_ref(convert_type: str) -> str:
    """The imatrix's ref name: `imatrix` for the default f16 conversion, `imatrix-<type>` for the others."""
    return IMATRIX_REF if convert_type == "f16" else f"{IMATRIX_REF}-{convert_type}"


def _shown(names: list[str], cols: dict[str, int]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(f"{n} ({cols[n]} columns)" for n in names[:3]) + more


def gguf_weight_names(model_dir: Path | None, info: dict) -> list[str] | None:
    """GGUF names of the model's 2-D weights, the tensors llama.cpp quantizes: the checkpoint's weight names (or,
    before the checkpoint exists, the llama-style names from its config) mapped through gguf-py's TensorNameMap
    for the architecture. None where the architecture or the names are unknown: the pattern check is skipped."""
    import gguf

    cfg = info.get("text_config") or info
    arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}.get(cfg.get("model_type") or info.get("model_type"))
    hf = checkpoint_weight_names(model_dir) if model_dir is not None else None
    if hf is None:
        linear = config_linear_names(info)
        tied = cfg.get("tie_word_embeddings", info.get("tie_word_embeddings"))
        hf = None if linear is None else \
            [f"{n}.weight" for n in linear if not (tied and n == "lm_head")] + ["model.embed_tokens.weight"]
    if arch is None or not hf:
        return None
    name_map = gguf.get_tensor_name_map(arch, int(cfg.get("num_hidden_layers") or 0))
    names = {name_map.get_name(n, try_suffixes=(".weight",)) for n in hf}
    return sorted(n for n in names if n) or None


@methods.register
class GGUF(Method):
    """GGUF through llama.cpp: convert once per model, optional importance matrix, quantize per variant."""

    name = "gguf"
    options = GGUFVariant
    extra = "gguf"
    requires = ("llama_cpp", "gguf")

    def check(self, variant: GGUFVariant, ctx, field: str) -> None:
        """Plan-time checks against the model's tensors: every tensor_types pattern must name a tensor; explicitly
        requested types must fit the rows they are asked for (llama.cpp 0.3.36 aborts on an output/embedding type
        that does not, and silently falls back on a tensor_types one: both are a recipe error here); and the main
        type's own fallback (tensors whose rows do not fit its blocks) is reported, or refused where llama.cpp has
        none."""
        import re

        info = ctx.model_info()
        if variant.search is not None:
            check_search(variant, ctx, field)
        if variant.tensor_types:
            names = gguf_weight_names(ctx.model().source_path, info)
            if names:
                check_patterns([t.pattern for t in variant.tensor_types], names, f"{field}.tensor_types",
                               "weight tensor of the model's GGUF", lambda pattern, name: re.search(pattern, name))
        if variant.uses_imatrix():
            ref = imatrix_ref(variant.convert_type)
            for i, other in enumerate(ctx.recipe.variants):
                if other.name == ref:
                    raise RecipeError(f"variants[{i}].name", f"{ref!r} is the ref of the importance matrix this recipe "
                                      "builds (RECIPE/imatrix:TAG); rename this variant")
        cols = gguf_tensor_columns(info)
        if not cols or variant.search is not None:
            return
        self._check_main_type(variant, cols, ctx, field)
        requests = [("output_type", variant.output_type, r"^output\.weight$"),
                    ("embedding_type", variant.embedding_type, r"^token_embd\.weight$")]
        requests += [(f"tensor_types[{i}].type", t.type, t.pattern) for i, t in enumerate(variant.tensor_types)]
        for where, ggml_type, pattern in requests:
            if not ggml_type:
                continue
            bs = block_size(ggml_type)
            bad = sorted({n for n, c in cols.items() if re.search(pattern, n) and c % bs})
            if bad:
                fits = [t for t in TENSOR_TYPES if all(cols[n] % block_size(t) == 0 for n in bad)]
                raise RecipeError(f"{field}.{where}",
                                  f"{ggml_type} packs rows in blocks of {bs} columns, which does not divide "
                                  f"{_shown(bad, cols)}; types that fit: {', '.join(fits)}")

    @staticmethod
    def _check_main_type(variant: GGUFVariant, cols: dict[str, int], ctx, field: str) -> None:
        """The quantization type's blocks against every weight row: llama.cpp stores a tensor whose row does not fit
        in a type with 32-column blocks instead (said in a plan warning: the file is not the pure type it is named
        after), and aborts where the type has no fallback (a recipe error)."""
        ggml_type = DEFAULT_TENSOR_TYPE.get(variant.type, variant.type)
        bs = block_size(ggml_type)
        bad = sorted(n for n, c in cols.items() if c % bs)
        if not bad:
            return
        instead = {fallback_type(ggml_type, cols[n]) for n in bad}
        if None in instead:
            fits = [t for t in TYPES if all(cols[n] % block_size(DEFAULT_TENSOR_TYPE.get(t, t)) == 0 for n in bad)]
            raise RecipeError(f"{field}.type", f"{variant.type} packs rows in blocks of {bs} columns, which does not "
                              f"divide {_shown(bad, cols)}, and llama.cpp has no fallback type for {ggml_type} (it "
                              f"aborts the quantization); types that fit: {', '.join(fits)}")
        ctx.warn(f"{field}.type: {variant.type} packs rows in blocks of {bs} columns, which does not divide "
                 f"{_shown(bad, cols)}; llama.cpp stores those {len(bad)} of {len(cols)} weight tensors in a type "
                 f"whose blocks fit instead (its per-tensor fallback: {ggml_type} → {', '.join(sorted(instead))}), so "
                 f"the file is larger than a pure {variant.type}")

    def plan(self, variant: GGUFVariant, ctx) -> Step:
        model = ctx.model()
        convert = ctx.add(Step("gguf-convert", f"gguf-convert[{variant.convert_type}]", {"outtype": variant.convert_type},
                               "qbuild.quantize.gguf:run_convert", inputs={"model": model}, tools=CONVERT_TOOLS,
                               threads=ctx.threads, format=Format.GGUF))
        ctx.check_conversion(convert)   # held to the checkpoint before any variant is built on it
        inputs = {"gguf": convert}
        if variant.uses_imatrix():
            # one per model × calibration set (× convert type), shared by every GGUF variant; a named artifact of its
            # own (`variant` gives it a ref), so it can be listed, shown and pulled like a variant
            inputs["imatrix"] = ctx.add(Step("imatrix", f"imatrix[{variant.convert_type}]", {"statistic": "mean-sq-input"},
                                             "qbuild.quantize.gguf:run_imatrix",
                                             inputs={"model": model, "calibration": ctx.calibration(), "gguf": convert},
                                             tools=IMATRIX_TOOLS, threads=ctx.threads, format=Format.IMATRIX,
                                             variant=imatrix_ref(variant.convert_type), impl_version=IMATRIX_IMPL,
                                             env_toolchain=imatrix_toolchain()))
        if variant.search is not None:
            def quantize_step(name: str, params: dict, extra: dict) -> Step:
                return ctx.add(Step("quantize", name, params, "qbuild.quantize.gguf:run_quantize",
                                    inputs={**inputs, **extra}, tools=TOOLS, threads=ctx.threads, format=Format.GGUF,
                                    scheme=params["type"]))

            names = gguf_weight_names(model.source_path, ctx.model_info()) or []
            if not names:
                raise RecipeError(f"variants[{ctx.recipe.variants.index(variant)}].search",
                                  "the model's tensor names are unknown (not a llama-style checkpoint)")
            return plan_search(variant, ctx, inputs, quantize_step, block_size, names,
                               gguf_tensor_columns(ctx.model_info()))
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            "qbuild.quantize.gguf:run_quantize", inputs=inputs, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=Format.GGUF,
                            scheme=variant.type))


def run_convert(ctx: StepContext) -> dict:
    from qbuild.models.llamacpp_tools import run_converter

    ctx.progress(0, 1, "convert_hf_to_gguf.py")
    out = ctx.out / OUTPUT_FILE
    run_converter(Path(ctx.inputs["model"]), out, ctx.params["outtype"], log=ctx.log)
    ctx.progress(1, 1, "converted")
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size}}


def imatrix_toolchain() -> dict[str, str]:
    """The llama.cpp tools build the imatrix step runs (its cmake flags and targets enter the key)."""
    from qbuild.base.fingerprint import package_version
    from qbuild.serving.llamacpp_build import build_id

    return {"llama.cpp-tools": build_id(package_version("llama-cpp-python"))}


def write_calibration_text(model_dir: Path, calibration_dir: Path, path: Path) -> int:
    """The calibration rows as text for llama-imatrix (it reads text and tokenizes it itself): each row's unpadded
    tokens decoded with special tokens kept (parsed back as such with --parse-special), so it sees the same tokens,
    cut into chunks of seq_len. Returns seq_len."""
    from qbuild.calibration.build import load_calibration

    ids, mask = load_calibration(calibration_dir)
    if (model_dir / "tokenizer.json").is_file():   # the tokenizers library alone: importing transformers costs ~3 s
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    path.write_text("".join(tokenizer.decode(row[keep.astype(bool)].tolist(), skip_special_tokens=False)
                            for row, keep in zip(ids, mask, strict=True)))
    return int(ids.shape[1])


def llama_imatrix_command(binary: Path, gguf: Path, text: Path, out: Path, seq_len: int, threads: int) -> list[str]:
    """llama-imatrix over `text` in chunks of seq_len, GGUF output, no perplexity pass (only the matrix is wanted)."""
    return [str(binary), "-m", str(gguf), "-f", str(text), "-o", str(out), "--output-format", "gguf",
            "-c", str(seq_len), "-t", str(threads), "--parse-special", "--no-ppl", "--output-frequency", "1000000",
            "-lv", "1"]


def run_imatrix(ctx: StepContext) -> dict:
    """llama.cpp's own `llama-imatrix` on the converted GGUF over the shared calibration tokens; its GGUF output
    (per tensor: in_sum2 and counts) is stored as the per-column mean (in_sum2 / counts), what llama-quantize
    derives from it and what run_quantize passes to llama_model_quantize."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    from qbuild.base.tool_run import run_tool
    from qbuild.serving.llamacpp_build import tool

    text_file, out_file = ctx.out / "calibration.txt", ctx.out / "imatrix.gguf"
    seq_len = write_calibration_text(Path(ctx.inputs["model"]), Path(ctx.inputs["calibration"]), text_file)
    cmd = llama_imatrix_command(tool("llama-imatrix", log=ctx.log), Path(ctx.inputs["gguf"]) / OUTPUT_FILE, text_file,
                                out_file, seq_len, ctx.threads)
    ctx.progress(0, 1, "llama-imatrix")
    try:
        run_tool(cmd, "llama-imatrix")
    finally:
        ctx.owned().remove(text_file, within=ctx.out)   # the step's own file, through its store's guarded helper
    if not out_file.is_file():
        raise RuntimeError(f"llama-imatrix exited with code 0 but wrote no {out_file.name}")
    reader = gguf.GGUFReader(str(out_file))
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    data = {}
    for name in sorted(n[: -len(".in_sum2")] for n in tensors if n.endswith(".in_sum2")):
        sums, counts = tensors[name + ".in_sum2"], tensors[name + ".counts"].reshape(-1)
        # one row per expert (one for a dense tensor), each divided by its own count, as llama-quantize does
        data[name] = (sums.reshape(len(counts), -1) / np.maximum(counts, 1)[:, None]).reshape(-1).astype(np.float32)
    field = reader.fields.get("imatrix.chunk_count")
    chunks = int(field.contents()) if field is not None else 0
    chunk_size = reader.fields.get("imatrix.chunk_size")
    ctx.owned().remove(out_file, within=ctx.out)   # the step's own file, through its store's guarded helper
    save_file(data, str(ctx.out / IMATRIX_FILE))
    ctx.progress(1, 1, "llama-imatrix")
    info = {"statistic": "llama-imatrix's in_sum2 / counts per input column",
            "tool": "llama-imatrix", "entries": len(data), "chunks": chunks,
            "tokens": chunks * (int(chunk_size.contents()) if chunk_size is not None else seq_len),
            "calibration": ctx.input_manifests.get("calibration", {}).get("key")}
    (ctx.out / "imatrix.json").write_text(json.dumps(info, indent=2))
    return {"format": "imatrix", "metrics": {"entries": len(data), "tokens": info["tokens"]}, "info": info}


def ggml_type_id(llama_cpp, name: str) -> int:
    """ggml's enum value of a tensor type. llama-cpp-python exports only some (not BF16, TQ1_0, TQ2_0); gguf-py
    mirrors ggml's whole enum but may lag the newest types (Q2_0 in gguf 0.19): ask both."""
    value = getattr(llama_cpp, f"GGML_TYPE_{name}", None)
    if value is None:
        import gguf

        member = gguf.GGMLQuantizationType.__members__.get(name)
        if member is None:
            raise ValueError(f"this llama.cpp build ({llama_cpp.__version__}) has no tensor type {name}")
        value = member.value
    return int(value)


def run_quantize(ctx: StepContext) -> dict:
    import ctypes
    import json

    import llama_cpp

    from qbuild.base.tool_run import ToolFailed
    from qbuild.quantize.llamacpp_log import llama_log_tail

    src = Path(ctx.inputs["gguf"]) / OUTPUT_FILE
    out = ctx.out / OUTPUT_FILE
    p = ctx.params
    name = p["type"]
    ftype = llama_cpp.LLAMA_FTYPE_ALL_F32 if name == "F32" else getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}", None)
    if ftype is None:
        raise ValueError(f"this llama.cpp build ({llama_cpp.__version__}) has no type {name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = ctx.threads
    if p.get("output_type"):
        params.output_tensor_type = ggml_type_id(llama_cpp, p["output_type"])
    if p.get("embedding_type"):
        params.token_embedding_type = ggml_type_id(llama_cpp, p["embedding_type"])
    keep = []  # ctypes buffers must outlive the call
    overrides = p.get("tensor_types") or []
    if "allocation" in ctx.inputs:   # a search's candidate: its types come from the allocation step's output
        from qbuild.quantize.gguf_search import candidate_overrides

        overrides = candidate_overrides(Path(ctx.inputs["allocation"]), p["candidate"])
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()  # zeroed terminator
        for i, o in enumerate(overrides):
            arr[i].pattern = o["pattern"].encode()
            arr[i].type = ggml_type_id(llama_cpp, o["type"])
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        keep.append(arr)
    info: dict = {"gguf_type": name, "llama_cpp_python": llama_cpp.__version__}
    requested = sorted({o["type"] for o in overrides} | {p.get("output_type"), p.get("embedding_type")} - {None})
    if requested:   # tensors stored in other types than the file type: they decide where it loads too (loads_in)
        info["part_types"] = requested
    if "imatrix" in ctx.inputs:
        from safetensors.numpy import load_file

        im_dir = Path(ctx.inputs["imatrix"])
        data = load_file(str(im_dir / IMATRIX_FILE))
        im_info = json.loads((im_dir / "imatrix.json").read_text())
        entries = (llama_cpp.llama_model_imatrix_data * (len(data) + 1))()  # zeroed terminator
        for i, (tname, vec) in enumerate(sorted(data.items())):
            buf = (ctypes.c_float * len(vec))(*vec.astype("float32").tolist())
            keep.append(buf)
            entries[i].name = tname.encode()
            entries[i].data = ctypes.cast(buf, ctypes.POINTER(ctypes.c_float))
            entries[i].size = len(vec)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(entries)
        # provenance in the GGUF metadata, under the keys llama-quantize uses
        digest = ctx.input_manifests.get("imatrix", {}).get("key", "")
        kv = [("quantize.imatrix.file", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, f"qbuild:imatrix:{digest[:32]}"),
              ("quantize.imatrix.dataset", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR,
               f"qbuild:calibration:{str(im_info.get('calibration') or '')[:32]}"),
              ("quantize.imatrix.entries_count", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, len(data)),
              ("quantize.imatrix.chunks_count", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, int(im_info.get("chunks", 0)))]
        kvs = (llama_cpp.llama_model_kv_override * (len(kv) + 1))()  # terminator: empty key
        for i, (key, tag, value) in enumerate(kv):
            kvs[i].key = key.encode()
            kvs[i].tag = tag
            if tag == llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR:
                kvs[i].value.val_str = value.encode()[:127]
            else:
                kvs[i].value.val_i64 = value
        params.kv_overrides = ctypes.cast(kvs, ctypes.POINTER(llama_cpp.llama_model_kv_override))
        keep.append(kvs)
        info["imatrix"] = {"step_key": digest, "entries": len(data), "chunks": im_info.get("chunks"),
                           "tokens": im_info.get("tokens"), "calibration_key": im_info.get("calibration")}
    ctx.progress(0, 1, f"llama_model_quantize {name}")
    with llama_log_tail() as log_tail:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise ToolFailed(f"llama_model_quantize({name})", rc, log_tail.lines(), ended="returned")
    ctx.progress(1, 1, "quantized")
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size}, "info": info}
