"""The deployment search against a full grid over the same space, and against the best configuration
recipes/serving.yaml lists by hand, on the demo model behind llama-server (issue 50's bars).

    flock /tmp/qbuild-heavy.lock .venv/bin/python bench/bench_deploy.py [--with-draft] [--runs 2]

Per run, on a fresh store and a fresh probe cache (nothing shared but llama-server's binary and the model file):
1. recipes/deploy.yaml (`strategy: prune`), without the draft lever unless --with-draft (the grid would search
   every drafted candidate too), its capacity probes of `--requests` × `--rounds` and with no max_searched, within
   `--max-minutes`: its wall time, and the time of its screens and its `deploy` step;
2. the same recipe with `strategy: grid` on the same store (the screens are the same steps and are reused) and a
   fresh probe cache: every candidate that meets the bounds gets its capacity search.
The grid's wall time is the screens' time plus its `deploy` step; the search's, the screens' plus its own. The
hand-listed best is the grid's best among the candidates recipes/serving.yaml serves (q8_0 and q4km, f16 and q8_0 KV
cache, --parallel 4: its configs `default` and `kv8` at its largest concurrency).

Prints per run: the search's choice and capacity, the grid's best (and whether the search reached it or one within
one grid step, 4.4 %), the search's time over the grid's (target ≤ 0.5), the chosen capacity over the hand-listed
best's (target ≥ 1.3, or no deployment in the space does better: the grid shows it), and whether every run chose the
same deployment. Appends each run to bench/results/deploy.jsonl.
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

REPO = Path(__file__).resolve().parent.parent
QBUILD = [sys.executable, "-m", "qbuild"]
HAND_LISTED = ("q8_0@p4", "q8_0@kv-q8_0.p4", "q4km@p4", "q4km@kv-q8_0.p4")   # recipes/serving.yaml's cells


def run(recipe: Path, store: Path, cache: Path) -> tuple[float, dict]:
    from qbuild.models.llamacpp_toolchain import cached_bin_dir

    # a fresh cache (no capacity probe of an earlier run), but the llama.cpp tools built once per machine
    env = {**os.environ, "QBUILD_CACHE": str(cache), "QBUILD_LLAMA_CPP_BIN": str(cached_bin_dir())}
    started = time.monotonic()
    proc = subprocess.run([*QBUILD, "run", str(recipe), "--store", str(store), "--json"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=4 * 3600)
    wall = time.monotonic() - started
    if proc.returncode not in (0, 3):
        sys.exit(f"qbuild run {recipe.name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return wall, json.loads(proc.stdout)


def step_seconds(summary: dict, prefix: str) -> float:
    return sum(s["seconds"] or 0 for s in summary["steps"] if s["name"].startswith(prefix) and s["status"] == "built")


def one_run(args, root: Path, with_grid: bool = True) -> dict:
    data = yaml.safe_load((REPO / "recipes" / "deploy.yaml").read_text())
    if not args.with_draft:
        data["deploy"]["space"]["draft"] = [None]
    # cheaper capacity probes for both (the comparison is of search against grid under the same probes)
    data["deploy"].update({"requests": args.requests, "rounds": args.rounds, "max_minutes": args.max_minutes,
                           "max_searched": 1000})
    prune, grid = root / "prune.yaml", root / "grid.yaml"
    prune.write_text(yaml.safe_dump(data))
    data["deploy"]["strategy"] = "grid"
    data["deploy"]["max_minutes"] = 240
    grid.write_text(yaml.safe_dump(data))
    store = root / "store"
    wall, searched = run(prune, store, root / "cache-prune")
    screens = step_seconds(searched, "deploy-screen[")
    search_s = screens + step_seconds(searched, "deploy")
    d = searched["deploy"]
    chosen = d["chosen"]
    common = {"when": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(), "with_draft": args.with_draft,
              "wall_s": round(wall, 1), "screens_s": round(screens, 1), "search_s": round(search_s, 1),
              "chosen": chosen and {k: chosen[k] for k in ("name", "capacity_rps", "peak_rss_mb", "kld")},
              "ties": d["ties"], "searched": d["searched"], "screened": d["screened"]}
    if not with_grid:
        return common
    _, gridded = run(grid, store, root / "cache-grid")
    grid_s = screens + step_seconds(gridded, "deploy")
    g = gridded["deploy"]
    rows = {r["name"]: r for r in g["candidates"]}
    hand = [rows[n] for n in HAND_LISTED if n in rows and rows[n].get("capacity_rps") and not rows[n]["rejected"]]
    hand_best = max(hand, key=lambda r: r["capacity_rps"], default=None)
    best = g["chosen"]
    reached = bool(chosen and best and (chosen["name"] == best["name"] or chosen["name"] in g["ties"]
                                        or rows[chosen["name"]].get("k", -999) >= rows[best["name"]]["k"] - 1))
    return {**common, "grid_s": round(grid_s, 1), "time_ratio": round(search_s / grid_s, 3) if grid_s else None,
            "grid_best": best and {k: best[k] for k in ("name", "capacity_rps", "peak_rss_mb", "kld")},
            "grid_ties": g["ties"], "reached_grid_best": reached,
            "hand_listed_best": hand_best and {k: hand_best[k] for k in ("name", "capacity_rps")},
            "capacity_ratio": (round(chosen["capacity_rps"] / hand_best["capacity_rps"], 3)
                               if chosen and hand_best else None),
            "grid_capacities": {r["name"]: r.get("capacity_rps") for r in g["candidates"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with-draft", action="store_true", help="keep recipes/deploy.yaml's draft lever")
    parser.add_argument("--runs", type=int, default=1, help="cold runs (two: do they choose the same?)")
    parser.add_argument("--requests", type=int, default=24, help="Poisson arrivals per round of a capacity probe")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per capacity probe")
    parser.add_argument("--max-minutes", type=float, default=120, help="the pruned search's budget (the grid: 240)")
    parser.add_argument("--grid-runs", type=int, default=None,
                        help="runs that also run the grid (default: every run); later runs search only, cold")
    args = parser.parse_args()
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="qbuild-bench-deploy-") as d:
            r = one_run(args, Path(d), with_grid=args.grid_runs is None or i < args.grid_runs)
        results.append(r)
        print(f"run {i + 1}: chose {r['chosen'] and r['chosen']['name']} at "
              f"{r['chosen'] and r['chosen']['capacity_rps']} requests/s ({r['searched']} of {r['screened']} "
              f"searched), ties {r['ties']}; search {r['search_s']} s, screens {r['screens_s']} s")
        if "grid_s" in r:
            print(f"  grid best {r['grid_best'] and r['grid_best']['name']} at "
                  f"{r['grid_best'] and r['grid_best']['capacity_rps']}/s, reached: {r['reached_grid_best']}; "
                  f"grid {r['grid_s']} s, search/grid {r['time_ratio']} (target <= 0.5)")
            print(f"  hand-listed best (recipes/serving.yaml's cells): {r['hand_listed_best']}; chosen/hand-listed "
                  f"{r['capacity_ratio']} (target >= 1.3)")
        out = REPO / "bench" / "results" / "deploy.jsonl"
        out.parent.mkdir(exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
    if len(results) > 1:
        answers = {(r["chosen"] or {}).get("name") for r in results}
        print(f"every run chose the same deployment: {len(answers) == 1} ({sorted(map(str, answers))})")


if __name__ == "__main__":
    main()
