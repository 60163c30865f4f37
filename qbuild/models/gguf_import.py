"""import-gguf step: dequantize a GGUF file into a normal HF checkpoint with transformers."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qbuild.core.step import StepContext

# GGUF metadata key suffix → HF config name, for plan-time shape checks
_CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
}


def gguf_config(path: Path) -> dict:
    """HF-style architecture facts from GGUF metadata (numpy only; the tensors are not read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(name):
        field = reader.fields.get(name)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    config = {"model_type": arch}
    for suffix, hf_name in _CONFIG_KEYS.items():
        v = value(f"{arch}.{suffix}")
        if v is not None:
            config[hf_name] = v
    add_bos = value("tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        config["add_bos_token"] = bool(add_bos)
    # llama.cpp writes no output.weight for a model whose output matrix is its token embedding
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        config["vocab_size"] = len(tokens.data)
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


def run(ctx: StepContext) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qbuild.models.gguf_tokenizer import write_tokenizer

    src = Path(ctx.runtime_args["gguf_path"])
    ctx.progress(0, 3, "loading GGUF")
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
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
