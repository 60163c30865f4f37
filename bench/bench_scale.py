"""Scale-out: makespan of a multi-variant recipe of fake steps with fixed CPU work, and the per-step overhead.

    PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/plugins python bench/bench_scale.py [--variants 4] [--work 6000] [--fresh] [--ray]

1. makespan: N independent fake steps, each a fixed number of sha256 rounds on one core (threads: 1), in a
   fresh store: sequential (--jobs 1) vs --jobs 2, and with --ray a two-node Ray cluster on 127.0.0.1
   (tests/ray_cluster.py; 1 CPU per node, a file:// remote as the shared store). Goal: ≤ 0.6× sequential.
2. overhead: M steps that do nothing, run sequentially: (makespan − the time planning takes) / M is what the
   scheduler, a worker process (locally forked from the run's fork server, qbuild/pipeline/fork_server.py; its
   start, once per run, is included) and storing the step's output cost per step. Goal: ≤ 50 ms local, ≤ 200 ms
   on Ray (a fresh worker interpreter per step there).
Each figure is the median of --repeat runs; ratios are printed. Needs the test plugins (the fake method) on
PYTHONPATH, as above.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "plugins")]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "tests" / "plugins"),
                                            os.environ.get("PYTHONPATH", "")])

from helpers import fake_recipe, write_recipe  # noqa: E402

RUNS = iter(range(1, 10**6))


def recipe(tmp: Path, name: str, n: int, work: int) -> Path:
    """n independent steps whose keys no earlier run had (node stores and the remote outlive a run)."""
    run = next(RUNS)
    variants = [{"name": f"v{i}", "method": "fake", "level": 1000 * run + i, "work": work} for i in range(n)]
    data = fake_recipe(tmp, variants, runtime={"threads": 1})
    data["name"] = f"{name}-{run}"
    return write_recipe(tmp / f"{name}-{run}.yaml", data)


def timed_run(path: Path, store: Path, **kw) -> tuple[float, float]:
    """(makespan of the run, seconds of it spent planning)."""
    from qbuild import api

    t0 = time.perf_counter()
    api.plan(path, store=store, remotes=kw.get("remotes", ()))
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = api.run(path, store=store, **kw)
    wall = time.perf_counter() - t0
    assert result.exit_code == 0, result.summary
    return wall, plan_s


def median_runs(tmp: Path, label: str, n: int, work: int, repeat: int, **kw) -> tuple[float, float]:
    walls, plans = [], []
    for r in range(repeat):
        store = tmp / f"store-{label}-{r}"
        wall, plan_s = timed_run(recipe(tmp, label, n, work), store, **kw)
        walls.append(wall)
        plans.append(plan_s)
        shutil.rmtree(store, ignore_errors=True)
    return statistics.median(walls), statistics.median(plans)


class RayCluster:
    def __init__(self, tmp: Path):
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "ray_cluster.py"), str(tmp)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the Ray cluster did not start")
        self.address = json.loads(line)["address"]
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # the driver reaches 127.0.0.1 (tests/ray_cluster.py)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=4)
    ap.add_argument("--work", type=int, default=6000, help="thousands of sha256 rounds per step (~0.3 s per 1000)")
    ap.add_argument("--empty", type=int, default=10, help="empty steps for the overhead figure")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="also the overhead with a fresh worker interpreter per step "
                    "(no fork server: the figure before warm workers)")
    ap.add_argument("--ray", action="store_true", help="also on a two-node Ray cluster (needs qbuild[ray])")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="qbuild-bench-scale-"))
    try:
        print(f"{args.variants} independent steps of {args.work}k sha256 rounds each; {os.cpu_count()} cores; "
              f"median of {args.repeat}; load average before: {os.getloadavg()[0]:.1f}")
        seq, _ = median_runs(tmp, "seq", args.variants, args.work, args.repeat, jobs=1)
        par, _ = median_runs(tmp, "par", args.variants, args.work, args.repeat, jobs=2)
        print(f"makespan sequential   {seq:7.2f} s")
        print(f"makespan --jobs 2     {par:7.2f} s   ratio {par / seq:.2f}× sequential (goal ≤ 0.60)")
        empty_wall, empty_plan = median_runs(tmp, "empty", args.empty, 0, args.repeat, jobs=1)
        local_overhead = (empty_wall - empty_plan) / args.empty
        print(f"overhead per empty step, local: {1000 * local_overhead:6.1f} ms (goal ≤ 50; "
              f"{args.empty} steps in {empty_wall:.2f} s, planning {empty_plan:.2f} s of it)")
        if args.fresh:
            from qbuild.pipeline.executor import Executor

            Executor.warm_workers = False
            fw, fp = median_runs(tmp, "fresh", args.empty, 0, args.repeat, jobs=1)
            Executor.warm_workers = True
            print(f"  the same with a fresh interpreter per step: {1000 * (fw - fp) / args.empty:6.1f} ms "
                  f"(warm / fresh = {local_overhead / ((fw - fp) / args.empty):.2f}×)")
        if args.ray:
            cluster = RayCluster(tmp / "ray")
            try:
                remote = f"file://{tmp / 'remote'}"
                kw = {"executor": "ray", "address": cluster.address, "remotes": [remote]}
                median_runs(tmp, "ray-warm", 2, 0, 1, **kw)   # start each node's worker processes once
                ray_wall, _ = median_runs(tmp, "ray", args.variants, args.work, args.repeat, **kw)
                print(f"makespan Ray, 2 nodes {ray_wall:7.2f} s   ratio {ray_wall / seq:.2f}× sequential")
                ew, ep = median_runs(tmp, "ray-empty", args.empty, 0, args.repeat, **kw)
                print(f"overhead per empty step, Ray:   {1000 * (ew - ep) / args.empty:6.1f} ms (goal ≤ 200; "
                      f"{args.empty} steps in {ew:.2f} s; steps of one run may overlap on the 2 nodes)")
            finally:
                cluster.stop()
    finally:
        print(f"load average after: {os.getloadavg()[0]:.1f} (other work on the machine competes for its cores)")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
