"""Calibration step runner: documents → chat template → tokens → seeded samples → safetensors."""

from __future__ import annotations

import json

import numpy as np

from qbuild.calibration.sources import read_source
from qbuild.contract.step import StepContext

OUTPUT = "calibration.safetensors"
INFO = "calibration.json"


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def render(doc, tokenizer, chat_template: bool) -> str:
    if isinstance(doc, list):
        return tokenizer.apply_chat_template(doc, tokenize=False)
    if chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": doc}], tokenize=False)
    return doc


def split_counts(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of `total` samples by weight (deterministic)."""
    raw = [total * w / sum(weights) for w in weights]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[: total - sum(counts)]:
        counts[i] += 1
    return counts


def sample_windows(ids: np.ndarray, n: int, seq_len: int, rng: np.random.Generator, where: str) -> list[int]:
    if len(ids) < seq_len:
        raise ValueError(f"{where}: only {len(ids)} tokens, fewer than seq_len={seq_len}")
    return sorted(int(x) for x in rng.integers(0, len(ids) - seq_len + 1, size=n))


def run(ctx: StepContext) -> dict:
    p = ctx.params
    tok = load_tokenizer(ctx.inputs["tokenizer"])
    rng = np.random.default_rng(p["seed"])
    counts = split_counts(p["samples"], [s["weight"] for s in p["sources"]])
    seq_len = p["seq_len"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    rows, masks, sample_ids, per_source = [], [], [], []
    for si, (src, rt, n) in enumerate(zip(p["sources"], ctx.runtime_args["sources"], counts, strict=True)):
        ctx.progress(si, len(counts), f"reading source {si} ({src['type']})")
        docs = [render(d, tok, p["chat_template"]) for d in read_source(src, rt)]
        if n == 0:
            continue
        if p["sampling"] == "random-window":
            ids = np.array(tok("\n\n".join(docs), add_special_tokens=False)["input_ids"], dtype=np.int64)
            for off in sample_windows(ids, n, seq_len, rng, f"calibration.sources[{si}]"):
                rows.append(ids[off: off + seq_len])
                masks.append(np.ones(seq_len, dtype=np.int8))
                sample_ids.append(f"{si}:tok{off}")
            per_source.append({"source": si, "documents": len(docs), "tokens_available": int(len(ids)), "samples": n})
        else:  # document: one sample per seeded document, truncated, right-padded
            order = rng.permutation(len(docs))[:n]
            if len(order) < n:
                raise ValueError(f"calibration.sources[{si}]: {len(docs)} documents, {n} samples requested")
            for d in order:
                ids = tok(docs[d], add_special_tokens=False)["input_ids"][:seq_len]
                row = np.full(seq_len, pad, dtype=np.int64)
                row[: len(ids)] = ids
                mask = np.zeros(seq_len, dtype=np.int8)
                mask[: len(ids)] = 1
                rows.append(row)
                masks.append(mask)
                sample_ids.append(f"{si}:doc{int(d)}")
            per_source.append({"source": si, "documents": len(docs), "samples": n})
    from safetensors.numpy import save_file

    input_ids = np.stack(rows).astype(np.int32)
    attention_mask = np.stack(masks)
    save_file({"input_ids": input_ids, "attention_mask": attention_mask}, str(ctx.out / OUTPUT))
    info = {
        "samples": len(rows), "seq_len": seq_len, "tokens": int(attention_mask.sum()), "seed": p["seed"],
        "sampling": p["sampling"], "chat_template": p["chat_template"], "sources": p["sources"],
        "per_source": per_source, "sample_ids": sample_ids,
    }
    extra = {"overlap": ctx.runtime_args["overlap"]} if ctx.runtime_args.get("overlap") else {}
    info |= extra
    (ctx.out / INFO).write_text(json.dumps(info, indent=2))
    ctx.progress(len(counts), len(counts), "done")
    return {"format": "calibration", "metrics": {"samples": len(rows), "tokens": int(attention_mask.sum())}, "info": extra}


def load_calibration(path) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) of a calibration artifact directory."""
    from safetensors.numpy import load_file

    data = load_file(str(path / OUTPUT))
    return data["input_ids"], data["attention_mask"]
