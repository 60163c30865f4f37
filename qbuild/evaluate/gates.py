"""Quality gates: bounds a nightly job enforces on the run summary (exit code 3 when one fails)."""

from __future__ import annotations

# gate field → (summary field, comparison, label)
CHECKS = {
    "max_delta_ppl": ("delta_ppl", "max", "ΔPPL"),
    "max_delta_ppl_pct": ("delta_ppl_pct", "max", "ΔPPL %"),
    "max_kld": ("kld", "max", "KLD"),
    "min_top1": ("top1", "min", "top-1 agreement"),
    "min_throughput_ratio": ("throughput_ratio", "min", "throughput ratio"),
    "max_size_mb": ("size_mb", "max", "size MB"),
}


def check_gates(gates, summary: dict) -> list[dict]:
    """One row per (gate, variant, bound); `passed` is False when the bound is missed or unmeasured."""
    rows = []
    variants = [r for r in summary["variants"] if r["variant"] != "baseline"]
    for gi, gate in enumerate(gates):
        for r in variants:
            if gate.variants != "all" and r["variant"] not in gate.variants:
                continue
            if gate.variants == "all" and r.get("target"):  # engines are gated only when named
                continue
            values = {**r, "size_mb": r["size_bytes"] / 2**20 if r.get("size_bytes") else None}
            for field, (metric, kind, label) in CHECKS.items():
                bound = getattr(gate, field)
                if bound is None:
                    continue
                value = values.get(metric)
                if value is None:
                    passed, by = False, None
                elif kind == "max":
                    passed, by = value <= bound, value - bound
                else:
                    passed, by = value >= bound, bound - value
                rows.append({"gate": gi, "variant": r["variant"], "check": field, "metric": label,
                             "value": value, "bound": bound, "passed": passed, "by": by if not passed else None})
    return rows


def render_gates(rows: list[dict], console) -> None:
    from rich.table import Table

    failed = [r for r in rows if not r["passed"]]
    table = Table(title="quality gates: FAILED" if failed else "quality gates: passed", title_justify="left")
    for col in ("variant", "check", "value", "bound", "result"):
        table.add_column(col, overflow="fold")
    for r in rows:
        value = "not measured" if r["value"] is None else f"{r['value']:.4g}"
        result = "[green]pass[/]" if r["passed"] else (
            "[bold red]FAIL[/]" + (f" (off by {r['by']:.4g})" if r["by"] is not None else ""))
        table.add_row(r["variant"], r["check"], value, f"{r['bound']:.4g}", result)
    console.print(table)
