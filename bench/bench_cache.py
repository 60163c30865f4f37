"""Cold vs fully cached run of a recipe, and warm fingerprint time of a large local model directory.

    .venv/bin/python bench/bench_cache.py                    # demo recipe, fresh temporary store
    .venv/bin/python bench/bench_cache.py --fingerprint-gb 4

Targets (issue 2): cached re-run ≤ 1 s wall and ≤ 2 % of the cold run; warm fingerprint ≤ 50 ms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed_run(recipe: Path, store: Path) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "qbuild", str(recipe), "--store", str(store), "--json"],
                         capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"run failed:\n{res.stderr[-2000:]}")
    return elapsed


def bench_fingerprint(gb: float, root: Path) -> tuple[float, float]:
    from qbuild.base.fingerprint import dir_fingerprint

    model = root / "big-model"
    model.mkdir()
    shard = 256 << 20
    block = os.urandom(1 << 20)
    for i in range(max(1, int(gb * (1 << 30) // shard))):
        with open(model / f"model-{i:05d}.safetensors", "wb") as f:
            for _ in range(shard >> 20):
                f.write(block)
    os.environ["QBUILD_CACHE"] = str(root / "cache")
    t0 = time.perf_counter()
    cold_fp = dir_fingerprint(model)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm_fp = dir_fingerprint(model)
    warm = time.perf_counter() - t0
    assert cold_fp == warm_fp
    return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "demo.yaml")
    ap.add_argument("--fingerprint-gb", type=float, default=2.0)
    ap.add_argument("--skip-run", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not args.skip_run:
            cold = timed_run(args.recipe, tmp / "store")
            cached = min(timed_run(args.recipe, tmp / "store") for _ in range(3))
            print(f"recipe            {args.recipe.name}")
            print(f"cold run          {cold:8.2f} s")
            print(f"cached re-run     {cached:8.2f} s   (target ≤ 1 s)")
            print(f"cached / cold     {cached / cold:8.2%}   (target ≤ 2 %)")
        cold_fp, warm_fp = bench_fingerprint(args.fingerprint_gb, tmp)
        print(f"fingerprint {args.fingerprint_gb:.1f} GiB  cold {cold_fp:6.2f} s, warm {warm_fp * 1000:6.1f} ms   (target ≤ 50 ms)")
        print(f"warm / cold       {warm_fp / cold_fp:8.2%}")


if __name__ == "__main__":
    main()
