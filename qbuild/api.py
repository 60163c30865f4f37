"""The Python API: everything the CLI does, for notebooks, orchestrators (Airflow, Dagster, Ray) and tests.

    import qbuild
    plan = qbuild.plan("recipes/demo.yaml")                 # keys, hit/miss and why; never imports torch
    result = qbuild.run("recipes/demo.yaml", tag="nightly")
    result.passed, result.exit_code, result.summary["variants"]
    digest, path = qbuild.pull("demo/q4km", out="./q4km")
    html = qbuild.report("demo")

Errors are exceptions from qbuild.errors (each carries the exit code the CLI uses); nothing here prints except the
progress display, which is off unless asked for. Each function is a short delegate to the package the work belongs
to: pipeline/run.py (load, plan, build), results/conclude.py (refs, gates, run records), artifacts/pull.py,
artifacts/access.py (the store and remotes), pipeline/catalog.py (what is installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from qbuild.artifacts.access import gc, open_remotes, open_store, refs, register_model, tag, verify
from qbuild.artifacts.pull import machine_bound_targets, pull_options, verified_as
from qbuild.base.errors import UserError
from qbuild.pipeline.catalog import create_environments, environments, plugins, recipe_schema, remove_environments
from qbuild.pipeline.run import backend_envs, load, recipe_files, validate
from qbuild.results.conclude import TRACKING_ENV, MultiRunResult, RunResult, deployment, select, set_refs, track
from qbuild.results.rebuild import rebuild_check

if TYPE_CHECKING:
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.plan import Plan

__all__ = [
    "TRACKING_ENV", "MultiRunResult", "RunResult", "backend_envs", "create_environments", "deployment", "diff",
    "environments", "find_run", "gc", "history", "init", "keygen", "load", "machine_bound_targets", "open_remotes",
    "open_store", "plan", "plugins", "pull", "pull_options", "push", "rebuild_check", "recipe_files",
    "recipe_schema", "refs", "register_model", "remove_environments", "report", "run", "run_many", "run_store",
    "select", "set_refs", "show", "tag", "track", "validate", "verified_as", "verify",
]


def plan(recipe, *, store=None, threads: int | None = None, remotes: list[str] | tuple = (),
         verify: str = "fast", estimate: bool = True) -> Plan:
    """Every step of the recipe with its key: hit (stored locally or in a remote) or miss, and why it misses.

    With misses and `estimate`, each miss gets an estimate of its time from the store's history of similar
    steps, and the plan a total (qbuild/pipeline/estimate.py; `plan.estimate`)."""
    from qbuild.pipeline.run import plan as plan_recipe

    return plan_recipe(recipe, store=store, threads=threads, remotes=remotes, verify=verify, estimate=estimate)


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


def run_many(recipes, *, store=None, executor: str = "local", tag: str | None = None, threads: int | None = None,
             mlflow: str | None = None, progress=None, remotes: list[str] | tuple = (), materialize: bool = False,
             jobs: int | None = None, address: str | None = None, verify: str = "fast") -> MultiRunResult:
    """Several recipes as one deduplicated graph: a shared model, calibration set or evaluation is built once.

    Every recipe still gets its own summary, refs, gates, run record and registration."""
    from qbuild.pipeline.run import build
    from qbuild.results.conclude import finish

    built = build(recipes, store=store, executor=executor, tag=tag, threads=threads, progress=progress,
                  remotes=remotes, materialize=materialize, jobs=jobs, address=address, verify=verify)
    results = []
    for i, (the_plan, outcomes, path) in enumerate(built.runs):
        if the_plan.recipe.selection is not None and the_plan.recipe.selection.on_uncertain == "measure_more":
            from qbuild.results.measure_more import measure_more

            the_plan, outcomes = measure_more(built, the_plan, outcomes)
        run_id = built.run_id if i == 0 else built.store.new_run_id()
        results.append(finish(built.store, the_plan, outcomes, run_id, path, built.started, tag, mlflow))
    return MultiRunResult(tuple(results))


def pull(name: str, *, store=None, out: str | Path | None = None, need: dict | None = None, remote=None,
         machine: dict | None = None,
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
    from qbuild.artifacts.pull import pull as pull_artifact

    return pull_artifact(name, store=store, out=out, need=need, remote=remote, machine=machine,
                         verify_with=verify_with, tracking_uri=tracking_uri, progress=progress, force=force)


def push(name: str, to: str, *, store=None, progress=None) -> dict:
    """Upload NAME (ref or digest) from the local store to a remote: files, sidecars, manifest, action record, ref."""
    from qbuild.results.publish import push as push_artifact

    return push_artifact(name, to, store=store, progress=progress)


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
            from qbuild.planning.recipe import load_recipe

            last = load_recipe(last).name
        a, b = last_two(st, last)
    elif run_a and run_b:
        a, b = find_record(st, run_a), find_record(st, run_b)
    else:
        raise UserError("diff needs two run ids (RUN_A RUN_B) or --last RECIPE")
    return diff_runs(st, a, b)


def find_run(name: str | None = None, *, store=None) -> dict[str, Any]:
    """A run record: NAME a run id, a recipe name or file (its latest run), or None (the store's latest). Without
    `store`, a recipe file's runs are looked up in its own store.path."""
    from qbuild.results.report import find_run as _find

    return _find(run_store(name, store), name)


def run_store(name: str | None, store=None):
    """The store a run is looked up in: `store`, else a recipe file's store.path, else the default."""
    if store is None and name and Path(name).suffix in (".yaml", ".yml") and Path(name).is_file():
        from qbuild.planning.recipe import load_recipe

        return open_store(None, load_recipe(name))
    return open_store(store)


def show(name: str, *, store=None) -> tuple[str, dict]:
    """(digest, manifest) of a ref, digest or step key: the manifest with its path, its last rebuild check, the engines
    that load it and, when its files no longer match, `damaged`."""
    from qbuild.base.names import redact_tree
    from qbuild.contract.formats import manifest_loads_in
    from qbuild.results.rebuild import last_check

    st = open_store(store)
    digest = st.resolve(name)
    manifest = st.manifest(digest)
    manifest["path"] = str(st.object_dir(digest))
    manifest["rebuild_check"] = last_check(st, digest) or "never (qbuild verify --rebuild)"
    if "loads_in" not in manifest:   # built before manifests recorded it: the same table answers now
        engines = manifest_loads_in(str(manifest.get("format") or ""), manifest.get("scheme"), manifest.get("info"))
        if engines is not None:
            manifest["loads_in"] = engines
    search = (manifest.get("info") or {}).get("search") or {}
    if search.get("command"):   # a searched mix: the llama-quantize line that rebuilds it without qbuild
        manifest["rebuild_command"] = search["command"]
    problems = st.check_object(digest)
    if problems:
        manifest["damaged"] = problems
    return digest, redact_tree(manifest)


def init(model: str, out: str | Path | None = None, *, engine: str | None = None, max_size_mb: float | None = None,
         force: bool = False):
    """Write a commented starter recipe for MODEL (an HF checkpoint folder, a .gguf file or pkg://package/file.gguf) to
    `out` (default ./<model-name>.yaml): the variants its family builds for `engine` on this machine, evaluation,
    serving, a selection stub and the plan's cold-time estimate; it validates and plans unedited
    (qbuild/results/init_recipe.py). UserError when the model is refused or `out` exists without `force`."""
    from qbuild.results.init_recipe import init_recipe

    return init_recipe(model, out, engine=engine, max_size_mb=max_size_mb, force=force)


def keygen(path) -> tuple[Path, Path]:
    """Write an EC P-256 signing key to PATH and its public key to PATH.pub."""
    from qbuild.artifacts.signing import keygen as make_key

    return make_key(path)
