"""Test-only stub of `trtllm-bench ... throughput` (see tests/fake_trtllm/README.md): a report in 1.2.x layout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--model_path", required=True)
    ap.add_argument("command", choices=["throughput"])
    ap.add_argument("--backend", choices=["tensorrt"], required=True)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--num_requests", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--report_json", required=True)
    ap.add_argument("--concurrency", type=int, default=-1)
    ap.add_argument("--max_batch_size", type=int)
    ap.add_argument("--streaming", action="store_true")
    a = ap.parse_args(sys.argv[1:])
    # what the real one reads: an HF config (AutoConfig) at --model_path, the engine's own config.json
    if "model_type" not in json.loads((Path(a.model_path) / "config.json").read_text()):
        raise SystemExit(f"{a.model_path}/config.json is not a Hugging Face config (AutoConfig would fail)")
    engine = json.loads((Path(a.engine_dir) / "config.json").read_text())
    rows = [json.loads(line) for line in Path(a.dataset).read_text().splitlines() if line.strip()]
    assert all(set(r) == {"task_id", "input_ids", "output_tokens"} for r in rows)
    isl, osl = len(rows[0]["input_ids"]), rows[0]["output_tokens"]
    if isl + osl > engine["build_config"]["max_seq_len"]:
        raise SystemExit("dataset exceeds the engine's max_seq_len")
    c = max(a.concurrency, 1)
    pct = lambda base: {"minimum": base * 0.9, "maximum": base * 1.5, "average": base, "p50": base,  # noqa: E731
                        "p90": base * 1.2, "p95": base * 1.25, "p99": base * 1.4}
    report = {
        "engine": {"model": a.model, "model_path": a.model_path, "engine_dir": a.engine_dir, "version": "1.2.1",
                   "backend": "TRT"},
        "machine": {"name": "Fake GPU", "memory.total": 80.0, "clocks.mem": None},
        "request_info": {"num_requests": a.num_requests or len(rows), "avg_input_length": isl, "avg_output_length": osl},
        "performance": {"total_latency_ms": 1000.0, "request_throughput_req_s": 10.0 * c,
                        "system_output_throughput_tok_s": 90.0 * c, "system_total_throughput_tok_s": 500.0 * c,
                        "request_latency_percentiles_ms": pct(100.0)},
    }
    if a.streaming:
        report["streaming_metrics"] = {"token_output_speed_tok_s": 100.0, "avg_ttft_ms": 10.0 * c, "avg_tpot_ms": 10.0,
                                       "ttft_percentiles": pct(10.0 * c), "tpot_percentiles": pct(10.0)}
    Path(a.report_json).write_text(json.dumps(report))
    return 0
