"""Perplexity protocols: how token windows are cut and which positions are scored.

- fixed-window: concatenated text, non-overlapping windows of N tokens (the GPTQ/AWQ papers).
- sliding-window: windows of N tokens every `stride` tokens; each token is scored once, with as much
  left context as the window allows (the transformers perplexity guide).
- llama.cpp: non-overlapping windows of N tokens, BOS replaces the first token, only the second half
  of each window is scored (what `llama-perplexity` reports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Self-contained (numpy and the standard library only): runtimes that score in another interpreter (the TensorRT-LLM
# shim) load a copy of this file there, where qbuild is not installed.


@dataclass(frozen=True)
class Window:
    """One evaluation window a runtime scores."""

    tokens: list[int]   # what the runtime is fed
    first_scored: int   # positions >= first_scored are scored, each predicted from the positions before it

PROTOCOLS = ("fixed-window", "sliding-window", "llama.cpp")


def windows(ids: np.ndarray, protocol: str, context_length: int, add_bos: bool, bos_id: int | None,
            max_windows: int | None, stride: int | None = None) -> list[Window]:
    ids = [int(t) for t in ids]
    if add_bos and bos_id is None:
        raise ValueError("add_bos is set but the tokenizer has no BOS token")
    out: list[Window] = []
    if protocol == "fixed-window":
        body = context_length - 1 if add_bos else context_length
        for start in range(0, len(ids) - body + 1, body):
            chunk = ids[start: start + body]
            out.append(Window([bos_id] + chunk, 1) if add_bos else Window(chunk, 1))
    elif protocol == "llama.cpp":
        for start in range(0, len(ids) - context_length + 1, context_length):
            chunk = ids[start: start + context_length]
            if add_bos:
                chunk = [bos_id] + chunk[1:]
            out.append(Window(chunk, context_length // 2 + 1))
    elif protocol == "sliding-window":
        body = context_length - 1 if add_bos else context_length
        stride = stride or body // 2
        prev_end = 0
        for start in range(0, len(ids), stride):
            end = min(start + body, len(ids))
            chunk = ids[start:end]
            first = max(prev_end - start, 0 if add_bos else 1)
            if add_bos:
                chunk, first = [bos_id] + chunk, first + 1
            if first < len(chunk):
                out.append(Window(chunk, first))
            prev_end = end
            if end == len(ids):
                break
    else:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    return out[:max_windows] if max_windows else out


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """Row-wise log-sum-exp: exp in float32 (fast), sums in float64 (exact enough for 1e-6 relative)."""
    m = x.max(axis=-1, keepdims=True)
    return m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=-1, dtype=np.float64))


def _scored(logits: np.ndarray, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """Logit rows that predict scored tokens (logits[i] predicts tokens[i+1]), and those tokens."""
    rows = np.asarray(logits[window.first_scored - 1: len(window.tokens) - 1], dtype=np.float32)
    return rows, np.asarray(window.tokens[window.first_scored:])


def score_rows(rows: np.ndarray, window: Window, reference: np.ndarray | None = None,
               logprobs: bool = False, reference_top1: np.ndarray | None = None) -> dict:
    """One window scored from the logit rows that predict its scored tokens (`_scored`'s rows, or what a
    session's `scored_logits` returns): NLL sum and count, with `logprobs` the log-probs (float32, what a
    reference is made from), and with `reference` (the baseline's log-probs of the same rows) per-position KLD
    and top-1 agreement: against `reference_top1` (the baseline's argmax per row) where given, which a reference
    read back from float16 keeps exact.
    The same arithmetic as window_nll / window_divergence, with one log-sum-exp per row."""
    rows = np.asarray(rows, dtype=np.float32)
    target = np.asarray(window.tokens[window.first_scored:])
    if rows.shape[0] != len(target):
        raise RuntimeError(f"{rows.shape[0]} logit rows for {len(target)} scored tokens")
    lse = _logsumexp(rows)
    nll = lse - rows[np.arange(len(target)), target].astype(np.float64)
    out = {"nll": float(nll.sum()), "count": int(len(target))}
    if reference is None and not logprobs:
        return out
    lp = rows - lse[:, None].astype(np.float32)
    if logprobs:
        out["logprobs"] = lp
    if reference is not None:
        if reference.shape != lp.shape:
            raise RuntimeError(f"reference log-probs {reference.shape} vs the model's {lp.shape}")
        kld = (np.exp(reference) * (reference - lp)).sum(axis=-1, dtype=np.float64)
        base_top1 = reference.argmax(axis=-1) if reference_top1 is None else reference_top1
        out |= {"kld": np.maximum(kld, 0.0), "top1": base_top1 == rows.argmax(axis=-1)}
    return out


def window_nll(logits: np.ndarray, window: Window) -> tuple[float, int]:
    """Sum of negative log-likelihoods of the scored tokens, and how many were scored."""
    rows, target = _scored(logits, window)
    nll = _logsumexp(rows) - rows[np.arange(len(target)), target].astype(np.float64)
    return float(nll.sum()), int(len(target))


def scored_logprobs(logits: np.ndarray, window: Window) -> np.ndarray:
    """Log-softmax (float32) of the logit rows that predict scored tokens: what a reference stores."""
    rows, _ = _scored(logits, window)
    return rows - _logsumexp(rows)[:, None].astype(np.float32)


def divergence_from_logprobs(p: np.ndarray, logits: np.ndarray, window: Window) -> dict:
    """KL(base ‖ variant) per scored position from the base's scored log-probs `p`, and top-1 agreement."""
    q_rows, _ = _scored(logits, window)
    if p.shape != q_rows.shape:
        raise RuntimeError(f"reference log-probs {p.shape} vs variant's scored logits {q_rows.shape}")
    q = q_rows - _logsumexp(q_rows)[:, None].astype(np.float32)
    kld = (np.exp(p) * (p - q)).sum(axis=-1, dtype=np.float64)
    return {"kld": np.maximum(kld, 0.0), "top1": p.argmax(axis=-1) == q_rows.argmax(axis=-1)}


def window_divergence(base_logits: np.ndarray, logits: np.ndarray, window: Window) -> dict:
    """KL(base ‖ variant) per scored position, and whether both pick the same top-1 token."""
    return divergence_from_logprobs(scored_logprobs(base_logits, window), logits, window)


def summarize(nlls: list[tuple[float, int]]) -> dict:
    total = sum(n for n, _ in nlls)
    count = sum(c for _, c in nlls)
    return {"ppl": math.exp(total / count), "nll_per_token": total / count, "tokens_scored": count, "windows": len(nlls)}
