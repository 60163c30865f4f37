"""Throughput/latency step runner: prefill and decode speed, TTFT and per-token latency percentiles."""

from __future__ import annotations

import json
import statistics

import numpy as np

from qbuild.base.fingerprint import cpu_model
from qbuild.contract.plugin import open_session
from qbuild.contract.step import StepContext


def run(ctx: StepContext) -> dict:
    p = ctx.params
    session = open_session(p["runtime"], ctx.inputs["model"], ctx, p["input_len"] + p["output_len"] + 1)
    if session.own_throughput:   # a runtime with its own benchmark tool (trtllm-bench)
        return session.throughput(ctx, p)
    return measure(session, ctx, p)


def measure(rt, ctx: StepContext, p: dict) -> dict:
    """Throughput through a session's generate_timed: warm-up, repetitions, medians and spread."""
    rng = np.random.default_rng(0)
    results = []
    total = len(p["batch_sizes"]) * (p["warmup"] + p["repetitions"])
    done = 0
    for bs in p["batch_sizes"]:
        prompts = rng.integers(100, 1000, size=(bs, p["input_len"])).tolist()  # fixed ids: speed only
        reps = []
        for rep in range(p["warmup"] + p["repetitions"]):
            r = rt.generate_timed(prompts, p["output_len"])
            if rep >= p["warmup"]:
                reps.append(r)
            done += 1
            ctx.progress(done, total, f"batch {bs}")
        prefill = [bs * p["input_len"] / r["prefill_s"] for r in reps]
        decode = [bs * len(r["decode_s"]) / sum(r["decode_s"]) for r in reps]
        lat = np.concatenate([r["decode_s"] for r in reps]) * 1000
        ttft = [r["prefill_s"] * 1000 for r in reps]
        results.append({
            "batch_size": bs,
            "prefill_tok_s": statistics.median(prefill), "prefill_tok_s_stdev": _stdev(prefill),
            "decode_tok_s": statistics.median(decode), "decode_tok_s_stdev": _stdev(decode),
            "ttft_ms": statistics.median(ttft),
            "token_latency_ms_p50": float(np.percentile(lat, 50)), "token_latency_ms_p95": float(np.percentile(lat, 95)),
        })
    hardware = {"cpu": cpu_model(), "threads": ctx.threads} | {k: v for k, v in rt.info().items() if k in ("gpu", "sm")}
    settings = {k: p[k] for k in ("input_len", "output_len", "warmup", "repetitions", "batch_sizes")}
    out = {"results": results, "settings": settings, "runtime": rt.info(), "hardware": hardware}
    (ctx.out / "throughput.json").write_text(json.dumps(out, indent=2))
    first = results[0]
    return {"format": "metrics", "metrics": {"decode_tok_s": first["decode_tok_s"], "prefill_tok_s": first["prefill_tok_s"],
                                             "ttft_ms": first["ttft_ms"], "token_latency_ms_p95": first["token_latency_ms_p95"]}}


def _stdev(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0
