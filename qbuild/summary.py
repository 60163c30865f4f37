"""The run summary: one row per variant (and the baseline), as JSON data and as a rich table."""

from __future__ import annotations

from qbuild.executor import StepOutcome


def human_size(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def summarize(recipe, outcomes: list[StepOutcome], variant_steps: dict) -> dict:
    by_name = {o.step.name: o for o in outcomes}
    by_key = {o.step.key: o for o in outcomes}
    # an evaluation belongs to the artifact it read: its "model" input
    ppl_by_input = {o.step.inputs["model"].key: o for o in outcomes if o.step.kind == "perplexity"}
    model = by_name.get("model")
    ppl_of = {name: ppl_by_input[s.key] for name, s in variant_steps.items() if s.key in ppl_by_input}
    if model and model.step.key in ppl_by_input:
        ppl_of["baseline"] = ppl_by_input[model.step.key]
    baseline_ppl = ppl_of["baseline"].metrics.get("ppl") if "baseline" in ppl_of else None
    rows = []
    if "baseline" in ppl_of:
        rows.append({"variant": "baseline", "method": "-", "format": "hf", "status": model.status if model else "-",
                     "size_bytes": model.size if model and model.record else None,
                     "key": model.step.key if model else None, "digest": model.digest if model else None,
                     "ppl": baseline_ppl, "ppl_status": ppl_of["baseline"].status})
    for v in recipe.variants:
        o = by_key.get(variant_steps[v.name].key)
        ev = ppl_of.get(v.name)
        ppl = ev.metrics.get("ppl") if ev else None
        rows.append({
            "variant": v.name, "method": v.method, "detail": v.describe(), "format": o.step.format if o else None,
            "status": o.status if o else "-", "size_bytes": o.size if o else None, "key": o.step.key if o else None,
            "digest": o.digest if o else None, "error": o.error if o else None, "log": o.log if o else None,
            "ppl": ppl, "ppl_status": ev.status if ev else None,
            "delta_ppl": (ppl - baseline_ppl) if ppl is not None and baseline_ppl else None,
        })
    steps = [{"name": o.step.name, "kind": o.step.kind, "status": o.status, "key": o.step.key, "digest": o.digest,
              "seconds": round(o.seconds, 2), "error": o.error, "log": o.log} for o in outcomes]
    counts = {s: sum(1 for o in outcomes if o.status == s) for s in ("built", "cached", "failed", "skipped")}
    return {"recipe": recipe.name, "variants": rows, "steps": steps, "counts": counts}


def render_table(summary: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"qbuild · {summary['recipe']}", title_justify="left")
    for col in ("variant", "method", "size", "key", "status", "PPL", "ΔPPL"):
        table.add_column(col, justify="right" if col in ("size", "PPL", "ΔPPL") else "left")
    style = {"built": "green", "cached": "cyan", "failed": "bold red", "skipped": "yellow"}
    for r in summary["variants"]:
        status = r["status"]
        method = r["method"] if r["method"] == "-" else f"{r['method']} {r.get('detail', '')}".strip()
        table.add_row(
            escape(r["variant"]), escape(method), human_size(r["size_bytes"]), (r["key"] or "")[:12],
            f"[{style.get(status, '')}]{status}[/]",
            f"{r['ppl']:.3f}" if r["ppl"] is not None else "-",
            f"{r['delta_ppl']:+.3f}" if r.get("delta_ppl") is not None else "-",
        )
    console.print(table)
    c = summary["counts"]
    console.print(f"{c['built']} built, {c['cached']} cached, {c['failed']} failed, {c['skipped']} skipped")
    for s in summary["steps"]:
        if s["status"] == "failed":
            console.print(f"[bold red]step {escape(s['name'])} failed[/]: {escape(str(s['error']))}  (log: {escape(str(s['log']))})")
