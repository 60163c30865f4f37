"""Engine context logits → per-window NLL. Runs INSIDE the TensorRT-LLM 1.2.x interpreter, never in qbuild's.

qbuild copies this file and protocol.py next to the request and runs
    <trtllm python> _shim.py REQUEST.json RESULT.json
REQUEST: {"engine": dir, "tokenizer": HF dir, "protocol": path of a copy of qbuild/contract/protocol.py,
          "windows": [{"tokens": [...], "first_scored": n}, ...], "vocab_size": source model's n | null,
          "batch": n, "logits_dir": dir | null}
RESULT:  {"nll": [[nll_sum, tokens_scored], ...], "runtime": {...}, "seconds": s}

The windows are cut by qbuild (protocol.windows) and scored here with protocol.py's own window_nll,
loaded by file path (it needs numpy only), so an engine's number is computed exactly as every other
runtime's. With logits_dir, each window's logits are also saved as <i>.npy (float32) for KLD.
Uses only stdlib + numpy + tensorrt_llm; does not import qbuild.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time


def load_protocol(path: str):
    spec = importlib.util.spec_from_file_location("qbuild_protocol", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def as_numpy(logits):
    import numpy as np

    if hasattr(logits, "detach"):  # a torch tensor (on the GPU)
        logits = logits.detach().float().cpu().numpy()
    return np.asarray(logits, dtype=np.float32)


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    proto = load_protocol(req["protocol"])
    import numpy as np
    import tensorrt_llm
    from tensorrt_llm import SamplingParams
    from tensorrt_llm._tensorrt_engine import LLM  # the TensorRT engine backend of the LLM API (1.2.x)
    from tensorrt_llm.llmapi import KvCacheConfig

    t0 = time.perf_counter()
    # no KV-cache block reuse: a reused prefix would not be recomputed, so its context logits could be missing
    llm = LLM(model=req["engine"], tokenizer=req["tokenizer"], kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, return_context_logits=True)
    wins = [proto.Window(list(w["tokens"]), int(w["first_scored"])) for w in req["windows"]]
    vocab, batch = req.get("vocab_size"), max(1, int(req.get("batch") or 1))
    nll = []
    for start in range(0, len(wins), batch):
        chunk = wins[start: start + batch]
        outs = llm.generate([w.tokens for w in chunk], params, use_tqdm=False)
        for i, (w, out) in enumerate(zip(chunk, outs, strict=True)):
            if out.context_logits is None:
                raise RuntimeError("the engine returned no context logits: build it with gather_context_logits: true")
            logits = as_numpy(out.context_logits)
            if vocab:
                if logits.shape[1] < vocab:
                    raise RuntimeError(f"the engine returned {logits.shape[1]} logit columns for a {vocab}-token vocabulary")
                logits = logits[:, :vocab]  # the source vocabulary: padded columns (AWQ, TP) are not tokens
            if logits.shape[0] != len(w.tokens):
                raise RuntimeError(f"window {start + i}: {logits.shape[0]} context-logit rows for {len(w.tokens)} tokens")
            nll.append(list(proto.window_nll(logits, w)))
            if req.get("logits_dir"):
                np.save(f"{req['logits_dir']}/{start + i}.npy", logits)
        print(f"[trtllm-shim] {min(start + batch, len(wins))}/{len(wins)} windows", flush=True)
    runtime = {"name": "tensorrt-llm", "api": "tensorrt_llm._tensorrt_engine.LLM",
               "tensorrt_llm": getattr(tensorrt_llm, "__version__", None), "load_seconds": round(load_s, 3)}
    try:
        import torch

        runtime["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()
    with open(result_path, "w") as f:
        json.dump({"nll": nll, "runtime": runtime, "seconds": time.perf_counter() - t0}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
