"""Test-only stub of vLLM's offline API (see tests/fake_vllm/README.md). Not vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__version__ = "0.0.0+fake"


def fake_logprobs(tokens: list[int], vocab: int) -> np.ndarray:
    """Deterministic log-softmax rows: row p depends on tokens[p] only (a fixed bigram table)."""
    t = np.asarray(tokens, dtype=np.int64)
    logits = np.zeros((len(t), vocab), dtype=np.float64)
    rows = np.arange(len(t))
    logits[rows, (t * 5 + 1) % vocab] = 3.0
    logits[rows, (t + 2) % vocab] += 1.5
    return (logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)).astype(np.float32)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SamplingParams:
    __struct_fields__ = ("max_tokens", "temperature", "prompt_logprobs", "logprobs", "detokenize", "min_tokens",
                         "ignore_eos")   # no flat_logprobs: the shim must leave it out, as for an older vLLM

    def __init__(self, **kw):
        unknown = set(kw) - set(self.__struct_fields__)
        if unknown:
            raise TypeError(f"unexpected SamplingParams arguments: {sorted(unknown)}")
        self.kw = kw


class _Completion:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


class _RequestOutput:
    def __init__(self, prompt_logprobs, outputs):
        self.prompt_logprobs, self.outputs = prompt_logprobs, outputs


def _entry(row: np.ndarray) -> dict:
    return {int(i): Logprob(float(v)) for i, v in enumerate(row)}


class LLM:
    def __init__(self, model, **kw):
        cfg = json.loads((Path(model) / "config.json").read_text())
        self.vocab, self.kw = cfg["vocab_size"], kw
        if kw.get("max_logprobs") != -1 or kw.get("enable_prefix_caching") is not False \
                or kw.get("logprobs_mode") != "raw_logprobs" or not kw.get("skip_tokenizer_init"):
            raise ValueError(f"the stub insists on exact full-vocabulary log-probs, got {kw}")

    def generate(self, prompts, params, use_tqdm=True):
        outs = []
        for p in prompts:
            tokens = list(p["prompt_token_ids"])
            if len(tokens) + params.kw["max_tokens"] > self.kw["max_model_len"]:
                raise ValueError("prompt + max_tokens exceeds max_model_len")
            rows = fake_logprobs(tokens, self.vocab)
            plp = None
            if params.kw.get("prompt_logprobs") == -1:
                plp = [None] + [_entry(rows[i - 1]) for i in range(1, len(tokens))]
            seq, generated, sample_lps = list(tokens), [], []
            for _ in range(params.kw["max_tokens"]):
                row = fake_logprobs(seq, self.vocab)[-1]
                generated.append(int(row.argmax()))
                if params.kw.get("logprobs") == -1:
                    sample_lps.append(_entry(row))
                seq.append(generated[-1])
            outs.append(_RequestOutput(plp, [_Completion(generated, sample_lps or None)]))
        return outs
