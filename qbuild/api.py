"""The Python API: everything the CLI does, for notebooks, orchestrators (Airflow, Dagster, Ray) and tests.

    import qbuild
    plan = qbuild.core.plan("recipes/demo.yaml")            # keys, hit/miss and why; never imports torch
    result = qbuild.run("recipes/demo.yaml", tag="nightly")
    result.passed, result.exit_code, result.summary["variants"]
    digest, path = qbuild.pull("demo/q4km", out="./q4km")
    html = qbuild.results.report("demo")

Errors are exceptions from qbuild.errors (each carries the exit code the CLI uses); nothing here
prints except the progress display, which is off unless asked for.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qbuild.errors import EXIT_GATE_FAILED, EXIT_STEP_FAILED, QBuildError, UserError

if TYPE_CHECKING:
    from qbuild.artifacts.store import Store
    from qbuild.core.executor import StepOutcome
    from qbuild.core.plan import Plan
    from qbuild.core.recipe import Recipe

log = logging.getLogger("qbuild")


@dataclass(frozen=True)
class RunResult:
    run_id: str
    plan: Plan
    outcomes: tuple[StepOutcome, ...]
    summary: dict                 # the JSON `qbuild run --json` prints (also stored as runs/<run_id>.json)
    gates: tuple[dict, ...]       # one row per (gate, variant, bound)

    @property
    def failed(self) -> list[StepOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def selected(self) -> bool:
        """No `selection:`, or something met every one of its bounds."""
        return (self.summary.get("selection") or {}).get("passed", True)

    @property
    def passed(self) -> bool:
        """No step failed, every quality gate passed and (with `selection:`) some artifact met every bound."""
        return not self.failed and all(g["passed"] for g in self.gates) and self.selected

    @property
    def exit_code(self) -> int:
        if self.failed:
            return EXIT_STEP_FAILED
        return EXIT_GATE_FAILED if not (all(g["passed"] for g in self.gates) and self.selected) else 0


def load(recipe, threads: int | None = None) -> tuple[Recipe, Path, Path | None]:
    """(recipe, directory relative paths resolve against, its file or None) from a path, dict or Recipe."""
    from qbuild.core.recipe import Recipe, load_recipe, parse_recipe

    if isinstance(recipe, Recipe):
        r, base, path = recipe, Path.cwd(), None
    elif isinstance(recipe, dict):
        r, base, path = parse_recipe(recipe), Path.cwd(), None
    else:
        path = Path(recipe)
        r, base = load_recipe(path), path.resolve().parent
    if threads:
        r = r.model_copy(update={"runtime": r.runtime.model_copy(update={"threads": threads})})
    return r, base, path


def open_store(store=None, recipe: Recipe | None = None) -> Store:
    """A Store, a path, or None: --store / QBUILD_STORE / the recipe's store.path / ./artifacts."""
    from qbuild.artifacts.store import Store
    from qbuild.artifacts.store import open_store as _open

    if isinstance(store, Store):
        return store
    return _open(store, recipe.store.path if recipe else None)


def validate(recipe) -> Plan:
    """Schema, files, installed backends and model shapes; builds nothing, reads no store."""
    from qbuild.core.plan import Plan, PlannedStep, build_steps
    from qbuild.core.step import PlanStatus

    r, base, _ = load(recipe)
    ctx = build_steps(r, base)
    return Plan(r, base, tuple(PlannedStep(s, PlanStatus.MISS) for s in ctx.steps), tuple(ctx.artifacts),
                dict(ctx.not_evaluated), tuple(ctx.warnings), overlap=ctx.overlap)


def backend_envs(recipe) -> list:
    """The backend environments (qbuild.core.envs.BackendEnv) RECIPE's steps run in, resolved but not created."""
    from qbuild.core.plan import build_steps

    r, base, _ = load(recipe)
    return list(dict.fromkeys(s.backend_env for s in build_steps(r, base).steps if s.backend_env is not None))


def open_remotes(recipe: Recipe | None = None, urls: list[str] | tuple[str, ...] = ()) -> tuple:
    """The remote tiers: --remote URLs (or QBUILD_REMOTE) beat the recipe's store.remotes."""
    from qbuild.artifacts.remote import open_remote, remotes_from_env

    given = remotes_from_env(urls)
    if given:
        return tuple(open_remote(u) for u in given)
    return tuple(spec.open() for spec in (recipe.store.remotes if recipe else ()))


def plan(recipe, *, store=None, threads: int | None = None, remotes: list[str] | tuple = (),
         verify: str = "fast", estimate: bool = True) -> Plan:
    """Every step of the recipe with its key: hit (stored locally or in a remote) or miss, and why it misses.

    With misses and `estimate`, each miss gets an estimate of its time from the store's history of similar
    steps, and the plan a total (qbuild/core/estimate.py; `plan.estimate`)."""
    from qbuild.core.plan import make_plan

    _check_verify(verify)
    r, base, _ = load(recipe, threads)
    st = open_store(store, r)
    if st is store:
        st = type(store)(store.root)   # the caller's store keeps its own setting
    st.repair = False   # a plan is a dry run: a damaged object is reported as a miss, never moved to quarantine
    the_plan = make_plan(r, base, st, open_remotes(r, remotes), verify)
    if not estimate or not the_plan.to_build:
        return the_plan
    from dataclasses import replace

    from qbuild.core.estimate import estimate_plan

    return replace(the_plan, estimate=estimate_plan(the_plan.steps, st, r.name))


def select(recipe, *, store=None, threads: int | None = None) -> dict:
    """The `selection:` of RECIPE judged from the store, building nothing: {selected: {variant, config, ...} | None,
    rejected: [{variant, config, why}], passed}. Every step the selection reads must be stored (run RECIPE first)."""
    from qbuild.core.executor import StepOutcome
    from qbuild.core.plan import make_plan
    from qbuild.core.step import Outcome, PlanStatus
    from qbuild.results.summary import summarize

    r, base, _ = load(recipe, threads)
    if r.selection is None:
        raise UserError(f"{r.name}: the recipe has no selection: section (SLOs, bounds and an objective)")
    st = open_store(store, r)
    the_plan = make_plan(r, base, st)
    outcomes, missing = [], []
    for ps in the_plan.steps:
        if ps.status == PlanStatus.HIT:
            outcomes.append(StepOutcome(ps.step, Outcome.CACHED, ps.hit.path, ps.hit.digest, record=ps.hit.record))
        elif ps.status == PlanStatus.SOURCE:
            outcomes.append(StepOutcome(ps.step, Outcome.SOURCE, path=ps.step.source_path))
        else:
            outcomes.append(StepOutcome(ps.step, Outcome.SKIPPED, error=f"not stored ({ps.status})"))
            if ps.status == PlanStatus.MISS:
                missing.append(ps.step.name)
    summary = summarize(the_plan, outcomes)
    result = dict(summary["selection"])
    if missing:
        result["not_stored"] = missing
    return result


def _check_verify(verify: str) -> None:
    from qbuild.artifacts.store import VERIFY_MODES

    if verify not in VERIFY_MODES:
        raise UserError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")


def recipe_files(args) -> list[Path]:
    """Recipe paths from arguments that may be directories (every *.yaml / *.yml in them, sorted)."""
    out: list[Path] = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml") and f.is_file())
            if not found:
                raise UserError(f"{p}: no *.yaml recipes in this directory")
            out += found
        else:
            out.append(p)
    return out


def run(recipe, *, store=None, executor: str = "local", tag: str | None = None, threads: int | None = None,
        mlflow: str | None = None, progress=None, remotes: list[str] | tuple = (), materialize: bool = False,
        jobs: int | None = None, address: str | None = None, verify: str = "fast") -> RunResult:
    """Build what is missing, evaluate, set refs, check gates, push to remotes, register, track.

    Returns the result (never exits). progress: a rich Progress (the CLI passes one) or None.
    remotes: URLs overriding the recipe's store.remotes; materialize: fetch every remote hit's files;
    jobs: steps at most at once (default: the CPU cores; threads per step × steps never exceed them);
    executor: "local" (this machine) or "ray" (a Ray cluster at `address`: auto, HOST:PORT or ray://HOST:PORT;
    it needs a remote store every node shares);
    verify: how each cache hit is checked before use, "fast" (file set, sizes, memoized hashes) or "full"."""
    return run_many([recipe], store=store, executor=executor, tag=tag, threads=threads, mlflow=mlflow,
                    progress=progress, remotes=remotes, materialize=materialize, jobs=jobs, address=address,
                    verify=verify).results[0]


@dataclass(frozen=True)
class MultiRunResult:
    results: tuple[RunResult, ...]

    @property
    def exit_code(self) -> int:
        codes = [r.exit_code for r in self.results]
        return EXIT_STEP_FAILED if EXIT_STEP_FAILED in codes else max(codes, default=0)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)


def run_many(recipes, *, store=None, executor: str = "local", tag: str | None = None, threads: int | None = None,
             mlflow: str | None = None, progress=None, remotes: list[str] | tuple = (), materialize: bool = False,
             jobs: int | None = None, address: str | None = None, verify: str = "fast") -> MultiRunResult:
    """Several recipes as one deduplicated graph: a shared model, calibration set or evaluation is built once.

    Every recipe still gets its own summary, refs, gates, run record and registration."""
    from qbuild.core.executor import Executor, Origin
    from qbuild.core.hashing import sha256_text
    from qbuild.core.names import check_name
    from qbuild.core.plan import make_plan

    if executor not in ("local", "ray"):
        raise UserError(f"unknown executor {executor!r}; available: local, ray")
    if tag is not None:
        check_name(tag, "tag")
    _check_verify(verify)
    loaded = [load(r, threads) for r in recipes]
    if not loaded:
        raise UserError("no recipe given")
    if store is None and len({r.store.path for r, _, _ in loaded}) > 1:
        raise UserError("these recipes name different store.path values; run them into one store with --store DIR")
    st = open_store(store, loaded[0][0])
    remote_tiers = open_remotes(None, remotes) if remotes else _union_remotes([r for r, _, _ in loaded])
    if executor == "ray" and not remote_tiers:   # before planning: nodes share objects through a remote only
        from qbuild.core.executor_ray import need_remote_message

        raise UserError(need_remote_message())
    plans = [make_plan(r, base, st, remote_tiers, verify) for r, base, _ in loaded]
    origins: dict = {}
    merged: dict = {}
    for (r, _, path), the_plan in zip(loaded, plans, strict=True):
        sha = sha256_text(path.read_text()) if path and path.is_file() else None
        for ps in the_plan.steps:
            merged.setdefault(ps.step.key, ps)
            origins.setdefault(ps.step.key, Origin(r.name, str(path or "<api>"), sha))
    run_id = st.new_run_id()
    started = time.time()
    device = loaded[0][0].runtime.device
    if executor == "ray":
        from qbuild.core.executor_ray import RayExecutor

        runner = RayExecutor(st, run_id, origins, address=address, progress=progress, device=device, jobs=jobs,
                             remotes=remote_tiers, materialize=materialize)
    else:
        runner = Executor(st, run_id, origins, progress=progress, device=device, jobs=jobs, remotes=remote_tiers,
                          materialize=materialize, verify=verify)
    done = runner.run(list(merged.values()))
    by_key = {o.step.key: o for o in done}
    results = []
    for i, ((_, _, path), the_plan) in enumerate(zip(loaded, plans, strict=True)):
        outcomes = [by_key[ps.step.key] for ps in the_plan.steps]
        rid = run_id if i == 0 else st.new_run_id()
        results.append(_finish(st, the_plan, outcomes, rid, path, started, tag, mlflow))
    return MultiRunResult(tuple(results))


def _union_remotes(recipes: list[Recipe]) -> tuple:
    seen: dict = {}
    for r in recipes:
        for spec in r.store.remotes:
            seen.setdefault(spec.url, spec)
    return tuple(spec.open() for spec in seen.values())


def _finish(st: Store, the_plan: Plan, outcomes: list[StepOutcome], run_id: str, path: Path | None, started: float,
            tag: str | None, mlflow: str | None) -> RunResult:
    """After the build: summary, refs, gates, write-through, registry, tracking, run record."""
    from qbuild.core.fingerprint import cpu_model
    from qbuild.results.summary import summarize

    r = the_plan.recipe
    summary = summarize(the_plan, outcomes)
    tags = set_refs(st, the_plan, outcomes, tag)
    summary.update({"run_id": run_id, "store": str(st.root), "seconds": round(time.time() - started, 3),
                    "hardware": {"cpu": cpu_model(), "threads": r.runtime.resolved_threads()}})
    gate_rows: list[dict] = []
    if r.evaluation.gates:
        from qbuild.evaluate.gates import check_gates

        previous = st.last_good_run(r.name, before=run_id)   # what regression bounds compare with
        gate_rows = check_gates(r.evaluation.gates, summary, previous)
        summary["gates"] = {"passed": all(g["passed"] for g in gate_rows), "checks": gate_rows,
                            "compared_with": previous.get("run_id") if previous else None}
    failed = any(o.status == "failed" for o in outcomes)
    if r.runtime.rebuild_check and not failed:   # a nightly job's reproducibility check of chosen steps
        from qbuild.results.rebuild import after_run

        summary["rebuild_check"], rebuild_gates = after_run(st, the_plan, r.runtime.rebuild_check)
        gate_rows += rebuild_gates
        summary.setdefault("gates", {"checks": [], "compared_with": None})
        summary["gates"]["checks"] = gate_rows
        summary["gates"]["passed"] = all(g["passed"] for g in gate_rows)
    if the_plan.remotes and not failed:
        from qbuild.results.publish import write_through

        summary["remotes"] = write_through(st, the_plan, outcomes, summary, tags)
    mlflow_cfg = r.tracking.mlflow
    if r.model_registry and not failed:
        from qbuild.results.publish import register

        summary["registered"] = register(the_plan, outcomes, summary, st, mlflow or (mlflow_cfg.uri if mlflow_cfg else None))
    if mlflow or mlflow_cfg:
        summary["mlflow"] = track(mlflow or mlflow_cfg.uri, mlflow_cfg.experiment if mlflow_cfg else None,
                                  r, summary, st)
    from qbuild.core.names import redact_tree

    summary = redact_tree(summary)   # no password in a URL reaches --json, the run record or a report
    if st.quarantined:
        summary["quarantined"] = list(st.quarantined)
    st.write_run(run_id, redact_tree({**summary, "recipe_path": str(path.resolve()) if path else None,
                                      "resolved_recipe": r.canonical(), "finished": time.time()}))
    return RunResult(run_id, the_plan, tuple(outcomes), summary, tuple(gate_rows))


def set_refs(store: Store, the_plan: Plan, outcomes: list[StepOutcome], tag: str | None) -> list[str]:
    """recipe/<artifact>:latest (+ tags) for every named artifact this run has, built or cached; returns the tags.

    A remote hit gets its local ref too: the name resolves, and `pull` fetches the object when asked."""
    recipe = the_plan.recipe
    by_key = {o.step.key: o for o in outcomes}
    # artifacts (incl. identical variants sharing a step), the imported base model, and target outputs
    named = {**{o.step.variant: o.step for o in outcomes if o.step.variant}, **the_plan.artifact_steps()}
    tags = ["latest"] + ([tag] if tag else []) + ([recipe.store.tag] if recipe.store.tag else [])
    for label, step in named.items():
        o = by_key.get(step.key)
        if o and o.digest and o.status in ("built", "cached"):
            for t in tags:
                if not store.writable:  # a read-only store serves hits; its refs stay as they are
                    if (store.get_ref(recipe.name, label, t) or {}).get("digest") != o.digest:
                        log.warning(f"store {store.root} is read-only: ref {recipe.name}/{label}:{t} not updated")
                    continue
                store.set_ref(recipe.name, label, t, o.digest, step.key)
    return tags


TRACKING_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}
_tracking_failed: set[str] = set()   # tracking URIs that failed in this process: warned once, not retried


def track(uri: str, experiment: str | None, recipe: Recipe, summary: dict, store: Store) -> dict:
    """Log to MLflow; a tracking failure is one warning (once per server), never fatal to the stored artifacts.

    The client's HTTP timeout and retries are bounded (TRACKING_ENV, unless the environment sets its own), so an
    unreachable server costs seconds, not minutes; the run's result never depends on it."""
    from qbuild.artifacts.mlflow_registry import mlflow_http_limits
    from qbuild.core.names import redact_url
    from qbuild.results.report import render_html
    from qbuild.results.tracking import log_run

    shown = redact_url(uri)
    if uri in _tracking_failed:
        return {"uri": shown, "error": "unreachable (see the warning above)"}
    try:
        # mlflow prints run links; stdout is for --json
        with mlflow_http_limits(TRACKING_ENV), contextlib.redirect_stdout(sys.stderr):
            run_id = log_run(uri, experiment, recipe, summary, store, render_html(summary))
        return {"uri": shown, "run_id": run_id}
    except QBuildError:
        raise
    except Exception as exc:  # server down, bad URI: the build itself succeeded
        _tracking_failed.add(uri)
        reason = redact_url(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
        log.warning(f"MLflow tracking to {shown} failed (the run's result is unchanged): {reason}")
        return {"uri": shown, "error": reason}


def pull(name: str, *, store=None, out: str | Path | None = None, need: dict | None = None, remote=None,
         verify_with: str | Path | None = None, tracking_uri: str | None = None, progress=None,
         force: bool = False) -> tuple[str, Path]:
    """Fetch NAME, every file verified against its manifest; returns (digest, path).

    NAME is a ref (recipe/variant[:tag]), a digest, or models:/NAME@ALIAS (MLflow registry: it names the
    digest and the store that holds it). From the local store by default; from a remote with `remote=`
    (URL or RemoteStore), or when the local store lacks the object and QBUILD_REMOTE names remotes.
    An engine ref picks the build that fits this GPU (SM + TensorRT toolchain; `need` overrides the probe).
    `verify_with`: a public key; unsigned or tampered artifacts are refused (remote/registry pulls).
    `out` must be new or empty; `force=True` writes into a non-empty folder, replacing files of the artifact's names
    (a link there is replaced, never written through) and touching nothing else."""
    if name.startswith("models:/"):
        import os

        from qbuild.artifacts.mlflow_registry import resolve_models_uri

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise UserError(f"{name}: set MLFLOW_TRACKING_URI (or pass --mlflow) to resolve registry names")
        name, store_url = resolve_models_uri(name, uri)
        if store_url.startswith("qbuild-file://"):
            store = store or store_url.removeprefix("qbuild-file://")
        elif remote is None:
            remote = _remote_named_by_registry(store_url)
    if remote is not None:
        return _pull_remote(name, remote, out, need, verify_with, progress)
    if verify_with is not None:
        raise UserError("--verify-with checks the signature pushed with an artifact: pull it from its remote "
                        "(--from REMOTE) or by registry name (models:/NAME@ALIAS)")
    return _pull_local(name, open_store(store), out, need, progress, force)


def _remote_named_by_registry(url: str):
    """The remote a registry version's tag names. It may use qbuild's credential variables only when the user
    configured that host themselves (QBUILD_REMOTE): a tag must not send QBUILD_REGISTRY_PASSWORD to any host."""
    from urllib.parse import urlsplit

    from qbuild.artifacts.remote import open_remote, remotes_from_env

    def netloc(u: str) -> str:   # host and port: another port on the same host is another registry
        return urlsplit(u).netloc.rsplit("@", 1)[-1].lower()

    configured = {netloc(u) for u in remotes_from_env()}
    return open_remote(url, env_credentials=bool(netloc(url)) and netloc(url) in configured)


def _pull_remote(name, remote, out, need, verify_with, progress) -> tuple[str, Path]:
    from qbuild.artifacts.remote import RemoteError, open_remote
    from qbuild.artifacts.remote.cache import pull as pull_from
    from qbuild.artifacts.remote.cache import resolve
    from qbuild.build.tensorrt_llm import ENGINE_KIND
    from qbuild.build.trtllm_select import local_needs

    r = open_remote(remote) if isinstance(remote, str) else remote
    if out is None:
        raise UserError(f"pulling from {r.display} needs a destination: --out DIR")
    try:
        is_engine = (r.get_manifest(resolve(r, name)) or {}).get("kind") == ENGINE_KIND
    except RemoteError as exc:
        if not exc.reason.startswith(("no ref", "no object")):
            raise
        try:  # engine builds are found by recipe/variant even where no ref names them
            need = need or local_needs()
        except UserError:
            raise exc from None
        is_engine = True
    manifest = pull_from(r, name, Path(out), need=(need or local_needs()) if is_engine else None,
                         progress=progress, verify_with=verify_with)
    return manifest["digest"], Path(out)


def _pull_local(name: str, st: Store, out, need, progress, force: bool = False) -> tuple[str, Path]:
    from qbuild.artifacts.store import REF_RE
    from qbuild.build.tensorrt_llm import ENGINE_KIND
    from qbuild.build.trtllm_select import engine_manifests, local_needs, select_engine

    m = REF_RE.match(name)
    try:
        digest = st.resolve(name)
    except UserError:
        # engine builds are found by recipe/variant even where no ref was set for them
        family = engine_manifests(st, m.group("recipe"), m.group("variant")) if m else []
        if not family:
            raise
        digest = family[0]["digest"]
    if not (st.object_dir(digest) / "manifest.json").is_file():
        _fetch_missing(st, digest, progress)  # a ref set by a run that hit a remote: read through now
    manifest = st.manifest(digest)
    if manifest.get("kind") == ENGINE_KIND:
        need = need or local_needs()
        family = engine_manifests(st, m.group("recipe"), m.group("variant")) if m else [manifest]
        if m is None or manifest not in family:
            family = [manifest] + family
        digest = select_engine(family, need, name)["digest"]
    rows = st.verify([digest])
    if not rows[0]["ok"]:
        raise QBuildError(f"{name}: object {digest[:12]} is damaged: " + "; ".join(rows[0]["problems"])
                          + " (run `qbuild verify --repair`, then rebuild)")
    src = st.object_dir(digest)
    if out is None:
        return digest, src
    dest = Path(out)
    if dest.is_symlink():
        raise UserError(f"--out {dest} is a symlink; give the folder itself (a pull never writes through a link)")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise UserError(f"--out {dest} exists and is not empty; give a new or empty folder (or --force to write "
                        "the artifact's files into it)")
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()):
        write_fresh(f, dest, f.relative_to(src))
    return digest, dest


def write_fresh(src: Path, dest_root: Path, rel: Path) -> Path:
    """Copy src to dest_root/rel without following any link already there: a fresh file, then an atomic replace.

    A symlink at the target (or a symlinked directory on the way) is replaced, never written through."""
    import os
    import shutil
    import uuid

    parent = dest_root
    for part in rel.parts[:-1]:
        parent = parent / part
        if parent.is_symlink():
            parent.unlink()
        parent.mkdir(exist_ok=True)
    target = parent / rel.parts[-1]
    staged = parent / f".{rel.parts[-1]}.{uuid.uuid4().hex[:8]}.part"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out, 1 << 20)
    os.replace(staged, target)   # replaces a link itself, not what it points at
    return target


def _fetch_missing(st: Store, digest: str, progress) -> None:
    from qbuild.artifacts.remote.cache import materialize

    for r in open_remotes():
        if r.get_manifest(digest) is not None:
            materialize(st, r, digest, progress=progress)
            return
    raise UserError(f"object {digest[:12]} is not in store {st.root}, and no remote (QBUILD_REMOTE / --from) has it")


def push(name: str, to: str, *, store=None, progress=None) -> dict:
    """Upload NAME (ref or digest) from the local store to a remote: files, sidecars, manifest, action record, ref."""
    from qbuild.artifacts.remote import open_remote
    from qbuild.artifacts.remote.cache import build_sidecars, push_hit
    from qbuild.artifacts.store import REF_RE

    st = open_store(store)
    digest = st.resolve(name)
    manifest = st.manifest(digest)
    problems = st.check_object(digest, full=True)
    if problems or not isinstance(manifest.get("key"), str):
        raise QBuildError(f"{name}: object {digest[:12]} is damaged: {'; '.join(problems) or 'manifest has no key'} "
                          "(run `qbuild verify --repair`, then rebuild); nothing pushed")
    remote = open_remote(to)
    m = REF_RE.match(name)
    refs = [(m.group("recipe"), m.group("variant"), m.group("tag") or "latest")] if m else []
    uploaded = push_hit(remote, st, manifest["key"], digest, None,
                        sidecars=lambda: build_sidecars(st, digest), refs=refs, progress=progress)
    return {"digest": digest, "remote": remote.display, "uploaded": uploaded, "refs": [f"{a}/{b}:{c}" for a, b, c in refs]}


def report(name: str | None = None, *, store=None, markdown: bool = False) -> str:
    """The report of a run (run id, recipe name or file, or None for the latest) as HTML or Markdown."""
    from qbuild.results.report import find_run, render_html, render_markdown

    st = open_store(store)
    record = find_run(st, name)
    if markdown:
        return render_markdown(record)
    return render_html(record, history=history(st, record))


def history(st: Store, record: dict) -> list[dict]:
    """The report's history view: the run records of the recipe of `record`, oldest first, up to that run."""
    runs = st.runs(record.get("recipe"))
    ids = [r.get("run_id") for r in runs]
    return runs[:ids.index(record["run_id"]) + 1] if record.get("run_id") in ids else runs


def diff(run_a: str | None = None, run_b: str | None = None, *, last: str | None = None, store=None) -> dict:
    """What changed between two recorded runs (ids), or the last two runs of recipe `last` (a name or file):
    per variant Δ PPL / KLD / decode tok/s and size, and each step run B rebuilt with why."""
    from qbuild.results.diff import diff_runs, find_record, last_two

    st = open_store(store)
    if last is not None:
        if Path(last).is_file():
            from qbuild.core.recipe import load_recipe

            last = load_recipe(last).name
        a, b = last_two(st, last)
    elif run_a and run_b:
        a, b = find_record(st, run_a), find_record(st, run_b)
    else:
        raise UserError("diff needs two run ids (RUN_A RUN_B) or --last RECIPE")
    return diff_runs(st, a, b)


def find_run(name: str | None = None, *, store=None) -> dict[str, Any]:
    from qbuild.results.report import find_run as _find

    return _find(open_store(store), name)
