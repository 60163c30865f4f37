"""Disk and time of a GGUF mixed-precision search (`search:`), cold on a fresh store.

    python bench/bench_search_disk.py recipes/mixed-precision.yaml [--store DIR] [--code DIR] [--jobs N]
    python bench/bench_search_disk.py --size 1b [--store DIR] [--keep DIR]    # a random-weight 1B, reduced search
    python bench/bench_search_disk.py --analyze STORE SUMMARY.json            # figures of a run made otherwise

Runs `qbuild run RECIPE --store STORE --json` (the qbuild at --code, default this checkout) on a new store, sampling
the store's size every 2 s (its peak: stored objects and the running steps' scratch), and prints: wall time, steps
built, the store's size after the run (`du -sb`), the bytes of the objects only the search made (every step of the
search variant: names `[V~...]`, `gguf-search-allocate[V]`, `quantize[V]`, `perplexity[V]`, and the sensitivity
reference `reference[baseline~Nw]`), the final artifact's size, and the ratio of the search's extra (its objects
but the artifact) to the artifact. `--size 1b` makes bench_model_size's random-weight Llama-shaped checkpoint
(nothing is downloaded) and searches it with a reduced recipe (RECIPE_1B). Figures go to docs/benchmarks.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6

# a search that 2 cores finish in minutes on a 1B: one candidate type, one window per sensitivity probe, 2 windows
RECIPE_1B = """name: search-1b
model: {{source: local, path: {model}}}
variants:
  - name: mix
    method: gguf
    search: {{max_bpw: 7.0, types: [Q4_0], sensitivity_windows: 1, max_candidates: 1}}
evaluation:
  baseline: true
  kld: true
  perplexity:
    dataset: {{sources: [{{type: pydocs, split: test}}]}}
    protocol: fixed-window
    context_length: 512
    max_windows: 2
runtime: {{threads: 1}}
"""


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:   # removed while walking: a step's scratch
                pass
    return total


def run(recipe: Path, store: Path, code: Path, jobs: int | None) -> dict:
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.wait(2.0):
            peak[0] = max(peak[0], tree_bytes(store))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cmd = [sys.executable, "-m", "qbuild", "run", str(recipe), "--store", str(store), "--json"]
    cmd += ["--jobs", str(jobs)] if jobs else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=code, env={**os.environ, "PYTHONPATH": str(code)})
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return {"wall_s": round(wall, 1), "rc": proc.returncode, "peak_bytes": max(peak[0], tree_bytes(store)),
            "summary": summary, "load": os.getloadavg()}


def analyze(store: Path, summary: dict) -> dict:
    """The search's objects and the artifact's size, from the run's summary and the store's action records."""
    from qbuild.artifacts.store import Store

    st = Store(store)
    steps = summary.get("steps", [])
    searched = {s["name"][len("gguf-search-allocate["):-1] for s in steps
                if s["name"].startswith("gguf-search-allocate[")}
    finals = {f"quantize[{v}]" for v in searched}

    def of_search(name: str) -> bool:
        return name.startswith("reference[baseline~") or any(
            f"[{v}~" in name or name in (f"gguf-search-allocate[{v}]", f"quantize[{v}]", f"perplexity[{v}]")
            for v in searched)

    objects, artifacts = {}, {}
    for s in steps:
        hit = st.lookup(s["key"]) if of_search(s["name"]) and s.get("key") else None
        if hit is None:
            continue
        objects[hit.digest] = sum(f.get("size", 0) for f in hit.record.get("files", []))
        if s["name"] in finals:
            artifacts[hit.digest] = objects[hit.digest]
    extra = sum(b for d, b in objects.items() if d not in artifacts)
    artifact = sum(artifacts.values())
    return {"steps": len(steps), "built": sum(s["status"] == "built" for s in steps),
            "store_bytes": tree_bytes(store), "search_object_bytes": sum(objects.values()),
            "search_extra_bytes": extra, "artifact_bytes": artifact,
            "extra_over_artifact": round(extra / artifact, 4) if artifact else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", nargs="?", type=Path)
    ap.add_argument("--store", type=Path)
    ap.add_argument("--code", type=Path, default=ROOT)
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--size", choices=["1b"])
    ap.add_argument("--keep", type=Path, help="where the random checkpoint is made (default: a temp folder)")
    ap.add_argument("--analyze", nargs=2, type=Path, metavar=("STORE", "SUMMARY"))
    args = ap.parse_args()
    if args.analyze:
        store, summary = args.analyze
        print(json.dumps(analyze(store, json.loads(summary.read_text())), indent=1))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-search-"))
    recipe = args.recipe
    if args.size:
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_model_size import make_checkpoint

        model = make_checkpoint(args.size, args.keep or work / f"model-{args.size}")
        recipe = work / "search-1b.yaml"
        recipe.write_text(RECIPE_1B.format(model=model))
    store = args.store or work / "store"
    result = run(recipe.resolve(), store, args.code, args.jobs)
    figures = analyze(store, result.pop("summary"))
    print(json.dumps({**result, **figures, "store": str(store)}, indent=1))


if __name__ == "__main__":
    main()
