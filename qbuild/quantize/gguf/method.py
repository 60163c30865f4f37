"""The gguf method's plan side: convert the HF checkpoint with llama.cpp's converter, quantize in-process.

Steps: `gguf-convert` (shared by every GGUF variant of a model), `imatrix` (importance matrix from the
shared calibration set, shared by every GGUF variant that uses one) and `quantize[<variant>]`.

Importance matrix: the `imatrix` step runs llama.cpp's own `llama-imatrix` (built from the vendored source of the
installed llama-cpp-python, qbuild/models/llamacpp_toolchain.py) on the converted GGUF over the shared calibration
tokens, and stores the per-column mean of the squared matmul inputs keyed by GGUF tensor name. It is passed to
llama_model_quantize through `params.imatrix`, and its provenance is written into the GGUF metadata
(quantize.imatrix.*) and the manifest.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.plugins import (
    Method,
    RecipeError,
    Step,
    UnsupportedFamily,
    check_patterns,
    checkpoint_weight_names,
    config_linear_names,
    methods,
)
from qbuild.quantize.gguf.options import (
    CONVERT_TOOLS,
    DEFAULT_TENSOR_TYPE,
    FORMAT,
    IMATRIX_FORMAT,
    IMATRIX_IMPL,
    IMATRIX_REF,
    IMATRIX_TOOLS,
    TENSOR_TYPES,
    TOOLS,
    TYPES,
    GGUFVariant,
    block_size,
    fallback_type,
)
from qbuild.quantize.gguf.search import check_search, plan_search


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


def imatrix_toolchain() -> dict[str, str]:
    """The llama.cpp tools build the imatrix step runs (its cmake flags and targets enter the key)."""
    from qbuild.plugin_services import build_id
    from qbuild.plugins import package_version

    return {"llama.cpp-tools": build_id(package_version("llama-cpp-python"))}


@methods.register
class GGUF(Method):
    """GGUF through llama.cpp: convert once per model, optional importance matrix, quantize per variant."""

    name = "gguf"
    options = GGUFVariant
    extra = "gguf"
    requires = ("llama_cpp", "gguf")
    # found by the architecture matrix (tests/test_architectures.py, docs/architectures.md)
    unsupported_families = (UnsupportedFamily(
        "qwen3_moe",
        "llama.cpp's qwen3moe graph always renormalizes the top-k router weights (the converter writes no "
        "norm_topk_prob), so the GGUF would compute another function than the checkpoint (F16 KLD 0.044 against "
        "it on the matrix's tiny Qwen3-MoE, 1e-6 with norm_topk_prob: true)",
        "norm_topk_prob is false", lambda cfg: not cfg.get("norm_topk_prob")),)

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
                               "qbuild.quantize.gguf.run:run_convert", inputs={"model": model}, tools=CONVERT_TOOLS,
                               threads=ctx.threads, format=FORMAT,
                               # the model's own code runs in the converter only where the recipe trusts it
                               runtime_args={"trust_remote_code": bool(model.params.get("trust_remote_code"))}))
        ctx.check_conversion(convert)   # held to the checkpoint before any variant is built on it
        inputs = {"gguf": convert}
        if variant.uses_imatrix():
            # one per model × calibration set (× convert type), shared by every GGUF variant; a named artifact of its
            # own (`variant` gives it a ref), so it can be listed, shown and pulled like a variant
            inputs["imatrix"] = ctx.add(Step("imatrix", f"imatrix[{variant.convert_type}]", {"statistic": "mean-sq-input"},
                                             "qbuild.quantize.gguf.run:run_imatrix",
                                             inputs={"model": model, "calibration": ctx.calibration(), "gguf": convert},
                                             tools=IMATRIX_TOOLS, threads=ctx.threads, format=IMATRIX_FORMAT,
                                             variant=imatrix_ref(variant.convert_type), impl_version=IMATRIX_IMPL,
                                             env_toolchain=imatrix_toolchain()))
        if variant.search is not None:
            names = gguf_weight_names(model.source_path, ctx.model_info()) or []
            if not names:
                raise RecipeError(f"variants[{ctx.recipe.variants.index(variant)}].search",
                                  "the model's tensor names are unknown (not a llama-style checkpoint)")
            return plan_search(variant, ctx, inputs, TOOLS, block_size, names, gguf_tensor_columns(ctx.model_info()))
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            "qbuild.quantize.gguf.run:run_quantize", inputs=inputs, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=FORMAT,
                            scheme=variant.type))
