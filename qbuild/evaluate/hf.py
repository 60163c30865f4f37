"""Transformers runtime: logits of token windows from an HF checkpoint directory."""

from __future__ import annotations

import json
import time

from qbuild.evaluate.data import load_tokens
from qbuild.evaluate.protocol import fixed_windows, summarize, window_nll
from qbuild.step import StepContext


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def load_model(path, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto" if device == "cuda" else torch.float32)
    return model.to(device).eval()


def perplexity(ctx: StepContext) -> dict:
    import torch

    p = ctx.params
    ids, info = load_tokens(ctx.inputs["data"])
    windows = fixed_windows(ids, p["context_length"], p["add_bos"], info["bos_token_id"], p["max_windows"])
    device = pick_device(ctx.device)
    t0 = time.perf_counter()
    model = load_model(ctx.inputs["model"], device)
    nlls = []
    with torch.inference_mode():
        for i, w in enumerate(windows):
            logits = model(torch.tensor([w.tokens], device=device)).logits[0].float().cpu().numpy()
            nlls.append(window_nll(logits, w))
            ctx.progress(i + 1, len(windows), "windows")
    result = summarize(nlls)
    result["protocol"] = {k: p[k] for k in ("protocol", "context_length", "max_windows", "add_bos")} | {
        "join": info["join"], "sources": info["sources"], "scored": "every token after BOS/first position"}
    result["runtime"] = {"name": "transformers", "device": device, "seconds": time.perf_counter() - t0}
    (ctx.out / "perplexity.json").write_text(json.dumps(result, indent=2))
    return {"format": "metrics", "metrics": {"ppl": result["ppl"], "tokens_scored": result["tokens_scored"]}}
