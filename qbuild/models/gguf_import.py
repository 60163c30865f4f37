"""import-gguf step: dequantize a GGUF file into a normal HF checkpoint with transformers."""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qbuild.contract.step import StepContext

# GGUF metadata key suffix → HF config name, for plan-time shape checks
_CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "expert_count": "num_local_experts",
    "attention.key_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_used_count": "num_experts_per_tok",
}
# what transformers' GGUF config does not map (its class default stays, right only for the family's usual sizes:
# Qwen3's head size 128, Qwen3-MoE's expert width 768 and 8 experts per token): GGUF fact → HF config attribute
_UNMAPPED = {"head_dim": "head_dim", "moe_intermediate_size": "moe_intermediate_size",
             "num_experts_per_tok": "num_experts_per_tok"}


def restore_unmapped(config, facts: dict) -> None:
    """Set the config attributes the GGUF states and transformers' GGUF config left at their defaults."""
    for fact, attribute in _UNMAPPED.items():
        value = facts.get(fact)
        if value and getattr(config, attribute, None) not in (None, value):
            setattr(config, attribute, int(value))


def unimportable(info: dict) -> str | None:
    """Why transformers cannot import this GGUF faithfully (read from its metadata at plan time), or None."""
    if info.get("tokenizer_refusal"):   # its text would be tokenized otherwise than llama.cpp does
        return f"its tokenizer: {info['tokenizer_refusal']}"
    if info.get("model_type") == "llama" and (info.get("num_local_experts") or 0) > 1:
        return ("a Mixtral-style GGUF (llama architecture with experts): transformers' GGUF loader builds a dense "
                "Llama from it and drops the experts (KLD 1.06 against llama.cpp on the matrix's tiny Mixtral); "
                "import the HF checkpoint instead (source: local or hub)")
    return None


def gemma_attention_scalar(config) -> int | None:
    """The query scaling llama.cpp uses for Gemma 2 / 3 (1/sqrt of this): the head size, or hidden / heads for the
    27B models. transformers' GGUF config leaves its default, 256, which is right only for a head size of 256."""
    if getattr(config, "model_type", None) not in ("gemma2", "gemma3_text", "gemma3"):
        return None
    text = getattr(config, "text_config", None) or config
    layers_27b = {"gemma2": 46, "gemma3_text": 62, "gemma3": 62}[config.model_type]
    if text.num_hidden_layers == layers_27b:
        return text.hidden_size // text.num_attention_heads
    return text.head_dim


def source_dtype(matrix_types: frozenset[str]) -> str:
    """The import's dtype where the recipe leaves it `auto`: a GGUF whose weight matrices are all F16 or all BF16
    keeps them 16-bit, so a quantized artifact's untouched tensors (embeddings, head) are not widened; a quantized
    or float32 GGUF is dequantized to float32, its exact values."""
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(matrix_types, "float32")


def untouched_dtype(matrix_types: frozenset[str]) -> str | None:
    """The dtype a quantized artifact built on the float32 import of a quantized GGUF writes the matrices its scheme
    leaves untouched in (qbuild.models.untouched); None where the import keeps 16-bit matrices already or the file
    itself stores float32 ones. A block-quantized matrix's scales are fp16, so float16 holds its values closest; a
    file with BF16 matrices keeps bfloat16."""
    if not matrix_types or "F32" in matrix_types or source_dtype(matrix_types) != "float32":
        return None
    return "bfloat16" if "BF16" in matrix_types else "float16"


def gguf_config(path: Path) -> dict:
    """HF-style architecture facts from GGUF metadata (numpy only; the tensors are not read).

    The file is untrusted: its header is walked with bounds first (qbuild.models.gguf_header), so gguf-py only ever
    parses a file whose counts and offsets hold; the facts are then checked (qbuild.models.model_config). Raises
    GGUFRefused or ConfigRefused naming the field."""
    from gguf import GGUFReader

    from qbuild.models.gguf_header import GGUFRefused, check_gguf
    from qbuild.models.model_config import ConfigRefused, check_sizes

    header = check_gguf(path)
    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as exc:   # a rule the walk does not know
        raise GGUFRefused(f"gguf-py cannot read it ({type(exc).__name__}: {str(exc)[:120]})") from None

    def value(name):
        field = reader.fields.get(name)
        if field is None:
            return None
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFRefused(f"{name}: unreadable ({type(exc).__name__})") from None

    arch = value("general.architecture")
    if not isinstance(arch, str) or not arch.replace("-", "_").replace(".", "_").isidentifier() or len(arch) > 64:
        raise GGUFRefused(f"general.architecture: {str(arch)[:60]!r} is not an architecture name")
    config = {"model_type": arch}
    for suffix, hf_name in _CONFIG_KEYS.items():
        v = value(f"{arch}.{suffix}")
        if v is not None:
            config[hf_name] = v
    add_bos, vocabulary, pre = (value(f"tokenizer.ggml.{k}") for k in ("add_bos_token", "model", "pre"))
    vocabulary = vocabulary if isinstance(vocabulary, str) else ""
    pre = pre if isinstance(pre, str) else None
    name = value("general.name")
    from qbuild.models.gguf_tokenizer import llama_cpp_adds_bos, vocabulary_refusal, writer_version

    config["tokenizer_refusal"] = vocabulary_refusal(vocabulary, pre)   # the plan refuses the import with it
    config["tokenizer_writer"] = writer_version(vocabulary, pre, name if isinstance(name, str) else "")
    if add_bos is not None:
        config["add_bos_token"] = bool(add_bos)
        config["add_bos_from"] = "the GGUF's tokenizer.ggml.add_bos_token"
    elif vocabulary:   # as llama.cpp reads the file, and as the import's tokenizer will do
        config["add_bos_token"] = llama_cpp_adds_bos(vocabulary, pre)
        config["add_bos_from"] = f"llama.cpp's default for a {vocabulary} vocabulary (the GGUF states no add_bos_token)"
    bos = value("tokenizer.ggml.bos_token_id")   # None: the imported tokenizer has no BOS token (Qwen's GGUFs)
    config["bos_token_id"] = None if not isinstance(bos, int) else int(bos)
    # llama.cpp writes no output.weight for a model whose output matrix is its token embedding
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        config["vocab_size"] = len(tokens.data)
    config = check_sizes(config, {hf: f"{arch}.{suffix}" for suffix, hf in _CONFIG_KEYS.items()}
                         | {"vocab_size": "tokenizer.ggml.tokens"})
    layers = config.get("num_hidden_layers")
    if header.blocks and layers != header.blocks:
        raise ConfigRefused(f"{arch}.block_count: {layers} but the file's tensors hold {header.blocks} blocks")
    config["gguf_elements"] = header.elements   # parameters the import dequantizes (its memory estimate)
    config["source_dtype"] = source_dtype(header.matrix_types)
    config["untouched_dtype"] = untouched_dtype(header.matrix_types)
    return config


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf-py parses each GGUF file once and builds each tensor name map once.

    transformers parses a GGUF's metadata four times for one import (config and vocabulary for the
    tokenizer, config and tensors for the model) and rebuilds gguf-py's TensorNameMap once per module
    (~400 times). On SmolLM2-135M that is 16 s and 6 s of a 26 s import. The reader and the map are
    read-only to transformers, so sharing them gives the same checkpoint."""
    import gguf

    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


def llama3_rope(path: Path, config) -> dict | None:
    """Llama 3.x's RoPE scaling, recovered from the GGUF's `rope_freqs.weight` (where llama.cpp's converter keeps it,
    as one divisor per frequency; the metadata holds no parameters), as transformers' `rope_parameters`, or None.

    llama.cpp's divisor per frequency is 1 for short wavelengths, `factor` for long ones and 1 / ((1 - s) / factor
    + s) between, with s = (L / wavelength - low) / (high - low): s is linear in 1 / wavelength, so two of the
    frequencies between give the band exactly. Only the ratios L / low and L / high enter transformers' formula."""
    import numpy as np
    from gguf import GGUFReader

    if getattr(config, "model_type", None) != "llama":
        return None
    tensor = next((t for t in GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    divisors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta")
                  or getattr(config, "rope_theta", 10000.0))
    dims = 2 * len(divisors)
    wavelength = 2 * np.pi * theta ** (np.arange(0, dims, 2) / dims)
    factor = float(divisors.max())
    between = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if factor <= 1 or between.sum() < 2:
        return None
    s = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelength[between], s, 1)   # s = (L / w - low) / (high - low)
    # L / low = -slope / intercept and L / high = slope / (1 - intercept); with low_freq_factor 1, as every Llama 3.x
    # has, L is the longest wavelength left unscaled and both parameters come out as the model card states them
    original = round(-slope / intercept)
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": round(float(original * (1 - intercept) / slope), 4),
            "original_max_position_embeddings": original}


def run(ctx: StepContext) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from qbuild.models.gguf_tokenizer import write_tokenizer

    src = Path(ctx.runtime_args["gguf_path"])
    ctx.progress(0, 3, "loading GGUF")
    with gguf_parsed_once():
        config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
        restore_unmapped(config, gguf_config(src))
        rope = llama3_rope(src, config)
        if rope is not None:   # transformers' GGUF config drops it: without it every position is rotated wrongly
            config.rope_parameters = rope
        scalar = gemma_attention_scalar(config)
        if scalar is not None:
            (getattr(config, "text_config", None) or config).query_pre_attn_scalar = scalar
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, config=config,
                                                     dtype=torch.float32)
        ctx.progress(1, 3, "dequantized")
        # The weights are now plain tensors: drop the GGUF quantizer so the checkpoint saves as a normal one.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model = model.to(getattr(torch, ctx.params["dtype"]))
        model.save_pretrained(str(ctx.out))
        tokenizer = write_tokenizer(src, ctx.out)
        if tokenizer is None:   # a vocabulary type qbuild does not rebuild: transformers' conversion, checked later
            AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(ctx.out))
            tokenizer = "converted by transformers"
    ctx.progress(3, 3, "saved")
    params = sum(p.numel() for p in model.parameters())
    return {"format": "hf", "metrics": {"parameters": params},
            "info": {"architecture": type(model).__name__, "tokenizer": tokenizer}}
