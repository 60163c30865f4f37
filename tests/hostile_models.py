"""A corpus of hostile model files, made byte by byte: each one a lie a downloaded model could tell.

`gguf_file(**changes)` writes a small, valid llama GGUF (tiny tensors, a 16-token vocabulary) with the given parts
replaced; the corpus below lists each crafted case with the words its one-line refusal must contain.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

U8, U32, I32, F32, BOOL, STRING, ARRAY, U64 = 0, 4, 5, 6, 7, 8, 9, 10
F32_TYPE = 0   # ggml type F32


def _str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return _str(value)
    if kind == ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(_value(item, v) for v in items)
    return struct.pack("<" + {U8: "B", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q"}[kind], value)


def kv(key: str, kind: int, value) -> bytes:
    return _str(key) + struct.pack("<I", kind) + _value(kind, value)


HIDDEN, LAYERS, HEADS, FFN, VOCAB = 32, 2, 4, 64, 16


def base_metadata(heads=HEADS, layers=LAYERS) -> list[bytes]:
    tokens = [f"t{i}" for i in range(VOCAB)]
    return [
        kv("general.architecture", STRING, "llama"),
        kv("llama.embedding_length", U32, HIDDEN),
        kv("llama.block_count", U32, layers),
        kv("llama.feed_forward_length", U32, FFN),
        kv("llama.attention.head_count", U32, heads) if not isinstance(heads, bytes) else heads,
        kv("llama.attention.head_count_kv", U32, HEADS),
        kv("llama.context_length", U32, 256),
        kv("tokenizer.ggml.model", STRING, "gpt2"),
        kv("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        kv("tokenizer.ggml.bos_token_id", U32, 1),
    ]


def base_tensors(layers=LAYERS) -> list[tuple[str, list[int]]]:
    out = [("token_embd.weight", [HIDDEN, VOCAB]), ("output_norm.weight", [HIDDEN])]
    for i in range(layers):
        out += [(f"blk.{i}.attn_norm.weight", [HIDDEN]), (f"blk.{i}.attn_q.weight", [HIDDEN, HIDDEN])]
    return out


def gguf_bytes(metadata: list[bytes] | None = None, tensors: list[tuple[str, list[int]]] | None = None, *,
               alignment: int = 32, counts: tuple[int, int] | None = None, offsets: dict[str, int] | None = None,
               types: dict[str, int] | None = None, truncate: int = 0, version: int = 3) -> bytes:
    metadata = base_metadata() if metadata is None else metadata
    tensors = base_tensors() if tensors is None else tensors
    if alignment != 32:
        metadata = [*metadata, kv("general.alignment", U32, alignment)]
    n_tensors, n_kv = counts or (len(tensors), len(metadata))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(metadata)
    infos, offset, sizes = b"", 0, []
    for name, dims in tensors:
        nbytes = 4
        for d in dims:
            nbytes *= d
        at = (offsets or {}).get(name, offset)
        infos += _str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", (types or {}).get(name, F32_TYPE), at)
        sizes.append(nbytes)
        offset += -(-nbytes // max(alignment, 1)) * max(alignment, 1)
    body = head + infos
    pad = (-len(body)) % max(alignment, 1)
    # (a tensor too large to exist gets no data: the header is what is under test)
    data = b"".join(b"\0" * (-(-n // max(alignment, 1)) * max(alignment, 1)) for n in sizes if n < 1 << 20)
    out = body + b"\0" * pad + data
    return out[:len(out) - truncate] if truncate else out


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# name → (bytes of the file, words its refusal names)
def gguf_corpus() -> dict[str, tuple[bytes, tuple[str, ...]]]:
    lying_array = [*base_metadata(), _str("evil.blob") + struct.pack("<IIQ", ARRAY, U8, 1 << 40)]
    huge_string = [*base_metadata(), _str("evil.text") + struct.pack("<IQ", STRING, 1 << 62)]
    per_layer = kv("llama.attention.head_count", ARRAY, (U32, [4, 8]))
    million = [m for m in base_metadata() if b"block_count" not in m] + [kv("llama.block_count", U32, 1_000_000)]
    three_blocks = base_metadata(layers=3)
    return {
        "lying-array-count": (gguf_bytes(lying_array), ("evil.blob", "past the end")),
        "string-of-2^62-bytes": (gguf_bytes(huge_string), ("evil.text", "over the limit")),
        "zero-attention-heads": (gguf_bytes(base_metadata(heads=0)), ("llama.attention.head_count", "out of range")),
        "tensor-past-the-end": (gguf_bytes(truncate=64), ("tensor", "past the end of the file")),
        "overflowing-dimensions": (gguf_bytes(tensors=[*base_tensors(), ("evil.weight", [1 << 40, 1 << 40])]),
                                   ("evil.weight", "overflow")),
        "lying-kv-count": (gguf_bytes(counts=(len(base_tensors()), 1 << 60)), ("metadata_kv_count",)),
        "lying-tensor-count": (gguf_bytes(counts=(1 << 50, len(base_metadata()))), ("tensor_count",)),
        "alignment-0": (gguf_bytes(alignment=0), ("general.alignment", "power of two")),
        "per-layer-head-counts-that-differ": (gguf_bytes(base_metadata(heads=per_layer)),
                                              ("llama.attention.head_count", "per-layer")),
        "a-million-blocks-declared": (gguf_bytes(million), ("llama.block_count", "1,000,000")),
        "more-blocks-declared-than-the-tensors-hold": (gguf_bytes(three_blocks), ("llama.block_count", "hold 2 blocks")),
        "overlapping-tensors": (gguf_bytes(offsets={"output_norm.weight": 0}), ("output_norm.weight", "offset")),
        "unknown-tensor-type": (gguf_bytes(types={"output_norm.weight": 9999}), ("unknown ggml type",)),
        "not-a-gguf": (b"PK\x03\x04" + b"\0" * 100, ("GGUF magic",)),
        "version-99": (gguf_bytes(version=99), ("version 99",)),
    }


def hf_config_corpus() -> dict[str, tuple[str, tuple[str, ...]]]:
    good = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 16}
    return {
        "a-list": (json.dumps([good]), ("not an object",)),
        "not-json": ("{hidden_size: 32,", ("not valid JSON",)),
        "zero-heads": (json.dumps({**good, "num_attention_heads": 0}), ("num_attention_heads", "out of range")),
        "negative-layers": (json.dumps({**good, "num_hidden_layers": -3}), ("num_hidden_layers", "out of range")),
        "string-size": (json.dumps({**good, "hidden_size": "32"}), ("hidden_size", "not a whole number")),
        "text-config-a-list": (json.dumps({**good, "text_config": [1]}), ("text_config", "not a mapping")),
        "deep-nesting": ("[" * 100_000 + "]" * 100_000, ("not valid JSON",)),
    }
