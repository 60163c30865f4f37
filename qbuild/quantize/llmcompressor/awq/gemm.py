"""AutoAWQ GEMM checkpoints, converted bit-exactly from llm-compressor's compressed-tensors W4A16 output.

vLLM and SGLang read compressed-tensors directly, but LMDeploy and TGI (and older stacks) load AWQ
models only in the layout AutoAWQ wrote. This converter rewrites each quantized Linear of a
`pack-quantized` W4A16 group checkpoint into that layout without touching a single value:

  compressed-tensors (per Linear)                      AutoAWQ GEMM (per Linear)
  weight_packed      int32 [out, in/8]  signed int4 →   qweight  int32 [in, out/8]  unsigned int4
  weight_zero_point  int32 [out/8, G#]  signed int4 →   qzeros   int32 [G#, out/8]  unsigned int4
  weight_scale       float [out, G#]                →   scales   fp16  [G#, out]
  weight_shape       int64 [2]                      →   (dropped: qweight's shape says it)

G# = in / group_size. compressed-tensors stores 4-bit values as signed (-8..7) and packs them with an
offset of 8 (`compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32`); AutoAWQ stores the
same value + 8 as an unsigned nibble, so weight - zero (and therefore every dequantized weight) is
unchanged. A symmetric checkpoint has no zero point: its zero is 0, i.e. 8 unsigned, which is how an
AWQ checkpoint with `zero_point: true` expresses symmetric weights. Scales must already be float16
numbers (the awq method quantizes with `scale_dtype: float16` for this); any scale that is not is an
error, never a silent rounding. Everything else (embeddings, norms, unquantized Linears, tokenizer
files) is copied unchanged.

The awq method's converter (its `convert` step, run from run.py: imported only in a step's worker); heavy libraries
are imported inside the functions. The layout's constants and its format declaration are the plan side's
(options.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qbuild.quantize.llmcompressor.awq.options import BITS, VALUES_PER_WORD

UNSIGNED_OFFSET = 1 << (BITS - 1)   # compressed-tensors' signed int4 → AutoAWQ's unsigned nibble
# Which column of a group of 8 output channels each nibble of an int32 holds: nibble i (bits 4i..4i+3) of
# word j is column 8j + AWQ_PACK_ORDER[i]. This is AutoAWQ's `order_map` in
# awq/modules/linear/gemm.py: WQLinear_GEMM.from_linear (the packer), whose inverse AWQ_REVERSE_ORDER is
# applied by awq/utils/packing_utils.py: reverse_awq_order / dequantize_gemm (the reader); vLLM's AWQ
# kernels and GPTQModel's AWQ GEMM module read the same order.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
INDEX_FILE = "model.safetensors.index.json"


class ConversionError(ValueError):
    """The checkpoint cannot be converted exactly (wrong scheme, shape or scale dtype): says which and why."""


def awq_quantization_config(group_size: int, modules_to_not_convert: list[str]) -> dict:
    """config.json's quantization_config as AutoAWQ's AwqConfig.to_transformers_dict writes it (and as
    transformers' AwqConfig, vLLM, SGLang, TGI and LMDeploy read it)."""
    return {"quant_method": "awq", "version": "gemm", "bits": BITS, "group_size": group_size, "zero_point": True,
            "modules_to_not_convert": modules_to_not_convert}


def check_scheme(quantization_config: dict) -> int:
    """The group size of a compressed-tensors W4A16 pack-quantized group checkpoint; ConversionError otherwise."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    if quantization_config.get("quant_method") != "compressed-tensors":
        raise ConversionError(f"not a compressed-tensors checkpoint (quant_method {quantization_config.get('quant_method')!r})")
    for extra in ("sparsity_config", "transform_config"):
        if quantization_config.get(extra):
            raise ConversionError(f"the checkpoint has a {extra}; AutoAWQ's format holds plain W4A16 weights only")
    qc = QuantizationConfig.model_validate(quantization_config)
    if qc.quantization_status != QuantizationStatus.COMPRESSED:
        raise ConversionError(f"quantization_status is {qc.quantization_status}, not compressed")
    if qc.kv_cache_scheme is not None:
        raise ConversionError("the checkpoint quantizes the KV cache; AutoAWQ's format has no KV-cache scales")
    group_sizes = set()
    for name, scheme in qc.config_groups.items():
        fmt = scheme.format or qc.format
        w = scheme.weights
        problems = []
        if fmt != "pack-quantized":
            problems.append(f"format {fmt}, not pack-quantized")
        if scheme.input_activations is not None or scheme.output_activations is not None:
            problems.append("activations are quantized (W4A16 only)")
        if w is None:
            problems.append("no weight quantization")
        else:
            if w.num_bits != BITS or w.type != "int":
                problems.append(f"weights are {w.type}{w.num_bits}, not int{BITS}")
            if w.strategy != "group" or not w.group_size:
                problems.append(f"weight strategy is {w.strategy}, not group")
            if w.actorder == "group":
                problems.append("activation order 'group' permutes columns (g_idx), which AutoAWQ's format cannot hold")
            if w.dynamic:
                problems.append("weights are dynamically quantized")
            group_sizes.add(w.group_size)
        if problems:
            raise ConversionError(f"config group {name!r}: " + "; ".join(problems))
    if len(group_sizes) != 1:
        raise ConversionError(f"AutoAWQ's format has one group size per model; the checkpoint has {sorted(group_sizes)}")
    return group_sizes.pop()


def pack_awq(values):
    """[rows, cols] integers in 0..15 → int32 [rows, cols/8] in AutoAWQ's nibble order (AWQ_PACK_ORDER)."""
    import torch

    values = values.to(torch.int32)
    words = torch.zeros(values.shape[0], values.shape[1] // VALUES_PER_WORD, dtype=torch.int32)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        # columns `column`, `column + 8`, ...: one per word; int32 shifts wrap, so nibble 7 sets the sign bit
        words |= values[:, column::VALUES_PER_WORD] << (BITS * nibble)
    return words


def convert_linear(name: str, packed, scale, shape, zero_point, group_size: int) -> dict:
    """One Linear's compressed-tensors tensors → its AutoAWQ GEMM tensors {name.qweight, name.qzeros, name.scales}."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out_features, in_features = (int(d) for d in shape)
    if out_features % VALUES_PER_WORD:
        raise ConversionError(f"{name}: {out_features} output channels; AutoAWQ packs 8 per int32, so it needs a multiple of 8")
    if in_features % group_size:
        raise ConversionError(f"{name}: {in_features} input columns are not a multiple of the group size {group_size}")
    groups = in_features // group_size
    if tuple(scale.shape) != (out_features, groups):
        raise ConversionError(f"{name}: weight_scale has shape {tuple(scale.shape)}, expected {(out_features, groups)}")
    scales = scale.to(torch.float16)
    if not torch.equal(scales.to(scale.dtype), scale):
        inexact = int((scales.to(scale.dtype) != scale).sum())
        raise ConversionError(f"{name}: {inexact} of {scale.numel()} weight_scale values ({scale.dtype}) are not float16 "
                              "numbers, and AutoAWQ stores float16 scales: the conversion would not be exact "
                              "(quantize with scale_dtype float16)")
    weight = unpack_from_int32(packed, BITS, torch.Size((out_features, in_features))).to(torch.int32) + UNSIGNED_OFFSET
    if zero_point is None:   # symmetric: compressed-tensors' implicit zero point 0
        zeros = torch.full((out_features, groups), UNSIGNED_OFFSET, dtype=torch.int32)
    else:
        zeros = unpack_from_int32(zero_point, BITS, torch.Size((out_features, groups)), packed_dim=0).to(torch.int32) \
            + UNSIGNED_OFFSET
    # AutoAWQ's tensors are input-major: [in, out/8], [in/group, out/8], [in/group, out]
    return {f"{name}.qweight": pack_awq(weight.t()), f"{name}.qzeros": pack_awq(zeros.t()),
            f"{name}.scales": scales.t().contiguous()}


def full_precision_linears(src: Path, quantized: set[str]) -> list[str]:
    """Every nn.Linear of the checkpoint's architecture that it keeps unquantized (ignored: lm_head, ...).

    Written out as full module names: vLLM matches modules_to_not_convert by substring and transformers by
    prefix/regex, and a full name means the same to both (compressed-tensors' `re:` rules would not)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):   # the module tree only: no memory, no weights
        model = AutoModelForCausalLM.from_config(config)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    strangers = sorted(quantized - linears)
    if strangers:
        raise ConversionError(f"quantized tensors for modules that are not Linear layers of {type(model).__name__}: "
                              f"{', '.join(strangers[:3])}")
    return sorted(linears - quantized)


class ShardedCheckpoint:
    """The safetensors files of an HF directory (one file, or shards with an index), read lazily by tensor name."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        index_path = root / INDEX_FILE
        self.index: dict | None = json.loads(index_path.read_text()) if index_path.is_file() else None
        if self.index is not None:
            self.files = sorted(set(self.index["weight_map"].values()))
        else:
            self.files = sorted(p.name for p in root.glob("*.safetensors"))
            if len(self.files) != 1:
                raise ConversionError(f"expected one .safetensors file or {INDEX_FILE} in {root}, found {self.files}")
        self.handles = {f: safe_open(str(root / f), "pt") for f in self.files}
        self.weight_map: dict[str, str] = {name: f for f, h in self.handles.items() for name in h.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)

    def get(self, name: str):
        return self.handles[self.weight_map[name]].get_tensor(name)

    def names_in(self, file: str) -> list[str]:
        return [n for n, f in self.weight_map.items() if f == file]

    def metadata(self, file: str) -> dict | None:
        return self.handles[file].metadata()


def convert_checkpoint(src: Path, dst: Path, log=print) -> dict:
    """Write the AutoAWQ GEMM form of the compressed-tensors checkpoint `src` into `dst`; returns facts for the manifest."""
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    group_size = check_scheme(config.get("quantization_config") or {})
    ckpt = ShardedCheckpoint(src)
    modules: dict[str, set[str]] = {}
    for tensor in ckpt.weight_map:
        module, _, leaf = tensor.rpartition(".")
        if leaf in CT_SUFFIXES:
            modules.setdefault(module, set()).add(leaf)
    for module, leaves in sorted(modules.items()):
        if "weight_g_idx" in leaves:
            raise ConversionError(f"{module}: has weight_g_idx (activation-ordered groups), which AutoAWQ's format cannot hold")
        if not {"weight_packed", "weight_scale", "weight_shape"} <= leaves:
            raise ConversionError(f"{module}: has {sorted(leaves)}, not a pack-quantized weight")
    quantized = set(modules)
    not_converted = full_precision_linears(src, quantized)

    dst.mkdir(parents=True, exist_ok=True)
    total_bytes = 0
    out_map: dict[str, str] = {}
    for file in ckpt.files:
        tensors = {}
        for name in ckpt.names_in(file):
            module, _, leaf = name.rpartition(".")
            if module in quantized:
                if leaf != "weight_packed":
                    continue   # read with its module's weight_packed (which may sit in another shard)
                zp = f"{module}.weight_zero_point"
                tensors.update(convert_linear(module, ckpt.get(name), ckpt.get(f"{module}.weight_scale"),
                                              ckpt.get(f"{module}.weight_shape").tolist(),
                                              ckpt.get(zp) if zp in ckpt.weight_map else None, group_size))
            else:
                tensors[name] = ckpt.get(name)   # embeddings, norms, unquantized Linears and biases: unchanged
        save_file(tensors, str(dst / file), metadata=ckpt.metadata(file))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        out_map.update(dict.fromkeys(tensors, file))
        log(f"{file}: {len(tensors)} tensors")
    if ckpt.index is not None:
        index = {**ckpt.index, "metadata": {**ckpt.index.get("metadata", {}), "total_size": total_bytes},
                 "weight_map": dict(sorted(out_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    config["quantization_config"] = awq_quantization_config(group_size, not_converted)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model_files = {"config.json", INDEX_FILE, *ckpt.files}
    for path in sorted(src.iterdir()):   # tokenizer, chat template, generation config, llm-compressor's recipe
        if path.name not in model_files and path.is_file():
            shutil.copy2(path, dst / path.name)
    return {"group_size": group_size, "linears_converted": len(quantized), "modules_to_not_convert": not_converted,
            "symmetric": not any("weight_zero_point" in leaves for leaves in modules.values())}
