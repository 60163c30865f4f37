"""How close `qbuild plan`'s time estimate comes to the run it estimates (issue 25: within ±30 %).

    .venv/bin/python bench/bench_estimate.py                          # the demo recipe, a fresh temporary store
    .venv/bin/python bench/bench_estimate.py recipes/methods.yaml --change calibration.seed=1

It builds RECIPE once (cold), then changes one setting (default: the evaluation's max_windows 8 → 6, which makes
every evaluation step miss and keeps every model), asks `qbuild plan --json` for its estimate, runs the changed
recipe, and prints estimate / measured wall time of that run, with the machine's load average while each ran: the
history's times hold whatever else the machine was doing then, so a busier re-run takes longer than estimated.
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

REPO = Path(__file__).resolve().parents[1]


def qbuild(*args) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "qbuild", *map(str, args)], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"qbuild {' '.join(map(str, args))} failed:\n{res.stderr[-2000:]}")
    return time.perf_counter() - t0, res


def load() -> str:
    return "load average " + "/".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def change(data: dict, assignment: str) -> None:
    path, value = assignment.split("=", 1)
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = yaml.safe_load(value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "demo.yaml"))
    ap.add_argument("--change", default="evaluation.perplexity.max_windows=6")
    ap.add_argument("--store", help="a store that has built RECIPE already (default: a fresh one, built first)")
    args = ap.parse_args()
    recipe = Path(args.recipe).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(args.store) if args.store else Path(tmp) / "store"
        cold, _ = qbuild(recipe, "--store", store, "--json")
        print(f"first build: {cold:.1f} s (after it: {load()})")
        data = yaml.safe_load(recipe.read_text())
        change(data, args.change)
        changed = recipe.with_name(f".{recipe.stem}.estimate-bench.yaml")   # beside it: relative paths still resolve
        changed.write_text(yaml.safe_dump(data, sort_keys=False))
        try:
            _, plan = qbuild("plan", changed, "--store", store, "--json")
            est = json.loads(plan.stdout).get("estimate") or {}
            print(f"planned the change ({load()})")
            wall, _ = qbuild(changed, "--store", store, "--json")
            print(f"re-ran it ({load()})")
        finally:
            changed.unlink()
    total = est.get("total_s", 0.0)
    print(f"changed {args.change}: estimate {total:.1f} s ({est.get('steps_without_history', '?')} steps without "
          f"history), measured {wall:.1f} s: estimate/measured = {total / wall:.2f} (goal 0.70-1.30)")


if __name__ == "__main__":
    main()
