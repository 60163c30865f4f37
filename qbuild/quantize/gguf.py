"""GGUF through llama.cpp: convert the HF checkpoint with llama.cpp's converter, quantize in-process.

Steps: `gguf-convert` (shared by every GGUF variant of a model), `imatrix` (importance matrix from the
shared calibration set, shared by every GGUF variant that uses one) and `quantize[<variant>]`.

Importance matrix: llama-cpp-python ships no `llama-imatrix`, so the `imatrix` step computes the same
statistic in-process with torch: for every Linear layer, the mean over calibration tokens of the
squared input activation per input column (what llama-imatrix accumulates for each matmul's src1),
keyed by the GGUF tensor name (mapped with gguf-py's TensorNameMap and checked against the converted
file). It is passed to llama_model_quantize through `params.imatrix`, and its provenance is written
into the GGUF metadata (quantize.imatrix.*) and the manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from qbuild.errors import RecipeError
from qbuild.formats import Format
from qbuild.plugins import Method, methods
from qbuild.quantize.base import VariantBase
from qbuild.schema_base import StrictModel
from qbuild.step import Step, StepContext

TOOLS = ("llama-cpp-python",)
CONVERT_TOOLS = ("llama-cpp-python", "torch", "transformers", "safetensors")
IMATRIX_TOOLS = ("torch", "transformers", "safetensors", "gguf")
IMATRIX_FILE = "imatrix.safetensors"

# llama-quantize's types (llama_ftype names without LLAMA_FTYPE_MOSTLY_); checked against llama_cpp at run time
TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
)
OUTPUT_FILE = "model.gguf"
# llama-quantize refuses these without an importance matrix (quality collapses)
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K_S")
# ggml tensor types usable for per-tensor overrides and output/embedding types
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                "TQ1_0", "TQ2_0")
TENSOR_NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S")


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
    """A GGUF file of one llama.cpp quantization type."""

    method: Literal["gguf"]
    type: str = Field(description="llama.cpp quantization type, e.g. F16, Q8_0, Q4_K_M, IQ4_XS.")
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

    def uses_imatrix(self) -> bool:
        if self.imatrix is not None:
            return self.imatrix
        overrides = [t.type for t in self.tensor_types] + [self.output_type, self.embedding_type]
        return self.type in NEEDS_IMATRIX or any(t in TENSOR_NEEDS_IMATRIX for t in overrides)

    def needs_calibration(self) -> bool:
        return self.uses_imatrix()

    def describe(self) -> str:
        extra = [f"{t.pattern}={t.type}" for t in self.tensor_types]
        if self.output_type:
            extra.append(f"output={self.output_type}")
        if self.embedding_type:
            extra.append(f"embd={self.embedding_type}")
        return " ".join([self.type + (" imatrix" if self.uses_imatrix() else "")] + extra)

    def quant_params(self) -> dict:
        data = super().quant_params()
        data["imatrix"] = self.uses_imatrix()  # resolved: the implied default is part of the key, not None
        # options at their defaults are left out, so variants that use none of them keep their earlier keys
        for key, default in (("imatrix", False), ("output_type", None), ("embedding_type", None), ("tensor_types", [])):
            if data.get(key) == default:
                data.pop(key, None)
        return data

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        up = v.upper()
        if up not in TYPES:
            raise ValueError(f"{v!r} is not a llama.cpp quantization type; allowed: {', '.join(TYPES)}")
        return up

    @field_validator("output_type", "embedding_type")
    @classmethod
    def _known_tensor_type(cls, v):
        return _tensor_type(v)

    @model_validator(mode="after")
    def _imatrix_when_required(self):
        if self.imatrix is False:
            overrides = [t.type for t in self.tensor_types] + [self.output_type, self.embedding_type]
            needy = [t for t in [self.type] + overrides if t in NEEDS_IMATRIX or t in TENSOR_NEEDS_IMATRIX]
            if needy:
                raise ValueError(f"type {needy[0]} needs an importance matrix; remove 'imatrix: false' "
                                 f"(types that need one: {', '.join(NEEDS_IMATRIX)})")
        return self


def block_size(ggml_type: str) -> int:
    """Columns per quantization block of a ggml type (row length must be a multiple)."""
    if ggml_type in ("F32", "F16", "BF16"):
        return 1
    if ggml_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"):
        return 32
    return 256  # K-quants, IQ1/2/3, IQ4_XS, TQ


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


@methods.register
class GGUF(Method):
    """GGUF through llama.cpp: convert once per model, optional importance matrix, quantize per variant."""

    name = "gguf"
    options = GGUFVariant
    extra = "gguf"
    requires = ("llama_cpp", "gguf")

    def check(self, variant: GGUFVariant, ctx, field: str) -> None:
        """The main type falls back per tensor in llama.cpp when a row does not fit its block; explicitly
        requested tensor types do not (llama.cpp 0.3.36 aborts), so those are checked here, at plan time."""
        import re

        requests = [("output_type", variant.output_type, r"^output\.weight$"),
                    ("embedding_type", variant.embedding_type, r"^token_embd\.weight$")]
        requests += [(f"tensor_types[{i}].type", t.type, t.pattern) for i, t in enumerate(variant.tensor_types)]
        if not any(ggml_type for _, ggml_type, _ in requests):
            return  # nothing explicit: llama.cpp's own per-tensor fallback applies, no model facts needed
        cols = gguf_tensor_columns(ctx.model_info())
        if not cols:
            return
        for where, ggml_type, pattern in requests:
            if not ggml_type:
                continue
            bs = block_size(ggml_type)
            bad = sorted({n for n, c in cols.items() if re.search(pattern, n) and c % bs})
            if bad:
                shown = ", ".join(f"{n} ({cols[n]} columns)" for n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
                fits = [t for t in TENSOR_TYPES if all(cols[n] % block_size(t) == 0 for n in bad)]
                raise RecipeError(f"{field}.{where}",
                                  f"{ggml_type} packs rows in blocks of {bs} columns, which does not divide {shown}; "
                                  f"types that fit: {', '.join(fits)}")

    def plan(self, variant: GGUFVariant, ctx) -> Step:
        model = ctx.model()
        convert = ctx.add(Step("gguf-convert", f"gguf-convert[{variant.convert_type}]", {"outtype": variant.convert_type},
                               "qbuild.quantize.gguf:run_convert", inputs={"model": model}, tools=CONVERT_TOOLS,
                               threads=ctx.threads, format=Format.GGUF))
        inputs = {"gguf": convert}
        if variant.uses_imatrix():
            inputs["imatrix"] = ctx.add(Step("imatrix", f"imatrix[{variant.convert_type}]", {"statistic": "mean-sq-input"},
                                             "qbuild.quantize.gguf:run_imatrix",
                                             inputs={"model": model, "calibration": ctx.calibration(), "gguf": convert},
                                             tools=IMATRIX_TOOLS, threads=ctx.threads, format=Format.IMATRIX))
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            "qbuild.quantize.gguf:run_quantize", inputs=inputs, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=Format.GGUF,
                            scheme=variant.type))


def run_convert(ctx: StepContext) -> dict:
    from qbuild.quantize.llamacpp_tools import run_converter

    ctx.progress(0, 1, "convert_hf_to_gguf.py")
    out = ctx.out / OUTPUT_FILE
    run_converter(Path(ctx.inputs["model"]), out, ctx.params["outtype"], log=ctx.log)
    ctx.progress(1, 1, "converted")
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size}}


def _hf_to_gguf_names(gguf_path: Path, n_layers: int) -> tuple[dict[str, str], set[str]]:
    """HF module name → GGUF tensor name, through gguf-py's declarative map for the file's architecture."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = {t.name for t in reader.tensors}
    return gguf.get_tensor_name_map(arch, n_layers), names


def run_imatrix(ctx: StepContext) -> dict:
    """Mean squared input activation per column of every Linear, on the shared calibration set."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from qbuild.calibration.build import load_calibration

    ids, mask = load_calibration(Path(ctx.inputs["calibration"]))
    model = AutoModelForCausalLM.from_pretrained(str(ctx.inputs["model"]), dtype=torch.float32).eval()
    n_layers = model.config.get_text_config().num_hidden_layers
    name_map, gguf_names = _hf_to_gguf_names(Path(ctx.inputs["gguf"]) / OUTPUT_FILE, n_layers)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    current_mask: list[torch.Tensor] = []
    skipped: list[str] = []
    hooks = []
    for mod_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        target = name_map.get_name(mod_name + ".weight", try_suffixes=(".weight",))
        if target is None or target not in gguf_names:
            skipped.append(mod_name)
            continue

        def hook(mod, args, _out, key=target):
            x = args[0].detach().float()
            m = current_mask[0].reshape(-1).bool()
            x = x.reshape(-1, x.shape[-1])[m]
            sums[key] = sums.get(key, 0) + (x * x).sum(0)
            counts[key] = counts.get(key, 0) + x.shape[0]

        hooks.append(module.register_forward_hook(hook))
    with torch.inference_mode():
        for i in range(len(ids)):
            row = torch.tensor(ids[i: i + 1].astype("int64"))
            current_mask[:] = [torch.tensor(mask[i: i + 1].astype("bool"))]
            model(input_ids=row, attention_mask=current_mask[0].long())
            ctx.progress(i + 1, len(ids), "calibration samples")
    for h in hooks:
        h.remove()
    data = {k: (sums[k] / counts[k]).contiguous() for k in sums}
    save_file(data, str(ctx.out / IMATRIX_FILE))
    info = {"statistic": "mean of squared input activation per input column (llama-imatrix's values/counts)",
            "entries": len(data), "chunks": int(len(ids)), "tokens": int(mask.sum()),
            "calibration": ctx.input_manifests.get("calibration", {}).get("key"), "skipped_modules": skipped}
    (ctx.out / "imatrix.json").write_text(json.dumps(info, indent=2))
    return {"format": "imatrix", "metrics": {"entries": len(data), "tokens": info["tokens"]}, "info": info}


def _ggml_type(llama_cpp, name: str) -> int:
    value = getattr(llama_cpp, f"GGML_TYPE_{name}", None)
    if value is None:
        raise ValueError(f"this llama.cpp build ({llama_cpp.__version__}) has no tensor type {name}")
    return value


def run_quantize(ctx: StepContext) -> dict:
    import ctypes
    import json

    import llama_cpp

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
        params.output_tensor_type = _ggml_type(llama_cpp, p["output_type"])
    if p.get("embedding_type"):
        params.token_embedding_type = _ggml_type(llama_cpp, p["embedding_type"])
    keep = []  # ctypes buffers must outlive the call
    overrides = p.get("tensor_types") or []
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()  # zeroed terminator
        for i, o in enumerate(overrides):
            arr[i].pattern = o["pattern"].encode()
            arr[i].type = _ggml_type(llama_cpp, o["type"])
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        keep.append(arr)
    info: dict = {"gguf_type": name, "llama_cpp_python": llama_cpp.__version__}
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
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({name}) returned {rc}")
    ctx.progress(1, 1, "quantized")
    return {"format": "gguf", "metrics": {"size_bytes": out.stat().st_size}, "info": info}
