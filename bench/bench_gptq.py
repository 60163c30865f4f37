"""One GPTQ quantization run directly through llm-compressor and through qbuild: time and perplexity.

    .venv/bin/python bench/bench_gptq.py [--model HF_DIR] [--samples 16 --seq-len 256 --group-size 64]

Both use the same model, the same calibration tokens (qbuild's calibrate artifact) and the same
GPTQModifier settings; qbuild adds its step process, store publish and manifest. Targets (issue 4):
time ratio (qbuild / direct) ≤ 1.05, perplexities equal within noise.
(gptqmodel is not installed beside llm-compressor — see the README's dependency notes — so the direct
baseline is the library qbuild's `gptq` method wraps.)
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

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def qbuild(*args) -> str:
    res = subprocess.run([sys.executable, "-m", "qbuild", *map(str, args)], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"qbuild {' '.join(map(str, args))} failed:\n{res.stderr[-3000:]}")
    return res.stdout


def perplexity(model_dir: Path, tokens_dir: Path, threads: int) -> float:
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.evaluate.data import load_tokens
    from qbuild.runtimes.transformers import TransformersSession

    ids, info = load_tokens(tokens_dir)
    wins = windows(ids, "fixed-window", 512, True, info["bos_token_id"], 8)
    rt = TransformersSession(model_dir, threads, "cpu")
    return summarize([window_nll(rt.logits(w.tokens), w) for w in wins])["ppl"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--store", type=Path, default=REPO / "artifacts")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = args.model or Path(json.loads(qbuild("show", "demo/base", "--store", args.store))["path"])

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store = tmp / "store"
        recipe = {
            "name": "bench-gptq", "model": {"source": "local", "path": str(model)},
            "calibration": {"sources": [{"type": "pydocs"}], "samples": args.samples, "seq_len": args.seq_len},
            "variants": [{"name": "gptq", "method": "gptq", "bits": 4, "group_size": args.group_size, "sym": False}],
            "evaluation": {"baseline": False, "perplexity": {"context_length": 512, "max_windows": 8}},
            "runtime": {"threads": args.threads},
        }
        (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
        summary = json.loads(qbuild("run", tmp / "r.yaml", "--store", store, "--json"))
        steps = {s["name"]: s for s in summary["steps"]}
        manifest = json.loads(qbuild("show", steps["quantize[gptq]"]["digest"], "--store", store))
        t_qbuild = steps["quantize[gptq]"]["seconds"]  # the whole step: process start, quantize, save, publish
        calib = Path(json.loads(qbuild("show", steps["calibrate"]["digest"], "--store", store))["path"])
        tokens = Path(json.loads(qbuild("show", steps["eval-data"]["digest"], "--store", store))["path"])
        ppl_qbuild = summary["variants"][0]["ppl"]

        # direct: the same modifier, model and calibration tokens, in this process
        import torch
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from qbuild.quantize.llmcompressor import run as lc
        from qbuild.quantize.llmcompressor.gptq import GPTQ

        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(str(model), dtype="auto")
        dataset, shape = lc.calibration_dataset(calib)
        oneshot(model=m, recipe=GPTQ().modifiers(manifest["params"]), dataset=dataset,
                num_calibration_samples=int(shape[0]), max_seq_length=int(shape[1]), shuffle_calibration_samples=False)
        out = tmp / "direct"
        m.save_pretrained(str(out), save_compressed=True)
        AutoTokenizer.from_pretrained(str(model)).save_pretrained(str(out))
        t_direct = time.perf_counter() - t0
        ppl_direct = perplexity(out, tokens, args.threads)

    print(f"model            {model}")
    print(f"calibration      {args.samples} × {args.seq_len} tokens, W4A16 g{args.group_size} asym")
    print(f"direct           {t_direct:8.1f} s   PPL {ppl_direct:.3f}")
    print(f"qbuild step      {t_qbuild:8.1f} s   PPL {ppl_qbuild:.3f}")
    print(f"time ratio       {t_qbuild / t_direct:8.3f}   (qbuild / direct; target ≤ 1.05)")
    # the step runs in a fresh process, so it pays the imports this script paid before its timer started
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers; from llmcompressor import oneshot"], check=True)
    t_imports = time.perf_counter() - t0
    print(f"  of which imports {t_imports:6.1f} s in a fresh process; ratio without them "
          f"{(t_qbuild - t_imports) / t_direct:.3f}")


if __name__ == "__main__":
    main()
