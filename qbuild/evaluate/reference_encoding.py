"""How a reference object stores the baseline's log-probs: float16, 2 bytes per (scored position, vocabulary entry).

A Gemma-sized vocabulary (262k) over 4,088 scored positions is 4.3 GB in float32 and 2.1 GB in float16, as
llama.cpp's KL-divergence base file (uint16 per entry, scaled per row; qbuild.evaluate.llamacpp_kld). float16 is
chosen over that min/max-scaled uint16 because its error is relative: it is smallest on the entries that carry the
probability mass (KLD weighs each entry by p), it needs no per-row header and no cut-off below the top entry (llama.cpp
drops entries more than 16 nats under it), and the file stays a plain `.npy`.

What is stored, per row (a scored position): log p_i rounded to float16, |δ_i| ≤ 2⁻¹¹·|log p_i| (half a float16
ulp; below 6.1e-5 nats the subnormal step, ≤ 3e-8 nats); and the row's argmax (int32, taken from the float32
log-probs), so top-1 agreement is exact, never decided by two entries that round to the same float16.

On read, each row is renormalized (minus its log-sum-exp): p̃_i = p_i·e^{δ_i − c}, c = log Σ p_i e^{δ_i}. Then the
KLD of a position against a model q moves by Δ = Σ (p̃_i − p_i)(log p_i − log q_i) + KL(p̃‖p): first order in δ
only where p and q differ, and ≥ 0 and second order where they agree (a model against itself reads ≈ 0, not ± the
rounding). `kld_error_bound` gives the bound of |Δ| per position from the log-probs themselves; the measured error
of the mean KLD on the demo is in docs/evaluation.md.
"""

from __future__ import annotations

import numpy as np

DTYPE = "<f2"
TOP1_DTYPE = "<i4"
RELATIVE_ERROR = 2.0 ** -11    # float16 round-to-nearest: half an ulp, relative to the value
SUBNORMAL_ERROR = 2.0 ** -25   # half float16's subnormal step: the bound for |log p| < 2⁻¹⁴


def encode(logprobs: np.ndarray) -> np.ndarray:
    """float32 log-probs [rows × vocab] → what is stored: float16 [rows × vocab]."""
    return np.asarray(logprobs, dtype=np.float32).astype(DTYPE)


def top1(logprobs: np.ndarray) -> np.ndarray:
    """The argmax of each float32 row, stored beside the float16 rows (int32 [rows])."""
    return np.asarray(logprobs).argmax(axis=-1).astype(TOP1_DTYPE)


def decode(stored: np.ndarray) -> np.ndarray:
    """Stored float16 rows → float32 log-probs, each row renormalized so its probabilities sum to 1."""
    lp = np.asarray(stored, dtype=np.float32)
    m = lp.max(axis=-1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(lp - m).sum(axis=-1, dtype=np.float64))
    return lp - lse[:, None].astype(np.float32)


def kld_error_bound(p_logprobs: np.ndarray, q_logprobs: np.ndarray) -> np.ndarray:
    """Per row, the most the KLD of the decoded reference can differ from the float32 one, KL(p ‖ q), given the
    float16 rounding bound a_i ≥ |δ_i|:  Σ p_i r_i |log p_i − log q_i| + Σ p_i r_i²,  r_i = e^{a_i + A} − 1,
    A = log Σ p_i e^{a_i} ≥ |c| (Jensen), the second sum bounding KL(p̃‖p) by its χ². The bound is against exact
    arithmetic: float32 log-probs sum to 1 only within ~1e-6 (their log-sum-exp is rounded to float32), which moves
    a float32 KLD by about that much on its own."""
    lp = np.asarray(p_logprobs, dtype=np.float64)
    lp = lp - np.log(np.exp(lp).sum(axis=-1, keepdims=True))
    a = np.maximum(RELATIVE_ERROR * np.abs(lp), SUBNORMAL_ERROR)
    p = np.exp(lp)
    big_a = np.log((p * np.exp(a)).sum(axis=-1, keepdims=True))
    r = np.expm1(a + big_a)
    return (p * r * np.abs(lp - np.asarray(q_logprobs, dtype=np.float64))).sum(axis=-1) + (p * r * r).sum(axis=-1)
