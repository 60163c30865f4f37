"""qbuild's serving client against guidellm 0.8 (vllm-project's serving benchmark) on one llama-server.

    qbuild recipes/demo.yaml                                   # the demo's Q4_K_M and its HF checkpoint
    flock /tmp/qbuild-heavy.lock .venv/bin/python bench/bench_serving.py --store artifacts

One llama-server (qbuild's build, started by qbuild's lifecycle: 127.0.0.1, free port, --parallel 4, half the cores)
serves the demo's q4km, its prompt cache off. At each concurrency (1 and 4) the same workload (N requests of 128
prompt tokens and 32 output tokens with ignore_eos, streamed over /v1/completions; every run's prompts drawn with
a seed of its own, so none is a cache hit) is driven in turns by qbuild's
client and by `guidellm run` (from .venv-guidellm, which scripts/install.sh dev makes), `--rounds` times. Prints
per concurrency the medians of output tok/s and TTFT p50 of each and their ratios (target: within 5 %), and each
client's CPU seconds as a share of the server's over the same run (target for qbuild's: at most 10 %).
Prompts: qbuild sends seeded random token ids, guidellm its synthetic text of the same token count (the server's
speed does not depend on which tokens they are; only the lengths match, which is what is compared).
With `--prefix-tokens N` every prompt of both tools starts with one shared prefix of N tokens (qbuild's
evaluation.serving.prefix_tokens, guidellm's synthetic prefix_tokens with prefix_count 1) and the server keeps its
default prompt cache, so what is compared is TTFT with the prefix cached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"
WARMUP = 2   # requests per point left out of both tools' numbers


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of pid onto cpus: the server gets a core the clients never run on."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find_artifacts(store: Path, ref: str) -> tuple[Path, Path]:
    """(the GGUF `ref` names, the demo's HF checkpoint for guidellm's tokenizer) from the store's refs/manifests."""
    from qbuild.artifacts.store import Store

    st = Store(store)
    gguf = next(st.object_dir(st.resolve(ref)).glob("*.gguf"))
    for manifest in store.glob("objects/*/*/manifest.json"):
        m = json.loads(manifest.read_text())
        if m.get("name") == "model" and (manifest.parent / "tokenizer.json").is_file():
            return gguf, manifest.parent
    raise SystemExit(f"no HF checkpoint (step `model`) in {store}: run `qbuild recipes/demo.yaml` first")


def server_prompt_eval_ms(log: Path, offset: int) -> tuple[list[float], int]:
    """llama-server's own prompt-eval times (ms) of the requests it logged after byte `offset`, and the new offset."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    return [float(m) for m in re.findall(r"prompt eval time =\s+([\d.]+) ms", text)], offset + len(text.encode())


def run_qbuild(url: str, model: str, c: int, n: int, input_len: int, output_len: int | dict, seed: int,
               rampup: float, prefix_tokens: int = 0) -> dict:
    from qbuild.serving.bench_step import drawn_lengths
    from qbuild.serving.client import Workload, sweep

    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 20000, size=(n + 2, input_len)).tolist()
    if prefix_tokens:   # one shared prefix (a system prompt) before every prompt, the same in every run
        prefix = np.random.default_rng(12345).integers(100, 20000, size=prefix_tokens).tolist()
        prompts = [prefix + p for p in prompts]
    # each tool draws its own lengths from the same range (guidellm's sampler cannot be given ours)
    lengths = drawn_lengths(output_len, n + WARMUP, seed) if isinstance(output_len, dict) else output_len
    work = Workload(prompts=prompts, output_len=lengths, requests=n, warmup=WARMUP, timeout_s=300, model=model,
                    rampup_s=rampup)
    cpu0 = time.process_time()
    [point] = sweep(url, work, [c])
    return {"output_tok_s": point["output_tok_s"], "ttft_ms_p50": point["ttft_ms_p50"], "errors": point["errors"],
            "client_cpu_s": time.process_time() - cpu0, "ttft_ms": point["samples"]["ttft_ms"],
            "output_lens": lengths if isinstance(lengths, list) else [lengths] * (n + WARMUP)}


def guidellm_lengths(output_len: int | dict) -> dict:
    """guidellm's synthetic output lengths: fixed, or uniform over min..max (its sampler without a stdev)."""
    if not isinstance(output_len, dict):
        return {"output_tokens": output_len}
    return {"output_tokens": (output_len["min"] + output_len["max"]) // 2, "output_tokens_min": output_len["min"],
            "output_tokens_max": output_len["max"]}


def run_guidellm(url: str, model: str, tokenizer: Path, c: int, n: int, input_len: int, output_len: int | dict,
                 out: Path, seed: int, rampup: float, prefix_tokens: int = 0, guidellm: Path = GUIDELLM) -> dict:
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "extras": {"body": {"ignore_eos": True}}}
    cmd = [str(guidellm), "run", "--backend", json.dumps(backend),
           # the same 2 warm-up requests qbuild's client leaves out of its numbers
           "--profile", json.dumps({"kind": "concurrent", "streams": [c],
                                    "warmup": {"mode": "requests", "value": WARMUP},
                                    "rampup_duration": rampup}),
           "--constraint", json.dumps({"kind": "max_requests", "count": n + 2}),
           "--data", json.dumps({"kind": "synthetic_text", "prompt_tokens": input_len, **guidellm_lengths(output_len),
                                 **({"prefix_tokens": prefix_tokens, "prefix_count": 1} if prefix_tokens else {})}),
           "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(tokenizer)}),
           "--seed", json.dumps({"kind": "static", "value": seed}),
           "--output", json.dumps({"kind": "json", "path": str(out)}), "--disable-progress", "--disable-console"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    done = sorted(bench["requests"]["successful"], key=lambda q: q["request_start_time"])
    return {"output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_ms_p50": m["time_to_first_token_ms"]["successful"]["median"],
            "errors": m["request_totals"]["errored"],
            "client_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "ttft_ms": [round(q["time_to_first_token_ms"], 2) for q in done],
            "output_lens": [q["output_tokens"] for q in done]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=REPO / "artifacts")
    ap.add_argument("--ref", default="demo/q4km", help="the GGUF to serve (serving/q4km after recipes/serving.yaml)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rampup", type=float, default=4.0,
                    help="seconds over which both tools start their streams at concurrency > 1 (guidellm's "
                         "rampup_duration, qbuild's rampup_s); 0: all at once")
    ap.add_argument("--prefix-tokens", type=int, default=0,
                    help="a shared prefix of this many tokens before every prompt (guidellm's prefix_tokens with one "
                         "prefix; qbuild's evaluation.serving.prefix_tokens); the server's prompt cache is then on")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens after the prefix")
    ap.add_argument("--output-len", type=int, nargs="+", default=[32], metavar="N",
                    help="tokens per request: one number, or MIN MAX to draw each request's uniformly (both tools)")
    ap.add_argument("--guidellm", type=Path, default=GUIDELLM, help="the guidellm program (a checkout's .venv-guidellm)")
    args = ap.parse_args()
    if not args.guidellm.is_file():
        raise SystemExit(f"{args.guidellm} missing: bash scripts/install.sh dev")
    from qbuild.planning.recipe import ServingConfig
    from qbuild.servers.llamacpp import LlamaServer
    from qbuild.serving.server import running

    gguf, tokenizer = find_artifacts(args.store, args.ref)
    input_len = args.input_len
    output_len = args.output_len[0] if len(args.output_len) == 1 else {"min": args.output_len[0],
                                                                        "max": args.output_len[1]}
    longest = output_len["max"] if isinstance(output_len, dict) else output_len
    threads = max(1, (os.cpu_count() or 2) // 2)
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    # no prompt cache without a prefix: every prompt is new anyway (distinct seeds), and no run may profit from
    # another's; with one, the cache is what is measured (llama-server's default: it keeps each slot's last prompt)
    config = ServingConfig(name="prefix") if args.prefix_tokens else ServingConfig(name="nocache", prefix_caching=False)
    launch = LlamaServer().launch(gguf, config, threads=threads,
                                  slots=max(args.concurrency),
                                  context=args.prefix_tokens + input_len + longest + 8, workdir=tmp)
    results: dict = {c: {"qbuild": [], "guidellm": []} for c in args.concurrency}
    cores = sorted(os.sched_getaffinity(0))
    server_cores = set(cores[:threads])
    client_cores = set(cores[threads:]) or server_cores
    os.sched_setaffinity(0, client_cores)   # this process, its client and guidellm's (a child) stay off the server's
    log = tmp / "server.log"
    with running(launch, log, args.ref) as srv:
        pin(srv.pid, server_cores)
        print(f"llama-server {srv.url} pid {srv.pid}, {threads} thread(s), --parallel {max(args.concurrency)}; "
              f"{args.requests} requests of {input_len}+{output_len} tokens per point, ramp-up {args.rampup} s at "
              f"concurrency > 1; server on CPU {sorted(server_cores)}, clients on {sorted(client_cores)}", flush=True)
        offset = log.stat().st_size
        for r in range(args.rounds):
            for c in args.concurrency:
                rampup = args.rampup if c > 1 else 0.0
                for tool in ("qbuild", "guidellm") if r % 2 == 0 else ("guidellm", "qbuild"):
                    s0 = server_cpu(srv.pid)
                    if tool == "qbuild":
                        res = run_qbuild(srv.url, launch.model_name, c, args.requests, input_len, output_len,
                                         seed=1000 * r + c, rampup=rampup, prefix_tokens=args.prefix_tokens)
                    else:
                        res = run_guidellm(srv.url, launch.model_name, tokenizer, c, args.requests, input_len,
                                           output_len, tmp / f"guidellm-{c}-{r}.json", seed=1000 * r + c + 500,
                                           rampup=rampup, prefix_tokens=args.prefix_tokens, guidellm=args.guidellm)
                    res["server_cpu_s"] = server_cpu(srv.pid) - s0
                    # the server's own prompt-eval times of the same measured requests: what TTFT is made of
                    evals, offset = server_prompt_eval_ms(log, offset)
                    res["server_prompt_eval_ms_p50"] = statistics.median(evals[WARMUP:]) if evals[WARMUP:] else None
                    res["round"] = r
                    results[c][tool].append(res)
                    print(f"round {r} c={c} {tool:8} {res['output_tok_s']:7.2f} tok/s  TTFT p50 "
                          f"{res['ttft_ms_p50']:8.1f} ms (server's prompt eval p50 "
                          f"{res['server_prompt_eval_ms_p50'] or 0:6.1f} ms)  client CPU {res['client_cpu_s']:6.2f} s  "
                          f"server CPU {res['server_cpu_s']:6.2f} s  errors {res['errors']}", flush=True)
    print(f"\n{'conc.':>5} {'qbuild tok/s':>13} {'guidellm':>9} {'ratio':>6} {'qbuild TTFT':>12} {'guidellm':>9} "
          f"{'ratio':>6} {'paired ratios':>14} {'TTFT-eval q/g':>14} {'qbuild CPU/server':>18} "
          f"{'guidellm CPU/server':>20}")
    summary = {}
    for c, by in results.items():
        keys = [k for k in by["qbuild"][0] if k not in ("ttft_ms", "round", "output_lens")]
        med = {t: {k: statistics.median(x[k] for x in by[t] if x[k] is not None) for k in keys} for t in by}
        q, g = med["qbuild"], med["guidellm"]
        # each round's two runs are back to back: their ratio is free of the server's drift between rounds
        pairs = list(zip(by["qbuild"], by["guidellm"], strict=True))
        paired_tok = statistics.median(a["output_tok_s"] / b["output_tok_s"] for a, b in pairs)
        paired_ttft = statistics.median(a["ttft_ms_p50"] / b["ttft_ms_p50"] for a, b in pairs)
        row = {"tok_s_ratio": q["output_tok_s"] / g["output_tok_s"], "ttft_ratio": q["ttft_ms_p50"] / g["ttft_ms_p50"],
               "paired_tok_s_ratio": paired_tok, "paired_ttft_ratio": paired_ttft,
               "qbuild_ttft_over_server_eval_ms": q["ttft_ms_p50"] - q["server_prompt_eval_ms_p50"],
               "guidellm_ttft_over_server_eval_ms": g["ttft_ms_p50"] - g["server_prompt_eval_ms_p50"],
               "qbuild_cpu_share": q["client_cpu_s"] / q["server_cpu_s"],
               "guidellm_cpu_share": g["client_cpu_s"] / g["server_cpu_s"], "qbuild": q, "guidellm": g}
        summary[c] = row
        print(f"{c:5d} {q['output_tok_s']:13.2f} {g['output_tok_s']:9.2f} {row['tok_s_ratio']:6.3f} "
              f"{q['ttft_ms_p50']:10.1f}ms {g['ttft_ms_p50']:7.1f}ms {row['ttft_ratio']:6.3f} "
              f"{paired_tok:6.3f}/{paired_ttft:6.3f} "
              f"{row['qbuild_ttft_over_server_eval_ms']:5.1f}/{row['guidellm_ttft_over_server_eval_ms']:5.1f}ms "
              f"{row['qbuild_cpu_share']:17.1%} {row['guidellm_cpu_share']:19.1%}")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps({"results": results, "summary": summary}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
