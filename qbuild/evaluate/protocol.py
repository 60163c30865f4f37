"""Perplexity protocols: how token windows are cut and which positions are scored.

Runtimes only turn a window of token ids into logits; everything else lives here, so the same
protocol gives the same number through any runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Window:
    tokens: list[int]   # what the runtime is fed
    first_scored: int   # positions >= first_scored are scored (predicted from the prefix)


def fixed_windows(ids: np.ndarray, context_length: int, add_bos: bool, bos_id: int | None, max_windows: int | None) -> list[Window]:
    """Concatenated text in non-overlapping windows (GPTQ/AWQ papers). BOS, if added, is never scored."""
    body = context_length - 1 if add_bos else context_length
    n = len(ids) // body
    if max_windows:
        n = min(n, max_windows)
    windows = []
    for i in range(n):
        chunk = [int(t) for t in ids[i * body: (i + 1) * body]]
        if add_bos:
            windows.append(Window([bos_id] + chunk, 1))
        else:
            windows.append(Window(chunk, 1))
    return windows


def window_nll(logits: np.ndarray, window: Window) -> tuple[float, int]:
    """Sum of negative log-likelihoods of the scored tokens, and how many were scored.

    logits[i] predicts tokens[i + 1]; computed in float64 for a stable log-sum-exp.
    """
    tokens = np.asarray(window.tokens)
    pred = logits[window.first_scored - 1: len(tokens) - 1].astype(np.float64)
    target = tokens[window.first_scored:]
    m = pred.max(axis=1, keepdims=True)
    logz = (m[:, 0] + np.log(np.exp(pred - m).sum(axis=1)))
    nll = logz - pred[np.arange(len(target)), target]
    return float(nll.sum()), int(len(target))


def summarize(nlls: list[tuple[float, int]]) -> dict:
    total = sum(n for n, _ in nlls)
    count = sum(c for _, c in nlls)
    return {"ppl": math.exp(total / count), "nll_per_token": total / count, "tokens_scored": count, "windows": len(nlls)}
