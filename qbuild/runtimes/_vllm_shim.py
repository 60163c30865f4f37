"""Full-vocabulary log-probs and greedy tokens from vLLM. Runs INSIDE the vLLM interpreter, never in qbuild's.

qbuild copies this file next to the request and runs
    <vllm python> _vllm_shim.py REQUEST.json RESULT.json
REQUEST: {"mode": "logprobs" | "generate", "llm": {LLM(**kwargs)}, "sampling": {SamplingParams(**kwargs)},
          "windows": [[token ids], ...]          (logprobs: one file per window, <out_dir>/<i>.npy)
          "prompt": [token ids], "tokens": n     (generate)
          "out_dir": dir}
RESULT:  {"rows": [n rows of window i, ...] | "generated": [ids], "runtime": {...}, "seconds": s}

Window i's array is float32 [len(tokens) x vocab]: row p is log p(. | tokens[:p+1]), the distribution that
predicts tokens[p+1] (rows as qbuild's runtimes give logits; a log-softmax is its own log-softmax). Rows
0..n-2 come from `prompt_logprobs` (vLLM's entry p+1: the distribution of prompt token p+1 given the
tokens before it; entry 0 is None), row n-1 from the one generated token's `logprobs`. With
prompt_logprobs = logprobs = -1 every entry holds the whole vocabulary (vllm/sampling_params.py), so a
row is complete and PPL/KLD are exact, not a top-k approximation.
Uses only stdlib + numpy + vllm; does not import qbuild.
"""

from __future__ import annotations

import json
import os
import sys
import time


def row_from_entry(entry, vocab: int):
    """One position's log-probs (dict token -> Logprob, or a FlatLogprobs slice) as a dense float32 row."""
    import numpy as np

    row = np.full(vocab, -np.inf, dtype=np.float32)
    ids = np.fromiter((int(t) for t in entry), dtype=np.int64, count=len(entry))
    lps = np.fromiter((float(entry[t].logprob) for t in entry), dtype=np.float32, count=len(entry))
    keep = ids < vocab   # ids past the model's vocabulary (a padded lm_head) are not tokens
    row[ids[keep]] = lps[keep]
    return row


def dense_rows(logprobs, first: int, last: int, vocab: int):
    """Rows first..last-1 of vLLM's per-position log-probs (FlatLogprobs columns when present: no Python object
    per entry), each a dense float32 row."""
    import numpy as np

    out = np.full((last - first, vocab), -np.inf, dtype=np.float32)
    cols = [getattr(logprobs, a, None) for a in ("start_indices", "end_indices", "token_ids", "logprobs")]
    if all(c is not None for c in cols):   # FlatLogprobs (SamplingParams.flat_logprobs)
        starts, ends, ids, lps = (np.asarray(c) for c in cols)
        for r, pos in enumerate(range(first, last)):
            s, e = int(starts[pos]), int(ends[pos])
            keep = ids[s:e] < vocab   # ids past the model's vocabulary (a padded lm_head) are not tokens
            out[r, ids[s:e][keep]] = lps[s:e][keep]
    else:
        for r, pos in enumerate(range(first, last)):
            out[r] = row_from_entry(logprobs[pos], vocab)
    return out


def sampling_params(cls, kwargs: dict):
    """SamplingParams(**kwargs), leaving out flat_logprobs where this vLLM does not have it (older releases)."""
    fields = getattr(cls, "__struct_fields__", None)
    if fields is not None and "flat_logprobs" not in fields:
        kwargs = {k: v for k, v in kwargs.items() if k != "flat_logprobs"}
    return cls(**kwargs)


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    import numpy as np
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**req["llm"])
    load_s = time.perf_counter() - t0
    params = sampling_params(SamplingParams, dict(req["sampling"]))
    result: dict = {}
    if req["mode"] == "generate":
        out = llm.generate([{"prompt_token_ids": list(req["prompt"])}], params, use_tqdm=False)[0]
        result["generated"] = [int(t) for t in out.outputs[0].token_ids]
    else:
        vocab = int(req["vocab_size"])
        rows = []
        for i, tokens in enumerate(req["windows"]):
            out = llm.generate([{"prompt_token_ids": list(tokens)}], params, use_tqdm=False)[0]
            if out.prompt_logprobs is None or not out.outputs[0].logprobs:
                raise RuntimeError("vLLM returned no prompt_logprobs/logprobs: the request asked for both")
            n = len(tokens)
            logprobs = np.empty((n, vocab), dtype=np.float32)
            logprobs[: n - 1] = dense_rows(out.prompt_logprobs, 1, n, vocab)
            logprobs[n - 1] = dense_rows(out.outputs[0].logprobs, 0, 1, vocab)[0]
            if not np.isfinite(logprobs).all():
                raise RuntimeError(f"window {i}: vLLM did not return the whole vocabulary at every position "
                                   "(prompt_logprobs=-1 and logprobs=-1 need LLM(max_logprobs=-1))")
            np.save(f"{req['out_dir']}/{i}.npy", logprobs)
            rows.append(n)
            print(f"[vllm-shim] {i + 1}/{len(req['windows'])} windows", flush=True)
        result["rows"] = rows
    result["runtime"] = {"name": "vllm", "vllm": getattr(vllm, "__version__", None), "load_seconds": round(load_s, 3)}
    try:
        import torch

        result["runtime"]["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    result["seconds"] = time.perf_counter() - t0
    with open(result_path, "w") as f:
        json.dump(result, f)
    shutdown(llm)
    return 0


def shutdown(llm) -> None:
    """Stop vLLM's engine process now, while this one is whole (best effort: the name moved across releases)."""
    engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    try:
        engine.shutdown()
    except Exception:
        pass


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    # the work is done and written: skip the interpreter's teardown, where vLLM's CPU build can abort (a native
    # thread left unjoined: "terminate called without an active exception", SIGABRT) after a complete run
    os._exit(code)
