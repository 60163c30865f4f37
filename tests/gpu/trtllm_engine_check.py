"""Load a TensorRT-LLM 1.2.x engine, generate, and score windows from its context logits. Runs INSIDE the
TensorRT-LLM interpreter (stdlib + numpy + tensorrt_llm; never imports qbuild or pytest):

    <trtllm python> trtllm_engine_check.py REQUEST.json RESULT.json
REQUEST: {"engine": dir, "tokenizer": dir, "vocab_size": source model's n, "prompt": text, "windows": [[ids], ...]}
RESULT:  {"text": generated text, "nll": sum of -log p(token | prefix) over tokens 1..n-1 of each window, "count": n}

Context logits are sliced to the source vocabulary and read with KV-cache block reuse off (as qbuild's shim reads
them). Used by tests/gpu/test_trtllm_gpu.py; tests/test_gpu_suite.py runs it on CPU against tests/fake_trtllm.
"""

from __future__ import annotations

import json
import sys


def as_numpy(logits):
    import numpy as np

    if hasattr(logits, "detach"):
        logits = logits.detach().float().cpu().numpy()
    return np.asarray(logits, dtype=np.float64)


def main(request_path: str, result_path: str) -> int:
    import numpy as np
    from tensorrt_llm import SamplingParams
    from tensorrt_llm._tensorrt_engine import LLM
    from tensorrt_llm.llmapi import KvCacheConfig

    with open(request_path) as f:
        req = json.load(f)
    llm = LLM(model=req["engine"], tokenizer=req["tokenizer"], kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    try:
        result = {"text": None, "nll": 0.0, "count": 0}
        if req.get("prompt"):
            result["text"] = llm.generate([req["prompt"]], SamplingParams(max_tokens=8))[0].outputs[0].text
        for i, w in enumerate(req["windows"]):
            out = llm.generate([w], SamplingParams(max_tokens=1, return_context_logits=True))[0]
            if out.context_logits is None:
                raise RuntimeError(f"window {i}: no context logits (the engine is built without gather_context_logits)")
            logits = as_numpy(out.context_logits)[:, : req["vocab_size"]]
            logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            result["nll"] -= float(logp[np.arange(len(w) - 1), np.asarray(w[1:])].sum())
            result["count"] += len(w) - 1
    finally:
        getattr(llm, "shutdown", lambda: None)()
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
