"""The run summary: one row per variant (and the baseline), as JSON data and as a rich table."""

from __future__ import annotations

from qbuild.evaluate.tasks import add_deltas as add_task_deltas
from qbuild.evaluate.tasks import summary_rows as task_rows
from qbuild.executor import StepOutcome
from qbuild.plan import Artifact, Plan
from qbuild.step import Outcome

# "reference" is the baseline's one pass with KLD on (its perplexity + reference log-probs); a variant's
# "perplexity" step carries its KLD and top-1 agreement when KLD is on
EVAL_KINDS = {"perplexity": "ppl", "reference": "ppl", "throughput": "speed"}


def human_size(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _evaluations(outcomes: list[StepOutcome]) -> dict[tuple[str, str], StepOutcome]:
    """(artifact key, evaluation kind) → outcome: an evaluation belongs to the artifact it read."""
    return {(o.step.inputs["model"].key, o.step.kind): o for o in outcomes if o.step.kind in EVAL_KINDS}


def _load_checks(outcomes: list[StepOutcome]) -> dict[str, list[dict]]:
    """artifact key → its load checks, one per runtime: what each generated and how much of it the baseline's is."""
    checks: dict[str, list[dict]] = {}
    for o in outcomes:
        if o.step.kind != "load-check":
            continue
        info = o.record.get("info", {}) if o.record else {}
        m = o.metrics
        checks.setdefault(o.step.inputs["model"].key, []).append({
            "step": o.step.name, "runtime": o.step.params["runtime"], "status": o.status,
            "tokens": m.get("tokens"), "matches_baseline_tokens": m.get("matches_baseline_tokens"),
            "matches_baseline": m.get("matches_baseline"), "text": info.get("text"),
            "generated_token_ids": info.get("generated_token_ids"), "error": o.error})
    return checks


def load_label(checks: list[dict]) -> str | None:
    """The `load` column: "16/16" (leading tokens equal to the baseline's / generated), "ref" for the check the
    others are compared with, or the step's status; one entry per runtime when there are several."""
    def one(c: dict) -> str:
        if c["status"] not in (Outcome.BUILT, Outcome.CACHED):
            return str(c["status"])
        if c["matches_baseline_tokens"] is None:
            return "ref"
        return f"{c['matches_baseline_tokens']}/{c['tokens']}"

    if not checks:
        return None
    if len(checks) == 1:
        return one(checks[0])
    return ", ".join(f"{one(c)} {c['runtime']}" for c in checks)


def _row(art: Artifact, artifact: StepOutcome | None, evals: dict, not_evaluated: str | None,
         load_checks: list[dict] | None = None, tasks: list[dict] | None = None) -> dict:
    key = art.step.key
    ppl = evals.get((key, "perplexity")) or evals.get((key, "reference"))
    speed = evals.get((key, "throughput"))
    kld = ppl if ppl and "kld" in ppl.metrics else None
    own = artifact.metrics if artifact else {}   # a step may measure itself (a target that benchmarks its engine)

    def metric(evaluation: StepOutcome | None, name: str):
        return evaluation.metrics.get(name) if evaluation else own.get(name)

    return {
        "variant": art.label, "method": art.method, "detail": art.detail, "target": art.target,
        "format": art.step.format, "scheme": art.step.scheme or None,
        "status": artifact.status if artifact else "-",
        "size_bytes": artifact.size if artifact and artifact.record else None, "key": key,
        "digest": artifact.digest if artifact else None,
        "error": artifact.error if artifact else None, "log": artifact.log if artifact else None,
        "not_evaluated": not_evaluated,
        "ppl": metric(ppl, "ppl"), "kld": metric(kld, "kld"), "top1": metric(kld, "top1"),
        "decode_tok_s": metric(speed, "decode_tok_s"), "prefill_tok_s": metric(speed, "prefill_tok_s"),
        "ttft_ms": metric(speed, "ttft_ms"),
        "load": load_label(load_checks or []), "load_check": load_checks or None, "tasks": tasks or [],
    }


def summarize(plan: Plan, outcomes: list[StepOutcome]) -> dict:
    """One row per artifact of the plan (baseline, variants, target outputs), with its evaluations."""
    recipe = plan.recipe
    by_key = {o.step.key: o for o in outcomes}
    evals = _evaluations(outcomes)
    checks = _load_checks(outcomes)
    tasks = task_rows(outcomes)
    rows = [_row(a, by_key.get(a.step.key), evals, plan.not_evaluated.get(a.label), checks.get(a.step.key),
                 tasks.get(a.step.key)) for a in plan.artifacts]
    add_task_deltas(rows)
    base = rows[0] if rows and rows[0]["variant"] == "baseline" else None
    for r in rows:
        if base and r is not base:
            if r["ppl"] is not None and base["ppl"]:
                r["delta_ppl"] = r["ppl"] - base["ppl"]
                r["delta_ppl_pct"] = 100 * r["delta_ppl"] / base["ppl"]
            if r["decode_tok_s"] and base["decode_tok_s"]:
                r["throughput_ratio"] = r["decode_tok_s"] / base["decode_tok_s"]
    planned = {ps.step.key: ps for ps in plan.steps}
    # why each built step missed (the planner's reasons, as `qbuild plan` shows them): `qbuild diff` reads them
    steps = [{"name": o.step.name, "kind": o.step.kind, "status": o.status, "key": o.step.key, "digest": o.digest,
              "seconds": round(o.seconds, 2), "error": o.error, "log": o.log, "started": o.started, "ended": o.ended,
              "why": list(planned[o.step.key].reasons) if o.step.key in planned and o.status == Outcome.BUILT else [],
              "worker": o.worker}
             for o in outcomes]
    counts = {s: sum(1 for o in outcomes if o.status == s)
              for s in (Outcome.BUILT, Outcome.CACHED, Outcome.FAILED, Outcome.SKIPPED)}
    protocol = recipe.evaluation.perplexity.canonical() if recipe.evaluation.perplexity else None
    return {"recipe": recipe.name, "variants": rows, "steps": steps, "counts": counts, "protocol": protocol,
            "warnings": list(plan.warnings), "overlap": plan.overlap}


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render_table(summary: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    rows = summary["variants"]
    table = Table(title=f"qbuild · {summary['recipe']}", title_justify="left")
    cols = [("variant", "left"), ("method", "left"), ("size", "right"), ("key", "left"), ("status", "left")]
    optional = [("PPL", "ppl", ".3f"), ("ΔPPL", "delta_ppl", "+.3f"), ("KLD", "kld", ".4f"), ("top-1", "top1", ".1%"),
                ("tok/s", "decode_tok_s", ".1f"), ("load", "load", "")]
    shown = [o for o in optional if any(r.get(o[1]) is not None for r in rows)]
    for name, justify in cols:
        table.add_column(name, justify=justify, overflow="fold")
    for name, _, _ in shown:
        table.add_column(name, justify="right", overflow="fold")
    style = {"built": "green", "cached": "cyan", "failed": "bold red", "skipped": "yellow"}
    for r in rows:
        method = "-" if r["method"] == "-" else f"{r['method']} {r['detail']}".strip()
        table.add_row(escape(r["variant"]), escape(method), human_size(r["size_bytes"]), (r["key"] or "")[:12],
                      f"[{style[r['status']]}]{r['status']}[/]" if r["status"] in style else escape(str(r["status"])),
                      *(_fmt(r.get(field), spec) for _, field, spec in shown))
    console.print(table)
    _render_tasks(rows, console)
    c = summary["counts"]
    console.print(f"{c['built']} built, {c['cached']} cached, {c['failed']} failed, {c['skipped']} skipped")
    for r in rows:
        if r.get("not_evaluated"):
            console.print(f"[yellow]not evaluated: {escape(r['variant'])}[/] ({escape(str(r['format']))}): "
                          f"{escape(r['not_evaluated'])}")
    for s in summary["steps"]:
        if s["status"] == "skipped":
            console.print(f"[yellow]skipped {escape(s['name'])}[/]: {escape(str(s['error']))}")
        if s["status"] == "failed":
            console.print(f"[bold red]step {escape(s['name'])} failed[/]: {escape(str(s['error']))}  "
                          f"(log: {escape(str(s['log']))})")


def _render_tasks(rows: list[dict], console) -> None:
    """One table of lm-eval task accuracy: acc ± stderr per artifact, and the flips against the baseline."""
    if not any(r.get("tasks") for r in rows):
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="tasks (lm-eval)", title_justify="left")
    for name in ("variant", "task", "acc", "± stderr", "right→wrong", "wrong→right", "flipped"):
        table.add_column(name, justify="left" if name in ("variant", "task") else "right")
    for r in rows:
        for t in r.get("tasks") or []:
            f = t["flips"]
            table.add_row(escape(r["variant"]), escape(t["task"]), _fmt(t["acc"], ".3f"), _fmt(t["acc_stderr"], ".3f"),
                          *((str(f["right_to_wrong"]), str(f["wrong_to_right"]), f"{f['pct']:.1f} %") if f else
                            ("-", "-", "-" if r["variant"] != "baseline" else "ref")))
    console.print(table)
