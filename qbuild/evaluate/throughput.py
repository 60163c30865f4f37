"""Throughput/latency step runner: prefill and decode speed, TTFT and per-token latency percentiles.

Each figure is the median (latencies: the percentile of every token) of the repetitions, and from two repetitions on
carries a seeded 95 % bootstrap interval (`*_ci`, [lo, hi]; qbuild.base.bootstrap): repetitions drawn with
replacement, then the tokens within each, so the same samples always give the same interval.
"""

from __future__ import annotations

import json
import statistics

import numpy as np

from qbuild.base.bootstrap import two_level_intervals
from qbuild.base.fingerprint import cpu_model
from qbuild.contract.plugin import open_session
from qbuild.contract.step import StepContext


def run(ctx: StepContext) -> dict:
    p = ctx.params
    session = open_session(p["runtime"], ctx.inputs["model"], ctx, p["input_len"] + p["output_len"] + 1)
    if session.own_throughput:   # a runtime with its own benchmark tool (trtllm-bench)
        return session.throughput(ctx, p)
    return measure(session, ctx, p)


SEED = 0   # of every interval: a rerun on the same samples gives the same interval
CI_FIELDS = ("prefill_tok_s", "decode_tok_s", "token_latency_ms_p50", "token_latency_ms_p99")


def measure(rt, ctx: StepContext, p: dict) -> dict:
    """Throughput through a session's generate_timed: warm-up, repetitions, medians, spread and 95 % intervals."""
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
        per_rep = [np.asarray(r["decode_s"], dtype=float) * 1000 for r in reps]
        lat = np.concatenate(per_rep)
        ttft = [r["prefill_s"] * 1000 for r in reps]
        results.append({
            "batch_size": bs,
            "prefill_tok_s": statistics.median(prefill), "prefill_tok_s_stdev": _stdev(prefill),
            "decode_tok_s": statistics.median(decode), "decode_tok_s_stdev": _stdev(decode),
            "ttft_ms": statistics.median(ttft),
            "token_latency_ms_p50": float(np.percentile(lat, 50)), "token_latency_ms_p95": float(np.percentile(lat, 95)),
            "token_latency_ms_p99": float(np.percentile(lat, 99)),
            **_intervals(prefill, decode, per_rep),
        })
    hardware = {"cpu": cpu_model(), "threads": ctx.threads} | {k: v for k, v in rt.info().items() if k in ("gpu", "sm")}
    settings = {k: p[k] for k in ("input_len", "output_len", "warmup", "repetitions", "batch_sizes")}
    out = {"results": results, "settings": settings, "runtime": rt.info(), "hardware": hardware}
    (ctx.out / "throughput.json").write_text(json.dumps(out, indent=2))
    first = results[0]
    return {"format": "metrics", "metrics": {"decode_tok_s": first["decode_tok_s"], "prefill_tok_s": first["prefill_tok_s"],
                                             "ttft_ms": first["ttft_ms"], "token_latency_ms_p95": first["token_latency_ms_p95"],
                                             **{k: first[k] for k in ("token_latency_ms_p50", "token_latency_ms_p99")},
                                             **{f"{k}_ci": first[f"{k}_ci"] for k in CI_FIELDS}}}


def _intervals(prefill: list[float], decode: list[float], latencies_ms: list[np.ndarray]) -> dict:
    """`<figure>_ci` of each of CI_FIELDS: the rates' medians over resampled repetitions (one value each), the
    latency percentiles over resampled repetitions and their tokens; None with one repetition."""
    median = {"median": np.median}
    rates = {name: (two_level_intervals([[v] for v in values], median, SEED) or {}).get("median")
             for name, values in (("prefill_tok_s", prefill), ("decode_tok_s", decode))}
    latency = two_level_intervals(latencies_ms, {"p50": lambda a: np.percentile(a, 50),
                                                 "p99": lambda a: np.percentile(a, 99)}, SEED) or {}
    return {"prefill_tok_s_ci": rates["prefill_tok_s"], "decode_tok_s_ci": rates["decode_tok_s"],
            "token_latency_ms_p50_ci": latency.get("p50"), "token_latency_ms_p99_ci": latency.get("p99")}


def _stdev(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0
