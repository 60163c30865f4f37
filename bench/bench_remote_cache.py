"""A fully cached run on a fresh machine: `qbuild recipes/demo.yaml` with an empty local store, backed by a warm remote.

    .venv/bin/python bench/bench_remote_cache.py --warm ./artifacts     # a store where the demo has run

Machine A: the demo's warm store is pushed to the remote by a cached run with `--remote URL` (write-through
uploads what the remote lacks). Machine B: an empty store; `qbuild recipes/demo.yaml --remote URL` is timed as
a whole process, several times (a new empty store each time). Prints the wall time, the steps built and the
bytes of weights downloaded. Goal (issue 10): ≤ 2 s wall, 0 bytes of weights. Servers: moto (S3) and Debian's
docker-registry (OCI) on 127.0.0.1, started and stopped here; file:// needs none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_pull import moto_server, registry_server  # noqa: E402


def qbuild(*args, env=None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "qbuild", *map(str, args)], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, cwd=REPO)
    return time.perf_counter() - t0, res


def weights_bytes(store: Path) -> int:
    objects = store / "objects"
    return sum(f.stat().st_size for f in objects.rglob("*") if f.is_file() and f.suffix != ".json") \
        if objects.exists() else 0


def bench(label: str, url: str, warm: Path, root: Path, repeat: int) -> None:
    seconds, res = qbuild("recipes/demo.yaml", "--store", warm, "--remote", url, "--json")
    if res.returncode != 0:
        sys.exit(f"{label}: pushing the warm store failed:\n{res.stderr[-2000:]}")
    pushed = json.loads(res.stdout).get("remotes", {})
    print(f"{label}: machine A pushed {sum(r['objects'] for r in pushed.values())} objects in {seconds:.1f} s")
    walls, built, downloaded = [], set(), set()
    for i in range(repeat):
        empty = root / f"{label}-empty-{i}"
        wall, res = qbuild("recipes/demo.yaml", "--store", empty, "--remote", url, "--json")
        if res.returncode != 0:
            sys.exit(f"{label}: cached run failed:\n{res.stderr[-2000:]}")
        walls.append(wall)
        built.add(json.loads(res.stdout)["counts"]["built"])
        downloaded.add(weights_bytes(empty))
    print(f"{label}: fully cached run on an empty store: wall median {statistics.median(walls):.2f} s "
          f"(min {min(walls):.2f}, max {max(walls):.2f}, {repeat} runs); steps built {sorted(built)}; "
          f"weights downloaded {sorted(downloaded)} bytes   (goal ≤ 2 s, 0 bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=Path, default=REPO / "artifacts", help="A store where recipes/demo.yaml has run.")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not (args.warm / "actions").is_dir():
        sys.exit(f"{args.warm} has no demo build: run `qbuild recipes/demo.yaml --store {args.warm}` first")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bench("file", f"file://{root / 'share'}", args.warm, root, args.repeat)

        with moto_server():
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
            bench("s3", "s3://bench/qbuild", args.warm, root, args.repeat)
        with registry_server(root) as host:
            if host is None:
                print("oci: skipped (apt-get install docker-registry)")
                return
            bench("oci", f"oci://{host}/bench/qbuild", args.warm, root, args.repeat)


if __name__ == "__main__":
    main()
