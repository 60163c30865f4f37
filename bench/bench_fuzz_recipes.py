"""Hostile recipes: ≥ 1,024 mutated recipes through `qbuild validate` and `qbuild plan`; counts tracebacks and hangs.

    .venv/bin/python bench/bench_fuzz_recipes.py                  # 1,024 mutants of recipes/*.yaml, seed 0
    .venv/bin/python bench/bench_fuzz_recipes.py -n 4096 --seed 7 --timeout 5

Each mutant runs in-process through the real CLI (click's runner, `--store` on a temporary store) under a
per-case time limit (SIGALRM) and an address-space limit. Wanted (issue 12): 0 tracebacks, 0 hangs; every
refusal is exit 2 with one line. Mutations: byte flips, deleted/duplicated/swapped lines, and injected hostile
YAML (alias bombs, self-referencing anchors, unhashable keys, NUL/control bytes, 1,000-deep nesting,
5,000-digit integers, duplicate keys, huge strings, wrong types).
"""

from __future__ import annotations

import argparse
import random
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BOMB = ('a: &a ["x","x","x","x","x","x","x","x","x"]\n'
        + "".join(f"{n}: &{n} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, n in zip("abcdefg", "bcdefgh", strict=True)))
INJECTIONS = [
    BOMB, "x: &s [*s]\n", "? [a, b]\n: 1\n", "? {a: 1}\n: 2\n", "name: a\x00b\n", "name: \x07\x1b[31m\n",
    "deep: " + "[" * 1000 + "]" * 1000 + "\n", "deep: " + "{a: " * 300 + "1" + "}" * 300 + "\n",
    "n: " + "9" * 5000 + "\n", "variants: []\n", "name: dup\n", "samples: -1\n", "seq_len: 99999999999999999999\n",
    "path: " + "a" * 100_000 + "\n", "model: 5\n", "variants: {a: 1}\n", "<<: *nope\n", "!!python/object:os.system x\n",
    "tag: !!binary AAAA\n", "x: .nan\n", "x: 0x" + "f" * 400 + "\n", "- - - -\n", "{{{{\n", "'unterminated\n",
    "name: ../../etc\n", "name: ..\n", "store: {path: /}\n", "threads: 1e308\n", "max_windows: 1e999\n",
    "x: !!timestamp 2020-13-45\n", "&a x: *a\n", "? !!set {a, b}\n: 1\n", "k: |\n  " + "\t" * 10 + "\n",
]


def mutate(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    op = rng.randrange(7)
    if op == 0 and text:  # flip bytes
        data = bytearray(text.encode())
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return data.decode("utf-8", errors="replace")
    if op == 1 and lines:  # delete lines
        for _ in range(rng.randint(1, 3)):
            if lines:
                del lines[rng.randrange(len(lines))]
    elif op == 2 and lines:  # duplicate a line (duplicate keys)
        i = rng.randrange(len(lines))
        lines.insert(rng.randrange(len(lines) + 1), lines[i])
    elif op == 3 and len(lines) > 1:  # swap two lines
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 4:  # inject hostile YAML at the top level or inside a block
        inj = rng.choice(INJECTIONS)
        if lines and rng.random() < 0.5:
            i = rng.randrange(len(lines))
            indent = len(lines[i]) - len(lines[i].lstrip(" "))
            inj = "".join(" " * indent + line for line in inj.splitlines(keepends=True))
            lines.insert(i, inj)
        else:
            lines.append(inj)
    elif op == 5 and lines:  # replace a value with something of another type
        i = rng.randrange(len(lines))
        if ":" in lines[i]:
            head = lines[i].split(":", 1)[0]
            value = rng.choice(["", "null", "[]", "{}", "-1", "0", "1e999", "true", "'x'", "*a", "&a", "!!str",
                                "[" * 50, "9" * 4400, "~", "x" * 2000])
            lines[i] = f"{head}: {value}\n"
    else:  # a whole hostile document
        return rng.choice(INJECTIONS) * rng.randint(1, 3)
    return "".join(lines)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def run_case(runner, cli, args: list[str], timeout: float) -> tuple[str, str]:
    """('ok'|'refused'|'traceback'|'hang'|'bad-exit', detail)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        result = runner.invoke(cli, args, catch_exceptions=True)
    except Hang:
        return "hang", " ".join(args[:1])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    exc = result.exception
    if isinstance(exc, Hang):
        return "hang", " ".join(args[:1])
    if exc is not None and not isinstance(exc, SystemExit):
        return "traceback", f"{type(exc).__name__}: {str(exc)[:200]}"
    err = result.stderr if hasattr(result, "stderr") else result.output
    if "Traceback" in err:
        return "traceback", err[-300:]
    if result.exit_code == 0:
        return "ok", ""
    if result.exit_code == 2 and len([line for line in err.strip().splitlines() if line.startswith("qbuild:")]) <= 1:
        return "refused", err.strip().splitlines()[-1][:200] if err.strip() else ""
    return "bad-exit", f"exit {result.exit_code}: {err.strip()[-200:]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=1024, help="mutants (each goes through validate and plan)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per command before it counts as a hang")
    ap.add_argument("--memory-gb", type=float, default=4.0, help="address-space limit for this process")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every traceback/hang as it happens")
    args = ap.parse_args()
    limit = int(args.memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from click.testing import CliRunner

    from qbuild.cli import cli

    bases = [p.read_text() for p in sorted((REPO / "recipes").glob("*.yaml"))]
    rng = random.Random(args.seed)
    counts: Counter = Counter()
    examples: dict[str, list[str]] = {}
    t0 = time.perf_counter()
    slowest = 0.0
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:  # click ≥ 8.2 keeps stderr apart already
        runner = CliRunner()
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "fuzz.yaml"
        store = Path(tmp) / "store"
        for i in range(args.n):
            text = rng.choice(bases)
            for _ in range(rng.randint(1, 3)):
                text = mutate(text, rng)
            recipe.write_text(text, encoding="utf-8", errors="surrogateescape")
            for cmd in (["validate", str(recipe)], ["plan", str(recipe), "--store", str(store)]):
                c0 = time.perf_counter()
                kind, detail = run_case(runner, cli, cmd, args.timeout)
                slowest = max(slowest, time.perf_counter() - c0)
                counts[kind] += 1
                if kind in ("traceback", "hang", "bad-exit"):
                    examples.setdefault(kind, []).append(f"case {i} {cmd[0]}: {detail}")
                    if args.verbose:
                        print(f"{kind}: case {i} {cmd[0]}: {detail}\n---\n{text[:400]}\n---", file=sys.stderr)
    total = sum(counts.values())
    print(f"{args.n} mutated recipes, {total} commands in {time.perf_counter() - t0:.1f} s "
          f"(slowest {slowest:.2f} s)")
    for kind in ("ok", "refused", "traceback", "hang", "bad-exit"):
        print(f"  {kind:10s} {counts[kind]}")
    for kind, rows in examples.items():
        print(f"{kind} examples:")
        for row in rows[:10]:
            print(f"  {row}")
    return 1 if counts["traceback"] or counts["hang"] else 0


if __name__ == "__main__":
    sys.exit(main())
