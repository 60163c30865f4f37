"""Test-only stub of `trtllm-build` (see tests/fake_trtllm/README.md): writes an engine dir."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    for opt in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        ap.add_argument(f"--{opt}", type=int, required=True)
    for opt in ("kv_cache_type", "gemm_plugin", "gpt_attention_plugin"):
        ap.add_argument(f"--{opt}", required=True)
    for opt in ("use_paged_context_fmha", "use_fp8_context_fmha"):   # qbuild passes both explicitly
        ap.add_argument(f"--{opt}", required=True, choices=["enable", "disable"])
    ap.add_argument("--gather_context_logits", action="store_true")
    ap.add_argument("--logits_dtype", choices=["float16", "float32"], default=None)   # default: the checkpoint's
    a = ap.parse_args()
    ckpt = json.loads((Path(a.checkpoint_dir) / "config.json").read_text())
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    build = {k: getattr(a, k) for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                                        "gather_context_logits")}
    ckpt = {**ckpt, "logits_dtype": a.logits_dtype or ckpt.get("logits_dtype", "float16")}   # as build_model does
    (out / "config.json").write_text(json.dumps({"version": "1.2.1", "pretrained_config": ckpt, "build_config": build}))
    (out / "rank0.engine").write_bytes(b"fake engine")
    return 0
