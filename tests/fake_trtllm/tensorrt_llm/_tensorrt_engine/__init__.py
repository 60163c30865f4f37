"""Test-only stub of the engine LLM API (see tests/fake_trtllm/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def fake_logits(tokens: list[int], vocab: int) -> np.ndarray:
    """Deterministic 'context logits': row i depends on tokens[i] only (a fixed bigram table)."""
    t = np.asarray(tokens, dtype=np.int64)
    logits = np.zeros((len(t), vocab), dtype=np.float32)
    rows = np.arange(len(t))
    logits[rows, (t * 7 + 3) % vocab] = 4.0123   # not fp16-representable: an fp16 logits engine shows
    logits[rows, (t + 1) % vocab] += 2.0456
    return logits


class _Tensor:  # what the shim touches of a torch tensor
    def __init__(self, a):
        self.a = a

    def detach(self):
        return self

    def float(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.a


class _Output:
    def __init__(self, logits):
        self.context_logits = logits


class LLM:
    def __init__(self, model, tokenizer=None, kv_cache_config=None, **kw):
        cfg = json.loads((Path(model) / "config.json").read_text())
        if not (Path(model) / "rank0.engine").is_file():
            raise RuntimeError(f"{model} is not an engine dir")
        if tokenizer is None or not (Path(tokenizer) / "tokenizer.json").is_file():
            raise RuntimeError(f"tokenizer dir {tokenizer} has no tokenizer.json")
        if kv_cache_config is None or kv_cache_config.kw.get("enable_block_reuse") is not False:
            raise RuntimeError("the stub insists on enable_block_reuse=False (reused blocks lose context logits)")
        self.gather = cfg["build_config"].get("gather_context_logits", False)
        self.vocab = cfg["pretrained_config"]["vocab_size"]
        self.logits_dtype = cfg["pretrained_config"].get("logits_dtype", "float32")
        self.max_input_len = cfg["build_config"]["max_input_len"]

    def generate(self, prompts, sampling_params, use_tqdm=True):
        outs = []
        for p in prompts:
            if len(p) > self.max_input_len:
                raise ValueError(f"prompt of {len(p)} tokens exceeds max_input_len {self.max_input_len}")
            ok = sampling_params.return_context_logits and self.gather
            logits = fake_logits(p, self.vocab)
            if self.logits_dtype != "float32":   # what an fp16 logits output costs: rounding
                logits = logits.astype(np.float16)
            outs.append(_Output(_Tensor(logits) if ok else None))
        return outs

    def shutdown(self):
        pass
