"""Perplexity and divergence step runners, generic over runtimes."""

from __future__ import annotations

import json
import time

import numpy as np

from qbuild.evaluate.data import load_tokens
from qbuild.evaluate.protocol import summarize, window_divergence, window_nll, windows
from qbuild.plugins import open_session
from qbuild.step import StepContext


def _windows(ctx: StepContext):
    p = ctx.params
    ids, info = load_tokens(ctx.inputs["data"])
    wins = windows(ids, p["protocol"], p["context_length"], p["add_bos"], info["bos_token_id"], p["max_windows"],
                   p.get("stride"))
    if not wins:
        raise ValueError(f"evaluation text ({len(ids)} tokens) is shorter than one {p['context_length']}-token window")
    return wins, info


def protocol_record(p: dict, info: dict) -> dict:
    """Everything that makes a number comparable: recorded with every result."""
    keys = ("protocol", "context_length", "stride", "max_windows", "add_bos")
    return {k: p.get(k) for k in keys} | {"join": info["join"], "sources": info["sources"],
                                           "bos_token_id": info["bos_token_id"]}


def perplexity(ctx: StepContext) -> dict:
    p = ctx.params
    wins, info = _windows(ctx)
    t0 = time.perf_counter()
    rt = open_session(p["runtime"], ctx.inputs["model"], ctx, p["context_length"])
    nlls = []
    for i, (w, logits) in enumerate(zip(wins, rt.window_logits(wins), strict=True)):
        nlls.append(window_nll(logits, w))
        ctx.progress(i + 1, len(wins), "windows")
    result = summarize(nlls) | {"protocol": protocol_record(p, info),
                                "runtime": rt.info() | {"seconds": time.perf_counter() - t0}}
    (ctx.out / "perplexity.json").write_text(json.dumps(result, indent=2))
    return {"format": "metrics", "metrics": {"ppl": result["ppl"], "tokens_scored": result["tokens_scored"]}}


def divergence(ctx: StepContext) -> dict:
    """KL divergence and top-1 agreement of a variant against the baseline, on the same tokens."""
    p = ctx.params
    wins, info = _windows(ctx)
    base = open_session(p["baseline_runtime"], ctx.inputs["baseline"], ctx, p["context_length"])
    base_logits = list(base.window_logits(wins))
    base_info = base.info()
    del base
    rt = open_session(p["runtime"], ctx.inputs["model"], ctx, p["context_length"])
    klds, top1 = [], []
    for i, (w, bl, logits) in enumerate(zip(wins, base_logits, rt.window_logits(wins), strict=True)):
        if logits.shape != bl.shape:
            raise RuntimeError(f"window {i}: logits {logits.shape} vs baseline {bl.shape}")
        d = window_divergence(bl, logits, w)
        klds.append(d["kld"])
        top1.append(d["top1"])
        ctx.progress(i + 1, len(wins), "windows")
    return write_divergence(ctx, klds, top1, {"protocol": protocol_record(p, info), "runtime": rt.info(),
                                              "baseline_runtime": base_info})


def write_divergence(ctx: StepContext, klds: list, top1: list, record: dict) -> dict:
    """Summarize per-position KLD / top-1 agreement, write divergence.json, return the step result."""
    kld, same = np.concatenate(klds), np.concatenate(top1)
    result = {
        "kld_mean": float(kld.mean()), "kld_p99": float(np.quantile(kld, 0.99)), "kld_max": float(kld.max()),
        "top1_agreement": float(same.mean()), "tokens_scored": int(len(kld)), **record,
    }
    (ctx.out / "divergence.json").write_text(json.dumps(result, indent=2))
    return {"format": "metrics", "metrics": {"kld": result["kld_mean"], "top1": result["top1_agreement"]}}
