"""The deployment search against recipes/serving.yaml's best hand-listed configuration and, with --grid, against a
full grid over the same space, on the demo model behind llama-server (issue 50's bars).

    flock /tmp/qbuild-heavy.lock .venv/bin/python bench/bench_deploy.py [--grid] [--with-draft] [--runs 2]

Per run, on a fresh store and a fresh probe cache (nothing shared but llama-server's binary and the model file):
1. the search: recipes/deploy.yaml as shipped (its probes, max_searched and max_minutes unless overridden), without
   the draft lever unless --with-draft: its choice, its wall time, its screens' and `deploy` step's time, and when
   the choice was settled (the searches before the front pass);
2. the hand-listed cells: recipes/serving.yaml's cells (q8_0 and q4km, f16 and q8_0 KV cache, --parallel 4 at the
   run's threads: its configs `default` and `kv8` at its largest concurrency) searched with the same probes on the
   same store and probe cache, as the search searches (in order of screened bound, while a bound can beat the best
   capacity measured, `front: false`: their best; screens and any probe the search measured are reused), so that the chosen
   capacity over the hand-listed best's is measured alike;
3. with --grid, the whole space with `strategy: grid` on the same store and a fresh probe cache: every candidate that
   meets the bounds gets its capacity search. The grid's time is the screens' plus its `deploy` step; the search's,
   the screens' plus its own (and to its choice, the screens' plus the choice pass).

Prints per run: the search's choice and capacity, the chosen capacity over the hand-listed best's (target >= 1.3, or
no deployment in the space does better), and with --grid the grid's best (whether the search reached it or one within
one grid step, 4.4 %) and the search's time over the grid's (target <= 0.5); with --runs 2 whether every run chose the
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


def deploy_seconds(summary: dict) -> float:
    """The `deploy` step's own time (its screens, `deploy-screen[...]`, are counted apart)."""
    return sum(s["seconds"] or 0 for s in summary["steps"] if s["name"] == "deploy" and s["status"] == "built")


def one_run(args, root: Path, with_grid: bool) -> dict:
    data = yaml.safe_load((REPO / "recipes" / "deploy.yaml").read_text())
    if not args.with_draft:
        data["deploy"]["space"]["draft"] = [None]
    overrides = {"requests": args.requests, "rounds": args.rounds, "max_minutes": args.max_minutes,
                 "max_searched": args.max_searched}
    data["deploy"].update({k: v for k, v in overrides.items() if v is not None})
    store, cache = root / "store", root / "cache"
    wall, searched = run(write(root / "search.yaml", data), store, cache)
    screens = step_seconds(searched, "deploy-screen[")
    d = searched["deploy"]
    chosen = d["chosen"]
    out = {"when": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(), "with_draft": args.with_draft,
           "probes": {k: data["deploy"].get(k) for k in ("requests", "rounds")}, "wall_s": round(wall, 1),
           "screens_s": round(screens, 1), "search_s": round(screens + deploy_seconds(searched), 1),
           "to_choice_s": round(screens + (d.get("choice_settled") or {}).get("seconds", 0), 1),
           "chosen": chosen and {k: chosen[k] for k in ("name", "capacity_rps", "peak_rss_mb", "kld")},
           "ties": d["ties"], "searched": d["searched"], "screened": d["screened"],
           "capacities": {r["name"]: r.get("capacity_rps") for r in d["candidates"]}}
    out |= ({"hand_listed": None, "hand_listed_best": None, "capacity_ratio": None} if args.skip_hand_listed
            else hand_listed(data, store, cache, chosen))
    return grid(data, root, store, screens, out) if with_grid else out


def hand_listed(data: dict, store: Path, cache: Path, chosen: dict | None) -> dict:
    """recipes/serving.yaml's cells, searched as the search searches (in order of their screened bound, while a bound
    can beat the best capacity measured), on the same store and probe cache: their best, at the same probes."""
    hand_space = {**data["deploy"]["space"], "variants": ["q8_0", "q4km"], "kv_cache_dtype": [None, "q8_0"],
                  "parallel": [4], "threads": [None], "draft": [None]}
    hand_data = {**data, "deploy": {**data["deploy"], "max_minutes": 120, "max_searched": len(HAND_LISTED),
                                    "front": False, "space": hand_space}}
    _, handed = run(write(store.parent / "hand.yaml", hand_data), store, cache)
    rows = {r["name"]: r for r in handed["deploy"]["candidates"]}
    hand = [rows[n] for n in HAND_LISTED if n in rows and rows[n].get("capacity_rps") and not rows[n]["rejected"]]
    hand_best = max(hand, key=lambda r: r["capacity_rps"], default=None)
    return {"hand_listed": {n: rows[n].get("capacity_rps") for n in HAND_LISTED if n in rows},
            "hand_listed_best": hand_best and {k: hand_best[k] for k in ("name", "capacity_rps")},
            "capacity_ratio": (round(chosen["capacity_rps"] / hand_best["capacity_rps"], 3)
                               if chosen and hand_best else None)}


def grid(data: dict, root: Path, store: Path, screens: float, out: dict) -> dict:
    """The whole space with `strategy: grid` on the same store (its screens are the search's) and a fresh probe cache."""
    chosen = out["chosen"]
    _, gridded = run(write(root / "grid.yaml", {**data, "deploy": {**data["deploy"], "strategy": "grid",
                                                                      "max_minutes": 240}}),
                     store, root / "cache-grid")
    grid_s = screens + deploy_seconds(gridded)
    g = gridded["deploy"]
    rows = {r["name"]: r for r in g["candidates"]}
    best = g["chosen"]
    reached = bool(chosen and best and (chosen["name"] == best["name"] or chosen["name"] in g["ties"]
                                        or rows[chosen["name"]].get("k", -999) >= rows[best["name"]]["k"] - 1))
    return out | {"grid_s": round(grid_s, 1), "time_ratio": round(out["search_s"] / grid_s, 3) if grid_s else None,
                  "to_choice_ratio": round(out["to_choice_s"] / grid_s, 3) if grid_s else None,
                  "grid_best": best and {k: best[k] for k in ("name", "capacity_rps", "peak_rss_mb", "kld")},
                  "grid_ties": g["ties"], "reached_grid_best": reached,
                  "grid_capacities": {r["name"]: r.get("capacity_rps") for r in g["candidates"]}}


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with-draft", action="store_true", help="keep recipes/deploy.yaml's draft lever")
    parser.add_argument("--runs", type=int, default=1, help="cold runs (two: do they choose the same?)")
    parser.add_argument("--requests", type=int, help="Poisson arrivals per round of a capacity probe (the recipe's)")
    parser.add_argument("--rounds", type=int, help="rounds per capacity probe (the recipe's)")
    parser.add_argument("--max-minutes", type=float, help="the search's budget (the recipe's)")
    parser.add_argument("--max-searched", type=int, help="the search's capacity searches at most (the recipe's)")
    parser.add_argument("--grid", action="store_true", help="also the full grid (every candidate searched)")
    parser.add_argument("--skip-hand-listed", action="store_true",
                        help="leave out recipes/serving.yaml's hand-listed cells (measured by an earlier run)")
    args = parser.parse_args()
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="qbuild-bench-deploy-") as d:
            r = one_run(args, Path(d), with_grid=args.grid and i == 0)
        results.append(r)
        print(f"run {i + 1}: chose {r['chosen'] and r['chosen']['name']} at "
              f"{r['chosen'] and r['chosen']['capacity_rps']} requests/s ({r['searched']} of {r['screened']} "
              f"searched), ties {r['ties']}; {r['search_s']} s (screens {r['screens_s']} s, to the choice "
              f"{r['to_choice_s']} s)")
        print(f"  hand-listed (recipes/serving.yaml's cells): {r['hand_listed']}; chosen/best hand-listed "
              f"{r['capacity_ratio']} (target >= 1.3)")
        if "grid_s" in r:
            print(f"  grid best {r['grid_best'] and r['grid_best']['name']} at "
                  f"{r['grid_best'] and r['grid_best']['capacity_rps']}/s, reached: {r['reached_grid_best']}; "
                  f"grid {r['grid_s']} s, search/grid {r['time_ratio']} (target <= 0.5; to its choice "
                  f"{r['to_choice_ratio']})")
        out = REPO / "bench" / "results" / "deploy.jsonl"
        out.parent.mkdir(exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
    if len(results) > 1:
        answers = {(r["chosen"] or {}).get("name") for r in results}
        # issue 50's bar: the same deployment, or the same tie (each run's choice the other's or among its ties)
        agree = all((a["chosen"] or {}).get("name") in {(b["chosen"] or {}).get("name"), *b["ties"]}
                    for a in results for b in results)
        print(f"every run chose the same deployment: {len(answers) == 1} ({sorted(map(str, answers))}); "
              f"the same or a reported tie: {agree}")


if __name__ == "__main__":
    main()
