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
    "max_acc_drop_pct": ("acc_drop_pct", "max", "task accuracy drop (points)"),
    "max_flips_pct": ("flips_pct", "max", "flipped answers %"),
}


# gate field → (summary field, sign: +1 when a larger value is worse, label); compared with the previous good run
REGRESSIONS = {
    "max_regression_ppl_pct": ("ppl", +1, "PPL regression %"),
    "max_regression_decode_pct": ("decode_tok_s", -1, "decode tok/s regression %"),
}


def regression_pct(now: float | None, before: float | None, sign: int) -> float | None:
    """How much worse `now` is than `before`, in % of `before` (negative: better); None when either is missing."""
    if now is None or not before:
        return None
    return sign * 100 * (now - before) / before + 0.0   # + 0.0: no "-0" for an unchanged value


def check_gates(gates, summary: dict, previous: dict | None = None) -> list[dict]:
    """One row per (gate, variant, bound); `passed` is False when the bound is missed or unmeasured.

    previous: the run record regression bounds compare with (the last successful run of the recipe). With
    none, or a variant that run did not have, a regression check passes with a note: there is nothing to
    regress from (the first night)."""
    rows = []
    before = {r["variant"]: r for r in (previous or {}).get("variants", [])}
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
            for field, (metric, sign, label) in REGRESSIONS.items():
                bound = getattr(gate, field)
                if bound is None:
                    continue
                row = {"gate": gi, "variant": r["variant"], "check": field, "metric": label, "value": None,
                       "bound": bound, "passed": True, "by": None}
                old = before.get(r["variant"])
                if previous is None or old is None or old.get(metric) is None:
                    row["note"] = (f"no previous successful run of {summary['recipe']}" if previous is None else
                                   f"not measured in run {previous.get('run_id')}")
                elif r.get(metric) is None:
                    row["passed"] = False  # it was measured before: losing the measurement is a regression too
                else:
                    value = regression_pct(r[metric], old[metric], sign)
                    row.update(value=value, passed=value <= bound, by=value - bound if value > bound else None,
                               previous=old[metric], compared_with=previous.get("run_id"))
                rows.append(row)
    return rows


def render_gates(rows: list[dict], console) -> None:
    from rich.table import Table

    failed = [r for r in rows if not r["passed"]]
    table = Table(title="quality gates: FAILED" if failed else "quality gates: passed", title_justify="left")
    for col in ("variant", "check", "value", "bound", "result"):
        table.add_column(col, overflow="fold")
    for r in rows:
        value = r.get("note") or ("not measured" if r["value"] is None else f"{r['value']:.4g}")
        result = "[green]pass[/]" if r["passed"] else (
            "[bold red]FAIL[/]" + (f" (off by {r['by']:.4g})" if r["by"] is not None else ""))
        table.add_row(r["variant"], r["check"], value, f"{r['bound']:.4g}", result)
    console.print(table)
