"""Backend environments: creation cold vs warm, and a step's overhead in its own environment.

    .venv/bin/python bench/bench_envs.py [--model HF_DIR] [--samples 8 --seq-len 128 --group-size 32]

1. `qbuild env create gptqmodel` in an empty environments directory (cold: resolve the lock with uv, create the
   venv, install from uv's cache), then again (warm: the lock and the environment exist). Goal: warm ≤ 1 s.
2. One gptqmodel GPTQ run on the same model and calibration tokens: as a qbuild step (its worker runs in the
   gptqmodel environment: process start, imports, quantize, save, publish) and as the same library calls made
   directly in that environment's Python, timed inside the process. Goal: qbuild ≤ 1.05× direct; the ratio is
   printed with and without the fresh process's imports, which the direct timing does not include.
The model defaults to the test suite's 2-layer SmolLM2 (tests/conftest.py builds it), so the run takes a minute.
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
DIRECT = """
import os, sys, time, json
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
t0 = time.perf_counter()
from gptqmodel import GPTQModel, QuantizeConfig
from safetensors.numpy import load_file
imports = time.perf_counter() - t0
model, calib, out, bits, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
data = load_file(calib + "/calibration.safetensors")
rows = [{"input_ids": r.astype("int64").tolist(), "attention_mask": m.astype("int64").tolist()}
        for r, m in zip(data["input_ids"], data["attention_mask"])]
config = QuantizeConfig(bits=bits, group_size=group, sym=True, desc_act=False, damp_percent=0.05,
                        true_sequential=True, offload_to_disk=False)
m = GPTQModel.load(model, config, device="cpu")
m.quantize(rows, batch_size=1)
m.save(out)
print(json.dumps({"seconds": time.perf_counter() - t0, "imports": imports}))
"""


def qbuild(*args, env=None) -> str:
    res = subprocess.run([sys.executable, "-m", "qbuild", *map(str, args)], capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if res.returncode != 0:
        sys.exit(f"qbuild {' '.join(map(str, args))} failed:\n{res.stderr[-3000:]}")
    return res.stdout


def timed(*args, env=None) -> float:
    t0 = time.perf_counter()
    qbuild(*args, env=env)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=REPO / ".pytest_cache/d/qbuild-models/smollm2-2layer-v2")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    args.model = args.model.resolve()
    if not (args.model / "config.json").is_file():
        sys.exit(f"{args.model} is not a model directory (run the test suite once, or pass --model)")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        envs = {"QBUILD_ENVS_DIR": str(tmp / "envs")}
        cold = timed("env", "create", "gptqmodel", env=envs)
        warm = sorted(timed("env", "create", "gptqmodel", env=envs) for _ in range(3))[1]
        print(f"env create cold  {cold:7.2f} s   (uv: resolve + venv + install from its cache)")
        print(f"env create warm  {warm:7.2f} s   (median of 3; goal ≤ 1 s: {'met' if warm <= 1 else 'MISSED'})")

        recipe = {"name": "bench-envs", "model": {"source": "local", "path": str(args.model)},
                  "calibration": {"sources": [{"type": "pydocs"}], "samples": args.samples, "seq_len": args.seq_len},
                  "variants": [{"name": "gptq", "method": "gptqmodel", "bits": 4, "group_size": args.group_size}],
                  "evaluation": {"baseline": False, "perplexity": None}, "runtime": {"threads": 1}}
        (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
        python = json.loads(qbuild("env", "create", "gptqmodel", "--json", env=envs))[0]["python"]
        steps_s, directs = [], []
        for i in range(args.repeats):      # interleaved, so a busy machine hurts both alike; best of each
            store = tmp / f"store{i}"
            summary = json.loads(qbuild("run", tmp / "r.yaml", "--store", store, "--json", env=envs))
            steps = {s["name"]: s for s in summary["steps"]}
            steps_s.append(steps["quantize[gptq]"]["seconds"])
            calib = json.loads(qbuild("show", steps["calibrate"]["digest"], "--store", store))["path"]
            res = subprocess.run([python, "-c", DIRECT, str(args.model), calib, str(tmp / f"direct{i}"), "4",
                                  str(args.group_size)], capture_output=True, text=True, cwd=tmp,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"})
            if res.returncode != 0:
                sys.exit(f"direct run failed:\n{res.stderr[-3000:]}")
            directs.append(json.loads(res.stdout.strip().splitlines()[-1]))
        t_step = min(steps_s)
        direct = min(directs, key=lambda d: d["seconds"])
    print(f"model            {args.model} ({args.samples} × {args.seq_len} calibration tokens, W4 g{args.group_size})")
    print(f"runs             {args.repeats}, interleaved; best of each (steps {steps_s}, direct "
          f"{[round(d['seconds'], 1) for d in directs]})")
    print(f"direct gptqmodel {direct['seconds']:7.2f} s   (in the environment's Python, after imports)")
    print(f"qbuild step      {t_step:7.2f} s   (worker in the gptqmodel environment: start, imports, quantize, publish)")
    print(f"ratio            {t_step / direct['seconds']:7.3f}   (goal ≤ 1.05)")
    net = t_step - direct["imports"]
    print(f"ratio net of the fresh process's imports ({direct['imports']:.1f} s): {net / direct['seconds']:.3f}")


if __name__ == "__main__":
    main()
