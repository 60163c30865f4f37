"""Does `qbuild select` choose the same artifact on every cold run? Issue 34's bar: recipes/serving.yaml (and a
variant with two close candidates) run cold N times, each on a fresh store, selects the same (variant, config)
every time, or reports the same tie every time.

    flock /tmp/qbuild-heavy.lock .venv/bin/python bench/bench_selection_stability.py recipes/serving.yaml --runs 5

Each run: `qbuild run RECIPE --store <fresh temp dir> --json`, then `qbuild select RECIPE --store <same> --json`.
Nothing is shared between runs but llama-server's binary (built once per machine) and the installed model file.
Prints, per run: its wall time, the load average beside it, the selection (or the tie and how it was broken, or
"nothing meets"), and each candidate's output tok/s with its 95 % interval and its SLO verdicts; then whether
every run agreed. Appends every run's selection JSON to bench/results/selection_stability.jsonl.
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

REPO = Path(__file__).resolve().parent.parent
QBUILD = [sys.executable, "-m", "qbuild"]


def outcome(sel: dict) -> str:
    """The run's answer in one comparable string: the selection, and the tie it came from if any."""
    chosen = sel.get("selected")
    if not chosen:
        return "nothing meets every bound"
    text = f"{chosen['variant']}@{chosen['config']}"
    tie = sel.get("tie")
    if tie:
        names = sorted(f"{c['variant']}@{c['config']}" for c in tie["candidates"])
        text += f" (tie of {', '.join(names)}, broken by {tie['broken_by']})"
    return text


def candidates(sel: dict) -> list[str]:
    rows = [sel["selected"]] if sel.get("selected") else []
    lines = []
    for c in rows + sel.get("rejected", []):
        ci = c.get("output_tok_s_ci")
        tok = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "?"
        verdicts = ", ".join(f"{f} {v['value']:.4g} {v['verdict']}" for f, v in (c.get("slo") or {}).items())
        lines.append(f"    {c['variant']}@{c['config']}: output tok/s 95 % interval {tok}; {verdicts}")
    return lines


def one_run(recipe: Path, k: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"qbuild-stability-{k}-") as tmp:
        store = Path(tmp) / "store"
        env = {**os.environ, "QBUILD_STORE": str(store)}
        load_before = os.getloadavg()[0]
        t0 = time.monotonic()
        built = subprocess.run([*QBUILD, "run", str(recipe), "--store", str(store), "--json"], env=env,
                               capture_output=True, text=True)
        wall = time.monotonic() - t0
        load_after = os.getloadavg()
        sel = subprocess.run([*QBUILD, "select", str(recipe), "--store", str(store), "--json"], env=env,
                             capture_output=True, text=True)
    if built.returncode not in (0, 3):
        raise SystemExit(f"run {k}: qbuild run exited {built.returncode}: {built.stderr.strip()[-400:]}")
    if sel.returncode not in (0, 3):
        raise SystemExit(f"run {k}: qbuild select exited {sel.returncode}: {sel.stderr.strip()[-400:]}")
    return {"run": k, "recipe": recipe.name, "wall_s": round(wall, 1), "load_before": round(load_before, 2),
            "load_after_1_5_15": [round(x, 2) for x in load_after], "selection": json.loads(sel.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    out = REPO / "bench" / "results" / "selection_stability.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    answers = []
    for k in range(1, args.runs + 1):
        r = one_run(args.recipe.resolve(), k)
        with out.open("a") as f:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **r}) + "\n")
        answers.append(outcome(r["selection"]))
        print(f"run {k}: {r['wall_s']:.0f} s, load {r['load_before']} -> {r['load_after_1_5_15']}: {answers[-1]}",
              flush=True)
        print("\n".join(candidates(r["selection"])), flush=True)
    same, how = agreement(answers)
    print(f"{args.recipe.name}: {how} in {len(answers)} cold runs" + ("" if len(set(answers)) == 1
                                                                      else f": {sorted(set(answers))}"))
    return 0 if same else 1


def agreement(answers: list[str]) -> tuple[bool, str]:
    """Issue 34's bar: every run selects the same (variant, config), or every run reports the same tie. A run that
    selects the same artifact through another tie (the candidates within noise of it differ) still agrees."""
    chosen = {a.split(" (tie of ")[0] for a in answers}
    if len(set(answers)) == 1:
        return True, "the same answer"
    if len(chosen) == 1 and "nothing meets every bound" not in chosen:
        return True, f"the same selection ({chosen.pop()}), reached through different ties"
    return False, "DIFFERENT selections"


if __name__ == "__main__":
    raise SystemExit(main())
