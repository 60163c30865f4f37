"""qbuild's task step vs lm-eval run directly, on the demo's HF baseline and the shipped local task.

    .venv/bin/python bench/bench_tasks.py --store /tmp/demo-store      # a store the demo recipe was run into
    .venv/bin/python bench/bench_tasks.py --store S --runs 3 --threads 1

Target (issue 23): the qbuild step's time ≤ 1.1x lm-eval's direct run on the same model and data, and the same
accuracy. Both sides are whole processes that import torch and lm-eval, load the model and run the task:

- direct: `python -m lm_eval run --model hf --model_args pretrained=<baseline dir>,dtype=float32 --tasks pystdlib_mc
  --include_path tests/tasks/pystdlib_mc --batch_size 1 --device cpu`, run from the task directory, its wall time;
- qbuild: the demo's `task:pystdlib_mc[baseline]` step re-executed by `qbuild verify --rebuild DIGEST`, the rebuilt
  step's own wall time as the executor records it (its worker process, spawn to exit).

Runs alternate (A B A B ...) with the same thread count (OMP_NUM_THREADS / --threads); the median ratio is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASK = "pystdlib_mc"
TASK_DIR = REPO / "tests" / "tasks" / TASK


def demo_summary(store: Path) -> dict:
    res = subprocess.run([sys.executable, "-m", "qbuild", "run", str(REPO / "recipes" / "demo.yaml"), "--store",
                          str(store), "--json"], capture_output=True, text=True)
    if res.returncode not in (0, 3):
        sys.exit(f"demo run failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def direct(model_dir: Path, threads: int) -> tuple[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                          f"pretrained={model_dir},dtype=float32", "--tasks", TASK, "--include_path", str(TASK_DIR),
                          "--batch_size", "1", "--device", "cpu"], cwd=TASK_DIR, env=env, capture_output=True,
                         text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"lm_eval failed:\n{res.stderr[-2000:]}")
    m = re.search(rf"\|{TASK}\s*\|.*?\|acc\s*\|[↑ ]*\|\s*([0-9.]+)\|", res.stdout + res.stderr)
    return wall, float(m.group(1)) if m else float("nan")


def qbuild_step(digest: str, store: Path) -> float:
    # the step runs with the demo recipe's threads (runtime.threads: auto = half the cores)
    res = subprocess.run([sys.executable, "-m", "qbuild", "verify", "--rebuild", digest, "--store", str(store),
                          "--json"], capture_output=True, text=True)
    out = json.loads(res.stdout)
    [row] = out["steps"]
    if row["status"] not in ("identical", "different"):
        sys.exit(f"rebuild failed: {row}")
    return row["timings"]["rebuilt"]["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, required=True, help="store the demo recipe runs into (built if needed)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="lm_eval's OMP_NUM_THREADS; default: what the demo's threads: auto gives its steps")
    args = ap.parse_args()
    summary = demo_summary(args.store)
    base = next(v for v in summary["variants"] if v["variant"] == "baseline")
    step = next(s for s in summary["steps"] if s["name"] == f"task:{TASK}[baseline]")
    from qbuild.artifacts.store import Store

    model_dir = Store(args.store).object_dir(base["digest"])
    ours_acc = base["tasks"][0]["acc"]
    pairs = []
    for i in range(args.runs):
        d_wall, d_acc = direct(model_dir, args.threads)
        q_wall = qbuild_step(step["digest"], args.store)
        pairs.append((q_wall, d_wall))
        print(f"run {i + 1}: qbuild step {q_wall:.2f} s, lm_eval --model hf {d_wall:.2f} s, "
              f"ratio {q_wall / d_wall:.3f}; acc qbuild {ours_acc:.4f}, lm_eval {d_acc:.4f}")
    ratio = statistics.median(q / d for q, d in pairs)
    print(f"median: qbuild step {statistics.median(q for q, _ in pairs):.2f} s, lm_eval "
          f"{statistics.median(d for _, d in pairs):.2f} s, ratio {ratio:.3f} (target ≤ 1.1)")


if __name__ == "__main__":
    main()
