"""llama.cpp runtime (through llama-cpp-python): logits of token windows from a GGUF file."""

from __future__ import annotations

import json
import time
from pathlib import Path

from qbuild.evaluate.data import load_tokens
from qbuild.evaluate.protocol import fixed_windows, summarize, window_nll
from qbuild.step import StepContext


def gguf_file(artifact_dir: Path) -> Path:
    files = sorted(artifact_dir.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"expected one .gguf file in {artifact_dir}, found {len(files)}")
    return files[0]


def load(path: Path, n_ctx: int, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                 n_threads=threads, n_threads_batch=threads, verbose=False)


def perplexity(ctx: StepContext) -> dict:
    import llama_cpp

    p = ctx.params
    ids, info = load_tokens(ctx.inputs["data"])
    windows = fixed_windows(ids, p["context_length"], p["add_bos"], info["bos_token_id"], p["max_windows"])
    t0 = time.perf_counter()
    llm = load(gguf_file(ctx.inputs["model"]), p["context_length"], ctx.threads)
    nlls = []
    for i, w in enumerate(windows):
        llm.reset()
        llm.eval(w.tokens)
        nlls.append(window_nll(llm.scores[: len(w.tokens)], w))
        ctx.progress(i + 1, len(windows), "windows")
    result = summarize(nlls)
    result["protocol"] = {k: p[k] for k in ("protocol", "context_length", "max_windows", "add_bos")} | {
        "join": info["join"], "sources": info["sources"], "scored": "every token after BOS/first position"}
    result["runtime"] = {"name": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "threads": ctx.threads,
                         "seconds": time.perf_counter() - t0}
    (ctx.out / "perplexity.json").write_text(json.dumps(result, indent=2))
    return {"format": "metrics", "metrics": {"ppl": result["ppl"], "tokens_scored": result["tokens_scored"]}}
