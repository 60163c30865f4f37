"""The demo's cold run before and after issue 11, from two stores' run records and manifests.

    # before: old main (5ac1af8, before issue 11) in its own worktree and store; after: this tree, another
    # store; the README's demo command on both (threads: auto = 1 per step on 2 cores), back to back
    git worktree add --detach /tmp/wt-old 5ac1af8
    (cd /tmp/wt-old && PYTHONPATH=$PWD /path/to/.venv/bin/python -m qbuild recipes/demo.yaml --store /tmp/old)
    PYTHONPATH=$PWD .venv/bin/python -m qbuild recipes/demo.yaml --store /tmp/new
    PYTHONPATH=$PWD .venv/bin/python bench/bench_demo_eval.py /tmp/old /tmp/new

Earlier pairs (README) ran both sides with `--threads 1`, which on 2 cores was what `auto` meant. A number is
now a fixed cap that turns elastic threads off, so pairs are timed as users run the demo: without `--threads`.

Prints wall time, step time by kind (seconds and CPU seconds: CPU seconds suffer less from a busy
machine), the peak RSS of the largest KLD-bearing step, and whether PPL/KLD/top-1 agree to 1e-4.
Target (issue 11): after ≤ 0.55× before, identical numbers, peak RSS of a KLD evaluation not above before.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def load(store: Path) -> tuple[dict, dict]:
    run = max((store / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    record = json.loads(run.read_text())
    manifests = {}
    for m in store.glob("objects/*/*/manifest.json"):
        d = json.loads(m.read_text())
        if d.get("run_id") == record["run_id"]:
            manifests[d["name"]] = d
    return record, manifests


def kind_of(name: str) -> str:
    return name.split("[")[0]


def main() -> None:
    before, after = (Path(a) for a in sys.argv[1:3])
    (rb, mb), (ra, ma) = load(before), load(after)
    print(f"{'':24}{'before':>12}{'after':>12}{'ratio':>8}")
    print(f"{'run wall s':24}{rb['seconds']:12.1f}{ra['seconds']:12.1f}{ra['seconds'] / rb['seconds']:8.2f}")
    for field in ("seconds", "cpu_seconds"):
        by = [defaultdict(float), defaultdict(float)]
        for i, ms in enumerate((mb, ma)):
            for name, d in ms.items():
                by[i][kind_of(name)] += d.get("timings", {}).get(field, 0.0)
        tb, ta = sum(by[0].values()), sum(by[1].values())
        print(f"{'step ' + field + ' total':24}{tb:12.1f}{ta:12.1f}{ta / tb:8.2f}")
        for k in sorted(set(by[0]) | set(by[1])):
            print(f"{'  ' + k:24}{by[0].get(k, 0):12.1f}{by[1].get(k, 0):12.1f}")
    for label, ms in (("before", mb), ("after", ma)):
        rss = {n: d["timings"].get("peak_rss_mb") for n, d in ms.items()
               if kind_of(n) in ("kld", "perplexity", "reference")}
        worst = max(rss, key=lambda n: rss[n] or 0)
        print(f"peak RSS of an evaluation step, {label}: {rss[worst]:.0f} MB ({worst})")
    rows_b = {r["variant"]: r for r in rb["variants"]}
    rows_a = {r["variant"]: r for r in ra["variants"]}
    same = True
    for v, r in rows_b.items():
        for k in ("ppl", "kld", "top1"):
            x, y = r.get(k), rows_a.get(v, {}).get(k)
            ok = (x is None and y is None) or (x is not None and y is not None and abs(x - y) <= 1e-4 * abs(x))
            same &= ok
            print(f"{v:8} {k:5} {x!s:>24} {y!s:>24} {'✔' if ok else '✘'}")
    print("identical numbers (1e-4 relative):", same)


if __name__ == "__main__":
    main()
