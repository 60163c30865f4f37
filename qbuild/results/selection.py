"""Which artifact to ship: the (variant, serving config) that meets every bound of `selection:`, best by its objective.

Candidates are the summary's rows (variants and target outputs; the baseline only with include_baseline) × their
serving configs. Each bound is checked where it applies: latency and throughput SLOs at their concurrency point of
that config, quality (KLD, ΔPPL %) as measured under that config (a quantized KV cache has its own pass; other configs
carry the artifact's own numbers), size per artifact, memory as the config's server peak RSS. Every candidate
that is not selected says why: each bound it missed and by how much, or that the objective preferred another.
"""

from __future__ import annotations

SLOS = (  # recipe field, point field, what a miss is, unit
    ("ttft_p99_ms", "ttft_ms_p99", "max", "ms"),
    ("tpot_p50_ms", "tpot_ms_p50", "max", "ms"),
    ("min_output_tok_s", "output_tok_s", "min", "tok/s"),
)


def _bound(sel, field: str, default_concurrency: int | None) -> tuple[float, int | None] | None:
    b = getattr(sel, field)
    if b is None:
        return None
    if isinstance(b, (int, float)):
        return float(b), sel.concurrency or default_concurrency
    return b.value, b.concurrency


def _miss(name: str, value: float, bound: float, kind: str, unit: str, where: str = "") -> str | None:
    over = value - bound if kind == "max" else bound - value
    if over <= 0:
        return None
    op = ">" if kind == "max" else "<"
    pct = f", {100 * over / bound:.0f} %" if bound else ""
    u = f" {unit}" if unit else ""
    return f"{name} {value:.4g}{u}{where} {op} {bound:.4g} ({'+' if kind == 'max' else '-'}{over:.4g}{u}{pct})"


def _configs(row: dict) -> list[str | None]:
    serving = row.get("serving")
    if serving is None:
        return [None]
    return list(dict.fromkeys(p["config"] for p in serving)) or [None]


def select(sel, rows: list[dict], serving=None) -> dict:
    default_c = max(serving.concurrency) if serving else None
    at = sel.concurrency or default_c
    candidates = []
    for row in rows:
        if row["variant"] == "baseline" and not sel.include_baseline:
            continue
        for config in _configs(row):
            candidates.append(_judge(sel, row, config, default_c, at, serving))
    met = [c for c in candidates if not c["misses"]]
    best = _best(sel.objective, met)
    rejected = []
    for c in candidates:
        if c is best:
            continue
        if c["misses"]:
            why = c["misses"]
        elif best is None or _measure(sel.objective, c) is None:
            why = [f"meets every bound, but objective {sel.objective} cannot rank it: "
                   f"{_unmeasured(sel.objective, c, at)}"]
        else:
            why = [f"meets every bound; objective {sel.objective} prefers {best['variant']}@{best['config']} "
                   f"({_objective_text(sel.objective, best)} vs {_objective_text(sel.objective, c)})"]
        rejected.append({"variant": c["variant"], "config": c["config"], "why": "; ".join(why), "misses": c["misses"]})
    selected = None
    if best is not None:
        selected = {k: best[k] for k in ("variant", "config", "output_tok_s", "size_bytes", "kld", "command",
                                         "digest", "key")}
    bounds = {f: {"value": b[0], "concurrency": b[1]} for f, *_ in SLOS if (b := _bound(sel, f, default_c))}
    bounds.update({f: getattr(sel, f) for f in ("max_kld", "max_delta_ppl_pct", "max_size_mb", "max_memory_mb")
                   if getattr(sel, f) is not None})
    out = {"objective": sel.objective, "concurrency": at, "bounds": bounds, "selected": selected,
           "rejected": rejected, "passed": selected is not None}
    if met and best is None:   # the bounds were met: what is missing is the objective's measure, say so
        out["reason"] = (f"{len(met)} candidate(s) meet every bound, but none has what objective {sel.objective} "
                         f"ranks by ({MEASURES[sel.objective]}); pick an objective they were measured for")
    return out


def _judge(sel, row: dict, config: str | None, default_c: int | None, at: int | None, serving) -> dict:
    points = [p for p in (row.get("serving") or []) if p["config"] == config]
    misses: list[str] = []
    if row.get("status") not in ("built", "cached"):
        misses.append(f"not built ({row.get('status')})")

    def point(c):
        return next((p for p in points if p.get("concurrency") == c and p.get("ttft_ms_p50") is not None), None)

    for field, pfield, kind, unit in SLOS:
        b = _bound(sel, field, default_c)
        if b is None:
            continue
        bound, c = b
        pt = point(c)
        if pt is None:
            misses.append(f"{field}: not measured at concurrency {c}")
            continue
        if pt.get("errors"):
            misses.append(f"{pt['errors']} of {pt['requests']} requests failed at concurrency {c}")
        value = pt.get(pfield)
        if value is None:
            misses.append(f"{field}: not measured at concurrency {c}")
            continue
        m = _miss(field, value, bound, kind, unit, f" at concurrency {c}")
        if m:
            misses.append(m)
    quality = _quality(row, points)
    under = f" under config {config}" if config is not None else ""
    for field, value, bound, unit, where in (
            ("max_kld", quality.get("kld"), sel.max_kld, "", under),
            ("max_delta_ppl_pct", quality.get("delta_ppl_pct"), sel.max_delta_ppl_pct, "%", under),
            ("max_size_mb", row["size_bytes"] / 2**20 if row.get("size_bytes") else None, sel.max_size_mb, "MiB", ""),
            ("max_memory_mb", max((p.get("peak_rss_mb") or 0 for p in points), default=None) or None,
             sel.max_memory_mb, "MiB", under)):
        if bound is None:
            continue
        if value is None:
            misses.append(f"{field.removeprefix('max_')}{where}: not measured")
            continue
        m = _miss(field.removeprefix("max_"), value, bound, "max", unit, where)
        if m:
            misses.append(m)
    pt = point(at)
    return {"variant": row["variant"], "config": config, "misses": misses, "not_served": _not_served(row, points, serving),
            "output_tok_s": pt.get("output_tok_s") if pt else None, "size_bytes": row.get("size_bytes"),
            "kld": quality.get("kld"), "command": (pt or {}).get("command") or next(
                (p.get("command") for p in points if p.get("command")), None),
            "digest": row.get("digest"), "key": row.get("key")}


def _quality(row: dict, points: list[dict]) -> dict:
    """KLD and ΔPPL % of the artifact under this config: its serving points carry them (the summary puts them there:
    a quantized KV cache's own pass), else the artifact's own."""
    pt = next((p for p in points if "kld" in p), None)
    source = pt if pt is not None else row
    return {"kld": source.get("kld"), "delta_ppl_pct": source.get("delta_ppl_pct")}


MEASURES = {"max_throughput": "output tok/s under load", "min_size": "the artifact's size",
            "min_kld": "KLD against the baseline"}


def _measure(objective: str, c: dict) -> float | None:
    """What OBJECTIVE ranks candidate c by, None where it was not measured."""
    if objective == "max_throughput":
        return c["output_tok_s"]
    if objective == "min_size":
        return c["size_bytes"] or None
    return c["kld"]


def _best(objective: str, met: list[dict]) -> dict | None:
    ranked = [c for c in met if _measure(objective, c) is not None]
    if objective == "max_throughput":
        return max(ranked, key=lambda c: c["output_tok_s"], default=None)
    return min(ranked, key=lambda c: _measure(objective, c), default=None)


def _not_served(row: dict, points: list[dict], serving) -> str | None:
    """Why the row has no serving measurement under this config, or None when it has one."""
    if any(p.get("concurrency") is not None or p.get("request_rate") is not None for p in points):
        return None
    failed = next((p for p in points if p.get("status")), None)
    if failed is not None:
        return f"its serving step {failed.get('step') or ''} was {failed['status']}" + (
            f" ({failed['error']})" if failed.get("error") else "")
    if serving is None:
        return "the recipe has no evaluation.serving"
    from qbuild.serving.plan import wanted

    if not wanted(serving, row["variant"]):
        return "evaluation.serving.variants leaves it out"
    return "not served: no server loads its format (see the plan's warnings)"


def _unmeasured(objective: str, c: dict, at: int | None) -> str:
    if objective == "max_throughput":
        return c["not_served"] or f"output tok/s not measured at concurrency {at}"
    if objective == "min_size":
        return "its size is unknown"
    return "its KLD was not measured (evaluation.kld)"


def _objective_text(objective: str, c: dict) -> str:
    if objective == "max_throughput":
        return f"{c['output_tok_s']:.4g} tok/s" if c["output_tok_s"] is not None else "not measured"
    if objective == "min_size":
        return f"{c['size_bytes'] / 2**20:.1f} MiB" if c["size_bytes"] else "size unknown"
    return f"KLD {c['kld']:.4g}" if c["kld"] is not None else "KLD not measured"
