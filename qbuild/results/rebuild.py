"""`qbuild verify --rebuild`: re-execute stored steps in scratch and compare them with what is stored, file by file.

Each checked step is run again by the ordinary executor, against a scratch store made for the check (under the
store's tmp/, removed afterwards), with its inputs read from the real store's objects: the stored object is never
written, moved or re-published. The rebuilt object is compared with the stored one:

- identical: the same file list with the same sha256 (the same digest);
- otherwise which files differ (size, sha256), how far each numeric metric moved, and which facts of the machine
  or environment differ from those the stored manifest records.

The outcome is recorded beside the object as a mutable store record, `rebuilds/<dd>/<digest>.json` (manifests are
immutable, content-addressed provenance; the last check is not part of the object), and `qbuild show` prints it.

Timing steps (throughput, serving: every step whose key holds the machine's hardware, `Step.per_hardware`; their
output is a measurement) are not re-executed: they are reported as "not checked" with that reason, and counted.
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from pathlib import Path

from qbuild.artifacts.store import Store, now_iso, read_json
from qbuild.base.errors import UserError
from qbuild.base.hardware import machine_facts

KEEP_HISTORY = 10          # earlier checks kept in the record, newest first
TIMING = "a timing: its output is a measurement of this machine, never bit-identical"


def record_file(store: Store, digest: str) -> Path:
    from qbuild.artifacts.store import checked_digest

    return store.root / "rebuilds" / digest[:2] / f"{checked_digest(digest)}.json"   # never a path from a name


def last_check(store: Store, digest: str) -> dict | None:
    """The last rebuild check of an object (None: never checked)."""
    data = read_json(record_file(store, digest))
    return data.get("last") if data else None


def _record(store: Store, digest: str, result: dict) -> None:
    path = record_file(store, digest)
    old = read_json(path) or {}
    history = ([old["last"]] if old.get("last") else []) + list(old.get("history", []))
    store.write_json(path, {"digest": digest, "last": result, "history": history[:KEEP_HISTORY]})


def compare_files(stored: list[dict], rebuilt: list[dict]) -> list[dict]:
    """Files that differ between two manifests' file lists: path, and the size/sha256 on each side (None: absent)."""
    a = {f["path"]: f for f in stored}
    b = {f["path"]: f for f in rebuilt}
    out = []
    for path in sorted(set(a) | set(b)):
        fa, fb = a.get(path), b.get(path)
        if fa and fb and fa["sha256"] == fb["sha256"]:
            continue
        out.append({"path": path, "stored_size": fa and fa["size"], "rebuilt_size": fb and fb["size"],
                    "stored_sha256": fa and fa["sha256"][:16], "rebuilt_sha256": fb and fb["sha256"][:16]})
    return out


def compare_metrics(stored: dict, rebuilt: dict) -> dict:
    """Numeric metrics that moved: name → {stored, rebuilt, delta, delta_pct}."""
    out = {}
    for k in sorted(set(stored) | set(rebuilt)):
        a, b = stored.get(k), rebuilt.get(k)
        if a == b:
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            out[k] = {"stored": a, "rebuilt": b, "delta": b - a, "delta_pct": 100 * (b - a) / a if a else None}
        else:
            out[k] = {"stored": a, "rebuilt": b}
    return out


def compare_environment(stored: dict, rebuilt: dict) -> dict:
    """Facts that differ: the toolchain (in the key: equal unless the manifest was made elsewhere by hand), the
    machine (recorded since this check exists), and the runtime a measurement used (its info)."""
    out = {}
    for section in ("toolchain", "machine"):
        a, b = stored.get(section), rebuilt.get(section) or {}
        if a is None:
            out[section] = {"stored": "not recorded", "rebuilt": b}
            continue
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out[f"{section}.{k}"] = {"stored": a.get(k), "rebuilt": b.get(k)}
    ra = (stored.get("info") or {}).get("runtime") or {}
    rb = (rebuilt.get("info") or {}).get("runtime") or {}
    for k in sorted(set(ra) | set(rb)):
        if k != "seconds" and ra.get(k) != rb.get(k):
            out[f"runtime.{k}"] = {"stored": ra.get(k), "rebuilt": rb.get(k)}
    return out


def _closure(plan, step) -> list:
    """The planned steps `step` reads or waits for (its checks), transitively, in plan order (all stored: they are
    served as hits)."""
    need, stack = set(), list(step.prerequisites())
    while stack:
        s = stack.pop()
        if s.key not in need:
            need.add(s.key)
            stack.extend(s.prerequisites())
    return [p for p in plan.steps if p.step.key in need]


def summarize_checks(rows: list[dict], st: Store) -> dict:
    checked = [r for r in rows if r["status"] in ("identical", "different", "failed")]
    timings = [r["step"] for r in rows if r.get("reason") == TIMING]
    return {"steps": rows, "checked": len(checked), "identical": all(r["status"] == "identical" for r in checked),
            "timings_not_rebuilt": timings,
            "where": socket.gethostname(), "when": now_iso(), "store": str(st.root)}


def check_steps(st: Store, plan, planned, *, progress=None, log=None) -> list[dict]:
    """One result row per planned step: re-executed and compared, or why it was not checked."""
    from qbuild.contract.step import Outcome, PlanStatus
    from qbuild.pipeline.executor import Executor
    from qbuild.pipeline.plan import PlannedStep

    rows = []
    for ps in planned:
        step = ps.step
        row = {"step": step.name, "kind": step.kind, "key": step.key}
        if ps.status == PlanStatus.SOURCE:
            continue   # an external input: not built by qbuild
        if ps.status != PlanStatus.HIT:
            rows.append(row | {"status": "not checked", "reason": f"not stored ({ps.status})"})
            continue
        if step.per_hardware:   # a timing (throughput, serving): the machine is in its key, its output a measurement
            rows.append(row | {"status": "not checked", "reason": TIMING, "digest": ps.hit.digest})
            continue
        if log:
            log(f"rebuilding {step.name} ({step.key[:12]})")
        rows.append(row | _check_one(st, plan, ps, Executor, PlannedStep, Outcome, PlanStatus, progress))
    return rows


def after_run(st: Store, the_plan, wanted: list[str], progress=None) -> tuple[dict, list[dict]]:
    """A recipe's `runtime.rebuild_check` (step kinds or names): those steps re-executed right after the run, and
    one gate row per step (passed: bit-identical), so a nightly job fails (exit 3) on a step that is not."""
    from qbuild.pipeline.plan import step_status

    chosen = [p.step for p in the_plan.steps if p.step.kind in wanted or p.step.name in wanted]
    planned = [step_status(s, st, the_plan.recipe.name) for s in chosen]   # built by the run: stored now
    rows = check_steps(st, the_plan, planned, progress=progress)
    gates = [{"gate": "rebuild_check", "variant": r["step"], "check": "rebuild_identical",
              "metric": "bit-identical rebuild", "value": float(r["status"] == "identical"), "bound": 1.0,
              "passed": r["status"] == "identical", "by": None if r["status"] == "identical" else 1.0}
             for r in rows if r["status"] != "not checked"]
    return summarize_checks(rows, st), gates


def _check_one(st: Store, plan, ps, Executor, PlannedStep, Outcome, PlanStatus, progress) -> dict:
    step, stored_digest = ps.step, ps.hit.digest
    stored = st.manifest(stored_digest)
    root = st.owned   # claims the store (its marker) before anything is written
    root.mkdirs(st.root / "tmp")
    scratch = Path(tempfile.mkdtemp(prefix="rebuild-", dir=st.root / "tmp"))   # ours: made here, removed here
    t0 = time.perf_counter()
    try:
        scratch_store = Store(scratch / "store")
        planned = [*_closure(plan, step), PlannedStep(step, PlanStatus.MISS)]
        run_id = "rebuild-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        [*_, outcome] = Executor(scratch_store, run_id, {}, progress=progress, device=plan.recipe.runtime.device,
                                 jobs=1).run(planned)
        if outcome.status != Outcome.BUILT:
            result = {"status": "failed", "reason": outcome.error or str(outcome.status)}
        else:
            rebuilt = outcome.record
            rebuilt = {**rebuilt, "machine": rebuilt.get("machine") or machine_facts()}
            files = compare_files(stored.get("files", []), rebuilt.get("files", []))
            result = {"status": "identical" if outcome.digest == stored_digest else "different",
                      "rebuilt_digest": outcome.digest, "files_differ": files,
                      "metrics_moved": compare_metrics(stored.get("metrics", {}), rebuilt.get("metrics", {})),
                      "environment_differs": compare_environment(stored, rebuilt),
                      "timings": {"stored": stored.get("timings"), "rebuilt": rebuilt.get("timings")}}
    finally:
        try:
            root.remove(scratch, within=st.root / "tmp")
        except OSError:
            pass
    result |= {"digest": stored_digest, "seconds": round(time.perf_counter() - t0, 2), "when": now_iso(),
               "where": socket.gethostname(), "machine": machine_facts(), "qbuild_python": sys.executable}
    _record(st, stored_digest, result)
    return result


def rebuild_check(names, *, store=None, progress=None, log=None) -> dict:
    """Re-execute the stored steps of a recipe (or of the named refs/digests) in scratch and compare each with the
    stored object. Returns {"steps": [...], "identical": bool, ...}; records each result beside its object."""
    from qbuild.artifacts.access import open_store
    from qbuild.pipeline.run import load

    names = tuple(names)
    if not names:
        raise UserError("verify --rebuild needs a RECIPE file or refs/digests to re-execute")
    recipe_file = len(names) == 1 and Path(names[0]).suffix in (".yaml", ".yml") and Path(names[0]).is_file()
    st = open_store(store, load(names[0])[0] if recipe_file else None)   # a recipe names its own store
    st.require_writable("verify --rebuild (it records the result beside each object)")
    rows = []
    for the_plan, checked in _plans_to_recheck(names, st):
        rows += check_steps(st, the_plan, checked, progress=progress, log=log)
    return summarize_checks(rows, st)


def _plans_to_recheck(names: tuple[str, ...], st: Store):
    """(plan, [planned steps to check]) for a recipe file, or for refs/digests (through the recipe each manifest
    names: the step's runtime paths come from planning it again)."""
    from qbuild.pipeline.run import plan

    if len(names) == 1 and Path(names[0]).suffix in (".yaml", ".yml") and Path(names[0]).is_file():
        the_plan = plan(names[0], store=st)
        return [(the_plan, list(the_plan.steps))]
    wanted: dict[str, list[str]] = {}   # recipe path → keys
    for name in names:
        digest = st.resolve(name)
        manifest = st.manifest(digest)
        path = (manifest.get("recipe") or {}).get("path")
        if not path or not Path(path).is_file():
            raise UserError(f"{name}: the recipe it was built from ({path or 'not recorded'}) is not here; "
                            "give the recipe file instead")
        wanted.setdefault(path, []).append(manifest["key"])
    out = []
    for path, keys in wanted.items():
        the_plan = plan(path, store=st)
        found = {p.step.key: p for p in the_plan.steps}
        missing = [k[:12] for k in keys if k not in found]
        if missing:
            raise UserError(f"{path} no longer plans step(s) {', '.join(missing)} (the recipe or the tools changed); "
                            "nothing to re-execute them from")
        out.append((the_plan, [found[k] for k in keys]))
    return out
