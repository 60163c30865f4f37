"""llama.cpp's KL-divergence base files (`llama-perplexity --kl-divergence-base FILE --save-all-logits`).

Layout, as tools/perplexity/perplexity.cpp writes it (little-endian):

    "_logits_"                       8 bytes of magic
    n_ctx, n_vocab, n_chunk          int32 each
    tokens                           int32 × n_chunk·n_ctx (the text's tokens; BOS is substituted at run time)
    per chunk, per scored position   uint16 × nv, nv = 2·⌈n_vocab/2⌉ + 4:
                                       [0:4]  two float32: scale, min_log_prob
                                       [4:]   q_i: log p_i ≈ scale·q_i + min_log_prob
                                              (0 for tokens more than 16 nats below the top one)

Positions n_ctx/2 … n_ctx-2 of each chunk are stored (they predict tokens n_ctx/2+1 … n_ctx-1): qbuild's
`llama.cpp` protocol scores exactly those. The log-probs are quantized to 16 bits over at most 16 nats:
error ≤ scale/2 = (max-min logit)/131070 ≤ 1.2e-4 nats per entry. KLD is computed llama.cpp's way
(`llamacpp_kld`: only entries above -16 nats contribute), so the number is comparable with its tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"_logits_"


@dataclass
class KldBase:
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray          # int32, n_chunk · n_ctx
    data_offset: int

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def rows_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    @property
    def nv(self) -> int:
        return 2 * ((self.n_vocab + 1) // 2) + 4

    def raw(self, chunk: int) -> np.ndarray:
        """The chunk's stored rows: uint16 [rows_per_chunk × nv]."""
        if not 0 <= chunk < self.n_chunk:
            raise IndexError(f"chunk {chunk} of {self.n_chunk}")
        n = self.rows_per_chunk * self.nv
        with open(self.path, "rb") as f:
            f.seek(self.data_offset + chunk * n * 2)
            out = np.fromfile(f, dtype="<u2", count=n)
        if len(out) != n:
            raise ValueError(f"{self.path}: truncated at chunk {chunk} (a llama-perplexity run that was cut short?)")
        return out.reshape(self.rows_per_chunk, self.nv)

    def logprobs(self, chunk: int) -> np.ndarray:
        """Dequantized base log-probs of a chunk's scored positions: float32 [rows_per_chunk × n_vocab]."""
        raw = self.raw(chunk)
        head = np.ascontiguousarray(raw[:, :4]).view("<f4")   # scale, min_log_prob
        return head[:, :1] * raw[:, 4: 4 + self.n_vocab].astype(np.float32) + head[:, 1:2]

    def chunk_tokens(self, chunk: int) -> np.ndarray:
        return self.tokens[chunk * self.n_ctx: (chunk + 1) * self.n_ctx]


def read_kld_base(path: str | Path) -> KldBase:
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise ValueError(f"{path} is not a llama-perplexity logits file (no '_logits_' magic)")
        n_ctx, n_vocab, n_chunk = (int(x) for x in np.fromfile(f, dtype="<i4", count=3))
        tokens = np.fromfile(f, dtype="<i4", count=n_chunk * n_ctx)
        if len(tokens) != n_chunk * n_ctx:
            raise ValueError(f"{path}: truncated token block")
        base = KldBase(path, n_ctx, n_vocab, n_chunk, tokens, f.tell())
    expected = base.data_offset + n_chunk * base.rows_per_chunk * base.nv * 2
    if path.stat().st_size < expected:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, a file of {n_chunk} chunks has {expected}")
    return base


def encode_rows(logits: np.ndarray, n_vocab: int) -> np.ndarray:
    """llama.cpp's 16-bit log-prob encoding of logit rows [rows × n_vocab] → uint16 [rows × nv]."""
    logits = np.asarray(logits, dtype=np.float32)
    rows = len(logits)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    out = np.zeros((rows, nv), dtype="<u2")
    mx = logits.max(axis=1)
    mn = np.maximum(logits.min(axis=1), mx - 16)
    lse = np.log(np.exp(logits - mx[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
    min_log_prob = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    head = np.stack([scale, min_log_prob], axis=1).astype("<f4")
    out[:, :4] = head.view("<u2").reshape(rows, 4)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(logits > mn[:, None], np.rint((logits - mn[:, None]) * (1 / scale)[:, None]), 0)
    q = np.where(scale[:, None] > 0, q, 0)
    out[:, 4: 4 + n_vocab] = np.clip(q, 0, 65535).astype("<u2")
    return out


def write_kld_base(path: str | Path, tokens: np.ndarray, n_ctx: int, chunk_logits) -> None:
    """Write a file in llama-perplexity's layout: `chunk_logits` yields each chunk's logits of positions
    n_ctx/2 … n_ctx-2 ([n_ctx-1-n_ctx/2 × n_vocab]). `tokens` holds n_chunk · n_ctx token ids."""
    tokens = np.asarray(tokens, dtype="<i4")
    n_chunk = len(tokens) // n_ctx
    with open(path, "wb") as f:
        f.write(MAGIC)
        first = True
        for logits in chunk_logits:
            if first:
                n_vocab = np.asarray(logits).shape[1]
                np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tofile(f)
                tokens[: n_chunk * n_ctx].tofile(f)
                first = False
            encode_rows(logits, n_vocab).tofile(f)


def llamacpp_kld(base_logprobs: np.ndarray, logits: np.ndarray) -> dict:
    """Per-position KL(base ‖ model) and top-1 agreement as llama-perplexity --kl-divergence computes them:
    base entries at or below -16 nats are left out of the sum."""
    logits = np.asarray(logits, dtype=np.float32)
    mx = logits.max(axis=1)
    lse = np.log(np.exp(logits - mx[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
    log_q = logits - (mx + lse)[:, None]
    keep = base_logprobs > -16
    p = np.where(keep, np.exp(np.where(keep, base_logprobs, 0)), 0)
    kld = (p * (base_logprobs - log_q)).sum(axis=1, dtype=np.float64)
    return {"kld": kld, "top1": base_logprobs.argmax(axis=1) == logits.argmax(axis=1)}
