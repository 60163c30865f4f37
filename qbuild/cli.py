"""Command line: `qbuild RECIPE` builds it; `qbuild plan|validate|schema|ls|show|verify` inspect."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from qbuild.errors import EXIT_GATE_FAILED, EXIT_STEP_FAILED, QBuildError

STORE_OPTION = click.option(
    "--store", "store_path", envvar="QBUILD_STORE", type=click.Path(file_okay=False),
    help="Artifact store directory [env QBUILD_STORE; default: the recipe's store.path, else ./artifacts].",
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")


class DefaultToRun(click.Group):
    """`qbuild recipe.yaml` means `qbuild run recipe.yaml`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _stderr():
    from rich.console import Console

    return Console(stderr=True)


def _fail(exc: BaseException) -> None:
    code = exc.exit_code if isinstance(exc, QBuildError) else EXIT_STEP_FAILED
    msg = str(exc) if isinstance(exc, QBuildError) else f"internal error: {type(exc).__name__}: {exc}"
    click.echo(f"qbuild: error: {msg}", err=True)
    if os.environ.get("QBUILD_DEBUG"):
        import traceback

        traceback.print_exc()
    sys.exit(code)


def _load(recipe_path: str):
    from qbuild.recipe import load_recipe

    return load_recipe(recipe_path)


@click.group(cls=DefaultToRun, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="qbuild")
def cli():
    """Turn a language model into cached, versioned, serving-ready quantized artifacts.

    \b
    Quick start:
      qbuild recipes/demo.yaml          build every variant of the recipe (same as `qbuild run`)
      qbuild plan recipes/demo.yaml     show each step: cached (hit) or to build (miss) and why
      qbuild ls                         list stored artifacts by ref (recipe/variant:tag)
      qbuild show demo/q4km             provenance of one artifact: params, inputs, files, metrics

    Steps are pure functions of hashed inputs: a step whose key is already in the store is never
    rebuilt. Exit codes: 0 ok, 1 a step failed, 2 bad recipe or input, 3 a quality gate failed.
    """


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@STORE_OPTION
@JSON_OPTION
@click.option("--tag", help="Also point RECIPE/VARIANT:TAG at each built variant (besides :latest).")
@click.option("--dry-run", is_flag=True, help="Only plan: show what would run, build nothing.")
@click.option("--threads", type=int, help="CPU threads per step (overrides runtime.threads).")
@click.option("--mlflow", "mlflow_uri", metavar="URI", help="Log the run to MLflow (overrides tracking.mlflow.uri).")
def run(recipe, store_path, as_json, tag, dry_run, threads, mlflow_uri):
    """Build every step of RECIPE that is not already stored, then print a summary table."""
    try:
        _run(recipe, store_path, as_json, tag, dry_run, threads, mlflow_uri)
    except QBuildError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        click.echo("qbuild: interrupted; finished steps are stored, rerun to resume", err=True)
        sys.exit(130)


def _run(recipe_path, store_path, as_json, tag, dry_run, threads, mlflow_uri=None):
    from qbuild.artifacts import open_store
    from qbuild.plan import make_plan

    recipe = _load(recipe_path)
    if threads:
        recipe = recipe.model_copy(update={"runtime": recipe.runtime.model_copy(update={"threads": threads})})
    store = open_store(store_path, recipe.store.path)
    planned, variant_steps = make_plan(recipe, Path(recipe_path).resolve().parent, store)
    if dry_run:
        _print_plan(planned, as_json)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from qbuild.executor import Executor
    from qbuild.summary import render_table, summarize

    run_id = store.new_run_id()
    console = _stderr()
    started = time.time()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not any(p.status == "miss" for p in planned)) as progress:
        outcomes = Executor(store, recipe, Path(recipe_path), run_id, progress, recipe.runtime.device).run(planned)
    summary = summarize(recipe, outcomes, variant_steps)
    _set_refs(store, recipe, outcomes, variant_steps, tag)
    from qbuild.fingerprint import cpu_model

    summary.update({"run_id": run_id, "store": str(store.root), "seconds": round(time.time() - started, 3),
                    "hardware": {"cpu": cpu_model(), "threads": recipe.runtime.resolved_threads()}})
    gate_rows = []
    if recipe.evaluation.gates:
        from qbuild.evaluate.gates import check_gates

        gate_rows = check_gates(recipe.evaluation.gates, summary)
        summary["gates"] = {"passed": all(r["passed"] for r in gate_rows), "checks": gate_rows}
    mlflow_cfg = recipe.tracking.mlflow
    if mlflow_uri or mlflow_cfg:
        summary["mlflow"] = _track(mlflow_uri or mlflow_cfg.uri, mlflow_cfg.experiment if mlflow_cfg else None,
                                   recipe, summary, store)
    store.write_run(run_id, {**summary, "recipe_path": str(Path(recipe_path).resolve()),
                             "resolved_recipe": recipe.canonical()})
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        console = _table_console()
        render_table(summary, console)
        if gate_rows:
            from qbuild.evaluate.gates import render_gates

            render_gates(gate_rows, console)
    if summary["counts"]["failed"]:
        sys.exit(EXIT_STEP_FAILED)
    if gate_rows and not summary["gates"]["passed"]:
        sys.exit(EXIT_GATE_FAILED)


def _track(uri, experiment, recipe, summary, store) -> dict:
    """Log to MLflow; a tracking failure is reported, never fatal to the stored artifacts."""
    from qbuild.report import render_html
    from qbuild.tracking import log_run

    import contextlib

    try:
        with contextlib.redirect_stdout(sys.stderr):  # mlflow prints run links; stdout is for --json
            run_id = log_run(uri, experiment, recipe, summary, store, render_html(summary))
        return {"uri": uri, "run_id": run_id}
    except QBuildError:
        raise
    except Exception as exc:  # server down, bad URI: the build itself succeeded
        click.echo(f"qbuild: warning: MLflow tracking to {uri} failed: {type(exc).__name__}: {exc}", err=True)
        return {"uri": uri, "error": str(exc)}


def _table_console():
    """Wide enough for the summary table even when stdout is a pipe or a CI log."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _set_refs(store, recipe, outcomes, variant_steps, tag):
    """recipe/variant:latest (+ tags) for every variant artifact this run has, built or cached."""
    by_key = {o.step.key: o for o in outcomes}
    # variants (incl. identical ones sharing a step), the imported base model, and target builds (variant.target)
    named = {**{o.step.variant: o.step for o in outcomes if o.step.variant}, **variant_steps}
    tags = ["latest"] + ([tag] if tag else []) + ([recipe.store.tag] if recipe.store.tag else [])
    for variant, step in named.items():
        o = by_key.get(step.key)
        if o and o.digest and o.status in ("built", "cached"):
            for t in tags:
                store.set_ref(recipe.name, variant, t, o.digest, step.key)


def _print_plan(planned, as_json):
    rows = [{"step": p.step.name, "kind": p.step.kind, "status": p.status, "key": p.step.key, "reason": p.reason,
             "digest": p.hit.digest if p.hit else None} for p in planned]
    if as_json:
        click.echo(json.dumps({"steps": rows, "to_build": sum(r["status"] == "miss" for r in rows)}, indent=2))
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="plan", title_justify="left")
    for col in ("step", "key", "status", "why"):
        table.add_column(col)
    style = {"hit": "cyan", "miss": "yellow", "source": "dim", "needs-gpu": "magenta", "unavailable": "magenta"}
    for r in rows:
        table.add_row(escape(r["step"]), r["key"][:12], f"[{style[r['status']]}]{r['status']}[/]",
                      r["reason"] if r["status"] == "miss" else ("" if r["status"] == "hit" else r["reason"]))
    console = _table_console()
    console.print(table)
    misses = sum(r["status"] == "miss" for r in rows)
    console.print(f"{misses} step(s) to build, {sum(r['status'] == 'hit' for r in rows)} cached")


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@STORE_OPTION
@JSON_OPTION
def plan(recipe, store_path, as_json):
    """Show every step of RECIPE with its key: hit (stored) or miss, and why it misses."""
    from qbuild.artifacts import open_store
    from qbuild.plan import make_plan

    try:
        r = _load(recipe)
        planned, _ = make_plan(r, Path(recipe).resolve().parent, open_store(store_path, r.store.path))
        _print_plan(planned, as_json)
    except QBuildError as exc:
        _fail(exc)


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
def validate(recipe):
    """Check RECIPE: schema, files, installed backends and model shapes, without building anything."""
    from qbuild.plan import build_steps

    try:
        r = _load(recipe)
        ctx, _ = build_steps(r, Path(recipe).resolve().parent)
    except QBuildError as exc:
        _fail(exc)
    click.echo(f"{recipe}: ok ({len(r.variants)} variant(s), {len(ctx.steps)} step(s))")


@cli.command()
def schema():
    """Print the recipe's JSON Schema (point your editor's YAML plugin at it)."""
    from qbuild.recipe import Recipe

    click.echo(json.dumps(Recipe.model_json_schema(), indent=2))


@cli.command(name="ls")
@STORE_OPTION
@JSON_OPTION
def ls_cmd(store_path, as_json):
    """List refs (recipe/variant:tag) in the store with their digests."""
    from qbuild.artifacts import open_store
    from qbuild.summary import human_size

    store = open_store(store_path)
    rows = []
    for ref in store.refs():
        try:
            m = store.manifest(ref["digest"])
        except (OSError, ValueError):
            m = {}
        rows.append({**ref, "kind": m.get("kind"), "format": m.get("format"),
                     "size_bytes": sum(f["size"] for f in m.get("files", [])), "created": m.get("created")})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"store {store.root}", title_justify="left")
    for col in ("ref", "digest", "format", "size", "updated"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["ref"], r["digest"][:12], r["format"] or "?", human_size(r["size_bytes"]), r["updated"])
    Console().print(table)
    if not rows:
        click.echo("(no refs yet: run `qbuild RECIPE` to build some)")


@cli.command()
@click.argument("name")
@STORE_OPTION
def show(name, store_path):
    """Show the manifest (provenance) of a ref, digest or step key."""
    from qbuild.artifacts import open_store

    store = open_store(store_path)
    try:
        digest = store.resolve(name)
    except QBuildError as exc:
        _fail(exc)
    manifest = store.manifest(digest)
    manifest["path"] = str(store.object_dir(digest))
    click.echo(json.dumps(manifest, indent=2, sort_keys=True))


@cli.command()
@click.argument("names", nargs=-1)
@STORE_OPTION
@JSON_OPTION
def verify(names, store_path, as_json):
    """Re-hash stored objects (all, or the named refs/digests) against their manifests."""
    from qbuild.artifacts import open_store

    store = open_store(store_path)
    try:
        digests = [store.resolve(n) for n in names] if names else None
    except QBuildError as exc:
        _fail(exc)
    rows = store.verify(digests)
    bad = [r for r in rows if not r["ok"]]
    if as_json:
        click.echo(json.dumps({"checked": len(rows), "damaged": bad}, indent=2))
    else:
        for r in bad:
            click.echo(f"DAMAGED {r['digest'][:12]} ({r.get('kind')}): " + "; ".join(r["problems"]))
        click.echo(f"{len(rows)} object(s) checked, {len(bad)} damaged")
    if bad:
        sys.exit(EXIT_STEP_FAILED)


@cli.command()
@click.argument("name", required=False)
@STORE_OPTION
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Write here (default: report-<recipe>.html).")
@click.option("--markdown", is_flag=True, help="Print Markdown (for CI logs) instead of writing HTML.")
def report(name, store_path, out_path, markdown):
    """Report of a run: NAME is a run id, a recipe (name or file), or empty for the latest run.

    The HTML page is self-contained (inline SVG plots of quality and speed vs size, Pareto front
    marked) and states the perplexity protocol and the hardware.
    """
    from qbuild.artifacts import open_store
    from qbuild.report import find_run, render_html, render_markdown

    try:
        run_record = find_run(open_store(store_path), name)
    except QBuildError as exc:
        _fail(exc)
    if markdown:
        click.echo(render_markdown(run_record), nl=False)
        return
    path = Path(out_path or f"report-{run_record['recipe']}.html")
    path.write_text(render_html(run_record), encoding="utf-8")
    click.echo(str(path))


from qbuild.build.pull import pull_command  # noqa: E402  (light: click + core only; TensorRT-LLM engine selection)

cli.add_command(pull_command)


def main():
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("qbuild: warning: %(message)s"))
    logger = logging.getLogger("qbuild")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        cli(standalone_mode=True)
    except QBuildError as exc:  # pragma: no cover - commands catch their own
        _fail(exc)


if __name__ == "__main__":
    main()
