"""qbuild's capacity search against a guidellm 0.8 sweep, on one llama-server serving the demo's q8_0.

    qbuild recipes/demo.yaml                                   # the demo's GGUF variants and its HF checkpoint
    flock /tmp/qbuild-heavy.lock .venv/bin/python bench/bench_capacity.py --store artifacts --slo-ttft-p99 1500

One llama-server (qbuild's build and lifecycle: 127.0.0.1, a free port, --parallel 4, `--server-threads` threads
(default 1, on a core of its own; 2 on a 2-core machine is where batching four requests pays, so a sweep's poisson
rates hold the capacity: docs/serving.md, runs 8-11), its prompt cache off so no request profits from another's)
serves the demo's q8_0. On it, in turn:

* qbuild's capacity search (qbuild.serving.capacity_step.search with the probes the `capacity[...]` step measures:
  Poisson arrivals, `--rounds` rounds of `--requests` requests per rate, each after one warm-up request; from the
  one-at-a-time rate unless `--start-rps`): the highest grid rate whose TTFT p99 meets the SLO with at most 1 %
  errors;
* `guidellm run --profile sweep` (synchronous, throughput, then poisson rates spread evenly between the two
  measured rates; `--requests` × `--rounds` requests per benchmark, so both tools send as many requests per
  point): the highest rate whose TTFT p99 meets the same SLO with at most 1 % errors (a poisson benchmark's arrival
  rate, or the synchronous benchmark's measured rate), the lowest poisson rate above it that misses, and the rate
  interpolated linearly in TTFT p99 between the two.

Same workload: prompts of `--input-len` tokens (qbuild: seeded random token ids; guidellm: its synthetic text of that
many tokens), `--output-len` tokens each with ignore_eos. Prints both capacities, their ratio (target: within
10 %), both wall times and their ratio (target: the search at most 2× the sweep), and writes
bench/results/capacity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import GUIDELLM, REPO, find_artifacts, pin

MAX_ERROR_PCT = 1.0


def run_qbuild(url: str, model: str, args) -> dict:
    from qbuild.serving.capacity_step import (
        full_batch_verdict,
        grid_index,
        measure_probe,
        one_at_a_time_rps,
        search,
        start_index,
    )

    tokens = np.random.default_rng(0).integers(100, 20000, 200_000)   # prompts: windows of seeded random ids
    w = {"input_len": args.input_len, "output_len": args.output_len, "requests": args.requests, "warmup": 1,
         "rounds": args.rounds, "seed": 0, "timeout_s": 300}

    def measure(k):
        p = measure_probe(url, tokens, w, k, model, args.parallel)
        print(f"  qbuild probe {2 ** (k / 16):.3f}/s: TTFT p99 {p['ttft_ms_p99']} ms {(p.get('ci') or {}).get('ttft_ms_p99', '')}"
              f", {p['errors']} errors, {p['mean_in_flight']} in flight, full-batch throughput "
              f"{p['saturated_rps'] or '-'}/s {p.get('saturated_rps_ci') or ''}, {len(p.get('rounds') or [None])} "
              f"round(s), keeping up: {full_batch_verdict(p)}", flush=True)
        return p

    started = time.monotonic()
    if args.start_rps:
        start = grid_index(args.start_rps)
    else:   # as the capacity step does by default: from the rate the server completes lone requests
        lone = one_at_a_time_rps(url, tokens, w, model)
        print(f"  qbuild: one request at a time {lone:.3f}/s; the search starts there", flush=True)
        start = start_index(lone)
    found = search(measure, {"ttft_p99_ms": args.slo_ttft_p99}, MAX_ERROR_PCT, start)
    found["seconds"] = time.monotonic() - started
    return found


def run_guidellm(url: str, model: str, tokenizer: Path, args, out: Path) -> dict:
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "extras": {"body": {"ignore_eos": True}}}
    warmup = {"mode": "requests", "value": 1}
    # a sweep, or poisson benchmarks at the rates given (where a sweep has none: below its first poisson rate)
    profile = ({"kind": "poisson", "rate": args.guidellm_rates, "warmup": warmup} if args.guidellm_rates else
               {"kind": "sweep", "sweep_size": args.sweep_size, "strategy_type": "poisson", "warmup": warmup})
    cmd = [str(args.guidellm), "run", "--backend", json.dumps(backend), "--profile", json.dumps(profile),
           "--constraint", json.dumps({"kind": "max_requests", "count": args.requests * args.rounds + 1}),
           "--data", json.dumps({"kind": "synthetic_text", "prompt_tokens": args.input_len,
                                 "output_tokens": args.output_len}),
           "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(tokenizer)}),
           "--seed", json.dumps({"kind": "static", "value": 1}),
           "--output", json.dumps({"kind": "json", "path": str(out)}), "--disable-progress", "--disable-console"]
    # guidellm 0.8's poisson strategy seeds random.Random(seed) in each worker process and adds each worker's draws
    # to one shared clock, so with its default 10 processes every inter-arrival gap comes ~10 times in a row: bursts
    # of 10 arrivals, not a Poisson process (seen in its own request_start_time). One process draws one sequence.
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": str(args.guidellm_workers)}
    started = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800, env=env)
    seconds = time.monotonic() - started
    points = []
    for b in json.loads(out.read_text())["benchmarks"]:
        m = b["metrics"]
        starts = np.sort([r["request_start_time"] for r in b["requests"]["successful"]])
        gaps = np.diff(starts)
        strategy = b["config"]["strategy"]
        totals = m["request_totals"]
        done = totals["successful"] + totals["errored"] + totals.get("incomplete", 0)
        rate = strategy.get("rate") or m["requests_per_second"]["successful"]["mean"]
        points.append({"type": strategy["type_"], "rate": rate,
                       "completed_rps": m["requests_per_second"]["successful"]["mean"],
                       # what arrived: the realized rate, and the gaps' coefficient of variation (Poisson: ~1; the
                       # repeated gaps of several worker processes: bursts, higher)
                       "arrived_rps": (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 else None,
                       "gap_cv": float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else None,
                       "ttft_ms_p99": m["time_to_first_token_ms"]["successful"]["percentiles"]["p99"],
                       "error_pct": 100 * (done - totals["successful"]) / done if done else 100.0})
        print(f"  guidellm {points[-1]['type']:11} {rate:.3f}/s: TTFT p99 {points[-1]['ttft_ms_p99']:.1f} ms, "
              f"{points[-1]['error_pct']:.1f} % errors, completed {points[-1]['completed_rps']:.3f}/s; arrivals "
              f"{points[-1]['arrived_rps'] or 0:.3f}/s, gap CV {points[-1]['gap_cv'] or 0:.2f}"
              + (" (a burst: left out)" if burst(points[-1]) else ""), flush=True)
    return {"seconds": seconds, "points": points}


BURST = 1.5   # realized arrivals this many times the nominal rate: a poisson benchmark that sent a burst


def burst(point: dict) -> bool:
    """A poisson benchmark whose requests did not arrive at its rate: guidellm 0.8.1 at times sends a run of them at
    once (seen: arrivals at 56-283/s, gap CV 2.8-6.4, in benchmarks of 6.9-7.6/s, their TTFT p99 ~15 s: the queue of
    the burst). It measured another load than its rate names, so it says nothing of that rate."""
    return point["type"] == "poisson" and (point.get("arrived_rps") or 0) > BURST * point["rate"]


def guidellm_capacity(points: list[dict], slo: float) -> dict:
    """What the sweep says of the capacity: the highest rate meeting the SLO (a poisson benchmark at its arrival rate,
    or the synchronous one at its measured rate: one request at a time is a load the server sustains), the lowest
    poisson rate above it that misses, and where the SLO line is crossed between the two (linear in TTFT p99). The
    throughput benchmark (everything in flight at once) has no arrival rate and is left out, and so is a poisson
    benchmark that sent a burst (`burst`)."""
    rated = sorted((p for p in points if p["type"] in ("poisson", "synchronous") and not burst(p)),
                   key=lambda p: p["rate"])
    ok = [p for p in rated if p["ttft_ms_p99"] <= slo and p["error_pct"] <= MAX_ERROR_PCT]
    best = max(ok, key=lambda p: p["rate"], default=None)
    if best is None:
        return {"capacity_rps": None, "passing_type": None, "failing_rps": None, "interpolated_rps": None}
    above = next((p for p in rated if p["rate"] > best["rate"] and p["type"] == "poisson"), None)
    crossing = None
    if above is not None and above["ttft_ms_p99"] > slo:
        f = (slo - best["ttft_ms_p99"]) / (above["ttft_ms_p99"] - best["ttft_ms_p99"])
        crossing = best["rate"] + f * (above["rate"] - best["rate"])
    return {"capacity_rps": best["rate"], "passing_type": best["type"],
            "failing_rps": above["rate"] if above else None, "interpolated_rps": crossing}


def report(result: dict, slo: float) -> None:
    q, g = result.get("qbuild"), result.get("guidellm")
    if g:
        g.update(guidellm_capacity(g["points"], slo))
    if q:
        print(f"qbuild capacity: {q['capacity_rps']} requests/s (next grid rate {q['next_rps']} missed), "
              f"{q['concurrency']} in flight, {len(q['probes'])} probes, {q['seconds']:.0f} s")
    if g:
        print(f"guidellm sweep: highest passing {g['capacity_rps']} requests/s ({g['passing_type']}), lowest failing "
              f"poisson rate above it {g['failing_rps']}, SLO crossed at {g['interpolated_rps']}; "
              f"{len(g['points'])} benchmarks, {g['seconds']:.0f} s")
    if q and g and q["capacity_rps"] and g["capacity_rps"]:
        result["ratio_to_passing"] = q["capacity_rps"] / g["capacity_rps"]
        result["ratio_to_failing"] = q["capacity_rps"] / g["failing_rps"] if g["failing_rps"] else None
        result["ratio_to_crossing"] = q["capacity_rps"] / g["interpolated_rps"] if g["interpolated_rps"] else None
        result["time_ratio"] = q["seconds"] / g["seconds"]
        print("capacity ratio qbuild/guidellm: " + ", ".join(
            f"{result[k]:.3f} ({what})" for k, what in (("ratio_to_passing", "to its highest passing rate"),
                                                        ("ratio_to_failing", "to its lowest failing rate"),
                                                        ("ratio_to_crossing", "to the interpolated crossing"))
            if result[k]) + f"; time ratio qbuild/guidellm {result['time_ratio']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=REPO / "artifacts")
    ap.add_argument("--ref", default="demo/q8_0")
    ap.add_argument("--slo-ttft-p99", type=float, default=1500.0, help="ms")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--requests", type=int, default=12, help="per round of a qbuild probe")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per qbuild probe (guidellm: requests × rounds)")
    ap.add_argument("--start-rps", type=float, help="the first rate probed (default: the capacity step's: the rate "
                    "the server completes lone requests)")
    ap.add_argument("--sweep-size", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--server-threads", type=int, default=1,
                    help="llama-server threads; with 1 it gets a core of its own and the clients the others, with "
                         "more nothing is pinned")
    ap.add_argument("--only", choices=["qbuild", "guidellm"])
    ap.add_argument("--guidellm-rates", type=lambda v: [float(r) for r in v.split(",")],
                    help="guidellm poisson benchmarks at these rates (comma-separated) instead of a sweep: where the "
                         "sweep has no rate near the capacity (a tight SLO: every poisson rate of the sweep misses)")
    ap.add_argument("--guidellm-workers", type=int, default=1,
                    help="guidellm worker processes (its default 10 repeats each poisson gap 10 times: bursts)")
    ap.add_argument("--guidellm", type=Path, default=GUIDELLM, help="the guidellm program (a checkout's .venv-guidellm)")
    ap.add_argument("--reanalyze", type=Path, help="print the figures of a saved bench/results/capacity.json again")
    args = ap.parse_args()
    if args.reanalyze:
        saved = json.loads(args.reanalyze.read_text())
        return report(saved, float(saved["args"]["slo_ttft_p99"]))
    if not args.guidellm.is_file():
        raise SystemExit(f"{args.guidellm} missing: bash scripts/install.sh dev")
    from qbuild.planning.recipe import ServingConfig
    from qbuild.servers.llamacpp import LlamaServer
    from qbuild.serving.server import running

    gguf, tokenizer = find_artifacts(args.store, args.ref)
    tmp = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    launch = LlamaServer().launch(gguf, ServingConfig(name="nocache", prefix_caching=False), threads=args.server_threads,
                                  slots=args.parallel, context=args.input_len + args.output_len + 8, workdir=tmp)
    result = {"args": {k: str(v) for k, v in vars(args).items()}}
    cores = sorted(os.sched_getaffinity(0))
    server_cores, client_cores = {cores[0]}, set(cores[1:]) or {cores[0]}
    if args.server_threads > 1:
        server_cores = client_cores = set(cores)
    # the clients (this process, its asyncio client, guidellm's worker processes) never take a 1-thread server's
    # core: on a 2-core machine guidellm's workers otherwise slow the server they measure, and the two tools measure
    # two servers
    os.sched_setaffinity(0, client_cores)
    with running(launch, tmp / "server.log", args.ref) as srv:
        pin(srv.pid, server_cores)
        print(f"llama-server {srv.url} pid {srv.pid}, {args.server_threads} thread(s) on CPU {sorted(server_cores)}, "
              f"clients on {sorted(client_cores)}, --parallel {args.parallel}; {args.input_len}+{args.output_len} tokens per "
              f"request; SLO TTFT p99 <= {args.slo_ttft_p99} ms, <= 1 % errors", flush=True)
        if args.only != "guidellm":
            result["qbuild"] = run_qbuild(srv.url, launch.model_name, args)
            srv.check_alive()
        if args.only != "qbuild":
            result["guidellm"] = run_guidellm(srv.url, launch.model_name, tokenizer, args, tmp / "guidellm.json")
    report(result, args.slo_ttft_p99)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
