"""Each method's qbuild step against the same library call made directly, with the same settings and tokens.

    .venv/bin/python bench/bench_method_overhead.py awq fp8-static smoothquant gptq imatrix \
        [--model HF_DIR] [--samples 8 --seq-len 256] [--llama-imatrix PATH]

For each method, qbuild runs a one-variant recipe; its quantize step's wall time comes from the run summary
(process start, imports, the library call, save, publish). The direct run makes the same call in a fresh
Python: llm-compressor's `oneshot` with the modifiers qbuild's method builds from the same params (the step's
manifest), on the same calibration tokens (qbuild's calibrate artifact), then `save_pretrained`. It reports
its import time separately, so the ratio is printed with and without process start and imports.

imatrix: qbuild's step runs llama-imatrix (built from the vendored llama.cpp); the direct run is the same binary
with the same command line on the same F16 GGUF and calibration text, so the ratio is the step's overhead over the
tool itself (issue 21: ≤ 1.1). Goal (issue 11): each other ratio net of process start ≤ 1.05.
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

VARIANTS = {
    "gptq": {"method": "gptq", "bits": 4, "group_size": 64, "sym": False},
    "awq": {"method": "awq", "bits": 4, "group_size": 64},
    "fp8-static": {"method": "fp8", "scheme": "static"},
    "smoothquant": {"method": "smoothquant"},
    "imatrix": {"method": "gguf", "type": "Q4_K_M", "imatrix": True},
}

DIRECT_ONESHOT = """
import json, sys, time
t0 = time.perf_counter()
import torch
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer
from qbuild.plugins import methods
from qbuild.quantize.llmcompressor import run as lc
imports = time.perf_counter() - t0
model, calib, out, method, params = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
torch.set_num_threads(1)
t0 = time.perf_counter()
plugin = methods.get(method)
m = AutoModelForCausalLM.from_pretrained(model, dtype="auto")
dataset, shape = lc.calibration_dataset(__import__("pathlib").Path(calib))
import contextlib
with contextlib.ExitStack() as stack:
    w = plugin.workarounds()
    if w is not None:
        stack.enter_context(w)
    stack.enter_context(torch.no_grad())
    oneshot(model=m, recipe=plugin.modifiers(params), dataset=dataset, num_calibration_samples=int(shape[0]),
            max_seq_length=int(shape[1]), shuffle_calibration_samples=False)
m.save_pretrained(out, save_compressed=True)
AutoTokenizer.from_pretrained(model).save_pretrained(out)
print(json.dumps({"seconds": time.perf_counter() - t0, "imports": imports}))
"""


def qbuild(*args) -> str:
    res = subprocess.run([sys.executable, "-m", "qbuild", *map(str, args)], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"qbuild {' '.join(map(str, args))} failed:\n{res.stderr[-3000:]}")
    return res.stdout


def direct_oneshot(model: Path, calib: str, out: Path, method: str, params: dict) -> dict:
    res = subprocess.run([sys.executable, "-c", DIRECT_ONESHOT, str(model), calib, str(out), method, json.dumps(params)],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                              "PYTHONPATH": str(REPO)})
    if res.returncode != 0:
        sys.exit(f"direct {method} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def direct_llama_imatrix(binary: Path, model: Path, gguf: str, calib: str, tmp: Path) -> dict:
    """llama-imatrix itself with the step's command line and calibration text (qbuild.quantize.gguf.run)."""
    from qbuild.quantize.gguf.run import llama_imatrix_command, write_calibration_text

    text = tmp / "calib.txt"
    seq_len = write_calibration_text(model, Path(calib), text)
    t0 = time.perf_counter()
    res = subprocess.run(llama_imatrix_command(binary, Path(gguf), text, tmp / "imatrix.gguf", seq_len, 1),
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"llama-imatrix failed:\n{res.stderr[-3000:]}")
    return {"seconds": time.perf_counter() - t0, "imports": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("methods", nargs="+", choices=sorted(VARIANTS))
    ap.add_argument("--model", type=Path, default=REPO / ".pytest_cache/d/qbuild-models/smollm2-135m-v2")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--llama-imatrix", type=Path, help="llama-imatrix binary (default: the one qbuild built)")
    args = ap.parse_args()
    args.model = args.model.resolve()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.methods:
            recipe = {"name": f"bench-{name}", "model": {"source": "local", "path": str(args.model)},
                      "calibration": {"sources": [{"type": "pydocs"}], "samples": args.samples,
                                      "seq_len": args.seq_len},
                      "variants": [{"name": "v", **VARIANTS[name]}],
                      "evaluation": {"baseline": False, "perplexity": None}, "runtime": {"threads": 1}}
            (tmp / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
            store = tmp / "store"
            summary = json.loads(qbuild("run", tmp / f"{name}.yaml", "--store", store, "--json"))
            steps = {s["name"]: s for s in summary["steps"]}
            calib = json.loads(qbuild("show", steps["calibrate"]["digest"], "--store", store))["path"]
            if name == "imatrix":
                step = next(s for n, s in steps.items() if n.startswith("imatrix"))
                if not args.llama_imatrix:
                    from qbuild.models.llamacpp_toolchain import tool

                    args.llama_imatrix = tool("llama-imatrix")
                f16 = next(s for n, s in steps.items() if n.startswith("gguf-convert"))
                gguf = str(Path(json.loads(qbuild("show", f16["digest"], "--store", store))["path"]) / "model.gguf")
                direct = direct_llama_imatrix(args.llama_imatrix, args.model, gguf, calib, tmp)
            else:
                step = steps["quantize[v]"]
                params = json.loads(qbuild("show", step["digest"], "--store", store))["params"]
                direct = direct_oneshot(args.model, calib, tmp / f"direct-{name}", VARIANTS[name]["method"], params)
            rows.append((name, step["seconds"], direct))
    print(f"model {args.model}, calibration {args.samples} × {args.seq_len} tokens, 1 thread")
    print(f"{'method':12} {'direct s':>9} {'imports s':>9} {'qbuild s':>9} {'ratio':>7} {'net of start':>12}")
    for name, t_step, d in rows:
        print(f"{name:12} {d['seconds']:9.1f} {d['imports']:9.1f} {t_step:9.1f} {t_step / d['seconds']:7.3f} "
              f"{(t_step - d['imports']) / d['seconds']:12.3f}")


if __name__ == "__main__":
    main()
