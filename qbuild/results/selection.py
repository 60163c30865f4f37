"""Which artifact to ship: the (variant, serving config) that meets every bound of `selection:`, best by its objective.

Candidates are the summary's rows (variants and target outputs; the baseline only with include_baseline) × their
serving configs. Each bound is checked where it applies: latency and throughput SLOs at their concurrency point of
that config, quality (KLD, ΔPPL %) as measured under that config (a quantized KV cache has its own pass; other configs
carry the artifact's own numbers), size per artifact, memory as the config's server peak RSS, and failed requests
always (`max_error_pct`, default 0, at the config's worst serving point, whatever other bounds are given: a server
that fails requests is not shipped for its speed). Every candidate that is not selected says why: each bound it
missed and by how much, or that the objective preferred another.

Serving figures measured in rounds carry 95 % intervals (qbuild.serving.confidence), and selection reads them: a
bound is met when the whole interval is on its side, missed when the whole interval is past it, and otherwise
within noise, which `on_uncertain` turns into a miss (reject, the default) or a pass (accept). The max_throughput
objective compares intervals too: when the best candidates' intervals overlap, they are tied, and the first
`tie_break` criterion (lower KLD, smaller memory, smaller file) that tells them apart decides; the verdict says so.
"""

from __future__ import annotations

from qbuild.serving.confidence import verdict

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


def _miss(name: str, value: float, bound: float, kind: str, unit: str, where: str = "",
          ci: list[float] | None = None) -> str | None:
    over = value - bound if kind == "max" else bound - value
    if over <= 0:
        return None
    op = ">" if kind == "max" else "<"
    pct = f", {100 * over / bound:.0f} %" if bound else ""
    u = f" {unit}" if unit else ""
    return (f"{name} {value:.4g}{_interval(ci)}{u}{where} {op} {bound:.4g} "
            f"({'+' if kind == 'max' else '-'}{over:.4g}{u}{pct})")


def _interval(ci: list[float] | None) -> str:
    return f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""


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
    best, tie = _best(sel, met)
    tied = {id(c) for c in tie["tied"]} if tie else set()
    rejected = []
    for c in candidates:
        if c is best:
            continue
        if c["misses"]:
            why = c["misses"]
        elif best is None or _measure(sel.objective, c) is None:
            why = [f"meets every bound, but objective {sel.objective} cannot rank it: "
                   f"{_unmeasured(sel.objective, c, at)}"]
        elif id(c) in tied:
            why = [f"meets every bound; tied with {best['variant']}@{best['config']} on objective {sel.objective} "
                   f"({_objective_text(sel.objective, best)} vs {_objective_text(sel.objective, c)}: the intervals "
                   f"overlap), {tie['broken_by_text']}"]
        else:
            why = [f"meets every bound; objective {sel.objective} prefers {best['variant']}@{best['config']} "
                   f"({_objective_text(sel.objective, best)} vs {_objective_text(sel.objective, c)})"]
        rejected.append({"variant": c["variant"], "config": c["config"], "why": "; ".join(why), "misses": c["misses"],
                         **{k: c[k] for k in CANDIDATE_DETAIL}})
    selected = None
    if best is not None:
        selected = {k: best[k] for k in ("variant", "config", "output_tok_s", "size_bytes", "kld", "command",
                                         "digest", "key", *CANDIDATE_DETAIL)}
    bounds = {f: {"value": b[0], "concurrency": b[1]} for f, *_ in SLOS if (b := _bound(sel, f, default_c))}
    bounds.update({f: getattr(sel, f) for f in ("max_kld", "max_delta_ppl_pct", "max_size_mb", "max_memory_mb")
                   if getattr(sel, f) is not None})
    bounds["max_error_pct"] = sel.max_error_pct   # always applied, so always stated
    out = {"objective": sel.objective, "concurrency": at, "bounds": bounds, "on_uncertain": sel.on_uncertain,
           "tie_break": list(sel.tie_break), "selected": selected, "rejected": rejected, "passed": selected is not None,
           "tie": {k: v for k, v in tie.items() if k != "tied"} if tie else None}
    if sel.target_rps is not None:
        out["target"] = servers_needed(sel.target_rps, met)
    if met and best is None:   # the bounds were met: what is missing is the objective's measure, say so
        out["reason"] = (f"{len(met)} candidate(s) meet every bound, but none has what objective {sel.objective} "
                         f"ranks by ({MEASURES[sel.objective]}); pick an objective they were measured for")
    return out


def _judge(sel, row: dict, config: str | None, default_c: int | None, at: int | None, serving) -> dict:
    points = [p for p in (row.get("serving") or []) if p["config"] == config]
    misses: list[str] = []
    uncertain: list[str] = []   # bounds within noise: misses under on_uncertain reject, notes under accept
    slo: dict[str, dict] = {}
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
        value = pt.get(pfield)
        if value is None:
            misses.append(f"{field}: not measured at concurrency {c}")
            continue
        ci = (pt.get("ci") or {}).get(pfield)
        slo[field] = {"value": value, "ci": ci, "bound": bound, "concurrency": c,
                      "verdict": verdict(value, ci, bound, kind)}
        if slo[field]["verdict"] == "missed":
            misses.append(_miss(field, value, bound, kind, unit, f" at concurrency {c}", ci))
        elif slo[field]["verdict"] == "uncertain":
            u = f" {unit}" if unit else ""
            uncertain.append(f"{field} {value:.4g}{_interval(ci)}{u} at concurrency {c} straddles {bound:.4g}: "
                             f"within noise")
            if sel.on_uncertain != "accept":   # measure_more: what is still in doubt after the added rounds
                misses.append(f"{uncertain[-1]} (on_uncertain: {sel.on_uncertain})")
    errors = worst_errors(points)
    if errors is not None and errors["pct"] > sel.max_error_pct:
        misses.append(f"{errors['errors']} of {errors['requests']} requests failed {errors['where']} "
                      f"({errors['pct']:.1f} % > max_error_pct {sel.max_error_pct:g} %)")
    quality = _quality(row, points)
    misses += _quality_misses(sel, row, points, quality, config)
    pt = point(at)
    memory = max((p.get("peak_rss_mb") or 0 for p in points), default=None) or None
    cap = next((c for c in row.get("capacity") or [] if c["config"] == config), None)
    return {"variant": row["variant"], "config": config, "misses": misses, "not_served": _not_served(row, points, serving),
            "server": next((p["server"] for p in points if p.get("server")), None),   # the engine serving it
            "capacity_rps": (cap or {}).get("capacity_rps"), "capacity_concurrency": (cap or {}).get("concurrency"),
            "capacity_complete": (cap or {}).get("complete"), "capacity_why": _no_capacity(cap),
            "uncertain": uncertain, "slo": slo, "memory_mb": memory,
            "error_pct": errors["pct"] if errors is not None else None,
            "output_tok_s_ci": ((pt or {}).get("ci") or {}).get("output_tok_s"),
            "rounds": (pt or {}).get("rounds"),
            "output_tok_s": pt.get("output_tok_s") if pt else None, "size_bytes": row.get("size_bytes"),
            "kld": quality.get("kld"), "command": (pt or {}).get("command") or next(
                (p.get("command") for p in points if p.get("command")), None),
            "digest": row.get("digest"), "key": row.get("key")}


def worst_errors(points: list[dict]) -> dict | None:
    """The serving point (concurrency, request rate or trace) with the largest share of failed requests: {pct,
    errors, requests, where}; None when no point counted requests (not served, its step failed)."""
    worst = None
    for p in points:
        if not p.get("requests"):
            continue
        pct = 100 * (p.get("errors") or 0) / p["requests"]
        if worst is None or pct > worst["pct"]:
            where = (f"at concurrency {p['concurrency']}" if p.get("concurrency") is not None
                     else f"at {p['request_rate']:g} requests/s" if p.get("request_rate") is not None
                     else f"on trace {p.get('trace')}")
            worst = {"pct": round(pct, 2), "errors": p.get("errors") or 0, "requests": p["requests"], "where": where}
    return worst


def _quality_misses(sel, row: dict, points: list[dict], quality: dict, config: str | None) -> list[str]:
    """The quality, size and memory bounds a candidate misses (or was not measured for)."""
    misses: list[str] = []
    under = f" under config {config}" if config is not None else ""
    for field, value, bound, unit, where in (
            ("max_kld", quality.get("kld"), sel.max_kld, "", under),
            ("max_delta_ppl_pct", quality.get("delta_ppl_pct"), sel.max_delta_ppl_pct, "%", under),
            ("max_size_mb", row["size_bytes"] / 2**20 if row.get("size_bytes") else None, sel.max_size_mb, "MiB", ""),
            ("max_memory_mb", max((p.get("peak_rss_mb") or 0 for p in points), default=None) or None,
             sel.max_memory_mb, "MiB", under)):   # the same as the candidate's memory_mb below
        if bound is None:
            continue
        if value is None:
            misses.append(f"{field.removeprefix('max_')}{where}: not measured")
            continue
        m = _miss(field.removeprefix("max_"), value, bound, "max", unit, where)
        if m:
            misses.append(m)
    return misses


def _quality(row: dict, points: list[dict]) -> dict:
    """KLD and ΔPPL % of the artifact under this config: its serving points carry them (the summary puts them there:
    a quantized KV cache's own pass), else the artifact's own."""
    pt = next((p for p in points if "kld" in p), None)
    source = pt if pt is not None else row
    if (row["variant"] == "baseline" and source.get("kld") is None
            and not any(p.get("kv_cache_dtype") for p in points)):   # the reference itself, its cache unquantized
        return {"kld": 0.0, "delta_ppl_pct": 0.0}
    return {"kld": source.get("kld"), "delta_ppl_pct": source.get("delta_ppl_pct")}


MEASURES = {"max_throughput": "output tok/s under load", "min_size": "the artifact's size",
            "min_kld": "KLD against the baseline", "max_capacity": "requests/s within the capacity SLOs"}


def _measure(objective: str, c: dict) -> float | None:
    """What OBJECTIVE ranks candidate c by, None where it was not measured."""
    if objective == "max_throughput":
        return c["output_tok_s"]
    if objective == "max_capacity":
        return c["capacity_rps"]
    if objective == "min_size":
        return c["size_bytes"] or None
    return c["kld"]


# what every candidate of the verdict carries besides its name: each SLO's value, interval and verdict, the bounds
# within noise, its memory, and the objective's interval and rounds at the selection's concurrency
CANDIDATE_DETAIL = ("server", "slo", "uncertain", "memory_mb", "error_pct", "output_tok_s_ci", "rounds", "capacity_rps",
                    "capacity_concurrency", "capacity_complete")
TIE_BREAK = {"kld": ("kld", "lower KLD", "KLD {:.4g}"), "memory": ("memory_mb", "smaller memory", "{:.0f} MiB"),
             "size": ("size_bytes", "smaller file", "{:,} bytes")}


def _best(sel, met: list[dict]) -> tuple[dict | None, dict | None]:
    """The best candidate by the objective, and the tie it was chosen from (None when it won outright): under
    max_throughput, every ranked candidate whose output tok/s interval overlaps the leader's, broken by
    `sel.tie_break` (then by the objective's value and the names, so the outcome never depends on order)."""
    objective = sel.objective
    ranked = [c for c in met if _measure(objective, c) is not None]
    if objective not in ("max_throughput", "max_capacity"):
        return min(ranked, key=lambda c: _measure(objective, c), default=None), None
    leader = max(ranked, key=lambda c: (_measure(objective, c), _name(c)), default=None)
    if leader is None:
        return None, None
    if objective == "max_throughput":
        tied = [c for c in ranked if c is not leader and _overlap(_span(c), _span(leader))]
    else:   # capacities are grid rates 4.4 % apart: only the same rate is a tie
        tied = [c for c in ranked if c is not leader and c["capacity_rps"] == leader["capacity_rps"]]
    if not tied:
        return leader, None

    def order(c: dict) -> tuple:
        values = tuple(float("inf") if c[TIE_BREAK[k][0]] is None else c[TIE_BREAK[k][0]] for k in sel.tie_break)
        return (*values, -_measure(objective, c), _name(c))

    group = sorted([leader, *tied], key=order)
    winner, runner_up = group[0], group[1]
    decided = next((k for i, k in enumerate(sel.tie_break) if order(winner)[i] != order(runner_up)[i]), None)
    if decided is None:
        text = (f"tie_break {'/'.join(sel.tie_break)} cannot tell them apart: the higher "
                f"{'output tok/s' if objective == 'max_throughput' else 'capacity'} decides")
    else:
        field, words, fmt = TIE_BREAK[decided]
        text = (f"broken by {words} ({_fmt_or_unknown(winner[field], fmt)} vs "
                f"{_fmt_or_unknown(runner_up[field], fmt)})")
    return winner, {"candidates": [{"variant": c["variant"], "config": c["config"], "output_tok_s": c["output_tok_s"],
                                    "ci": c["output_tok_s_ci"],
                                    **({"capacity_rps": c["capacity_rps"]} if objective == "max_capacity" else {})}
                                   for c in group],
                    "broken_by": decided or ("output_tok_s" if objective == "max_throughput" else "capacity_rps"),
                    "broken_by_text": text,
                    "tied": [c for c in group if c is not winner]}


def _name(c: dict) -> tuple[str, str]:
    return c["variant"], str(c["config"])


def _span(c: dict) -> tuple[float, float]:
    ci = c["output_tok_s_ci"]
    return (ci[0], ci[1]) if ci else (c["output_tok_s"], c["output_tok_s"])


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _fmt_or_unknown(v, fmt: str) -> str:
    return "unknown" if v is None else fmt.format(v)


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
    from qbuild.planning.serving import wanted

    if not wanted(serving, row["variant"]):
        return "evaluation.serving.variants leaves it out"
    return "not served: no server loads its format (see the plan's warnings)"


def _unmeasured(objective: str, c: dict, at: int | None) -> str:
    if objective == "max_throughput":
        return c["not_served"] or f"output tok/s not measured at concurrency {at}"
    if objective == "max_capacity":
        return c["not_served"] or c["capacity_why"] or "its capacity is unknown"
    if objective == "min_size":
        return "its size is unknown"
    return "its KLD was not measured (evaluation.kld)"


def _objective_text(objective: str, c: dict) -> str:
    if objective == "max_throughput":
        return (f"{c['output_tok_s']:.4g}{_interval(c['output_tok_s_ci'])} tok/s" if c["output_tok_s"] is not None
                else "not measured")
    if objective == "max_capacity":
        return f"{c['capacity_rps']:.4g} requests/s" if c["capacity_rps"] is not None else "no capacity"
    if objective == "min_size":
        return f"{c['size_bytes'] / 2**20:.1f} MiB" if c["size_bytes"] else "size unknown"
    return f"KLD {c['kld']:.4g}" if c["kld"] is not None else "KLD not measured"


def servers_needed(target_rps: float, met: list[dict]) -> dict:
    """For a traffic of `target_rps` requests/s: how many servers each candidate meeting every bound needs at its
    capacity (ceil(target / capacity)), and the cheapest: fewest servers, then the least memory in all (servers ×
    peak RSS), then the names."""
    import math

    rows = []
    for c in met:
        cap = c["capacity_rps"]
        servers = math.ceil(target_rps / cap - 1e-9) if cap else None
        memory = c["memory_mb"] * servers if servers and c["memory_mb"] else None
        rows.append({"variant": c["variant"], "config": c["config"], "capacity_rps": cap, "servers": servers,
                     "memory_mb": memory})
    costed = [r for r in rows if r["servers"] is not None]
    cheapest = min(costed, key=lambda r: (r["servers"], r["memory_mb"] if r["memory_mb"] is not None else float("inf"),
                                          r["variant"], str(r["config"])), default=None)
    return {"rps": target_rps, "candidates": rows, "cheapest": cheapest}


def _no_capacity(cap: dict | None) -> str | None:
    """Why a candidate has no capacity (None when it has one)."""
    if cap is None:
        return "no capacity search ran for it"
    if cap.get("capacity_rps") is not None:
        return None
    if cap.get("status") not in ("built", "cached"):
        return f"its capacity step {cap.get('step') or ''} was {cap.get('status')}" + (
            f" ({cap['error']})" if cap.get("error") else "")
    missed = next((p for p in cap.get("probes") or [] if not p.get("meets")), None)
    return "no rate met the capacity SLOs" + (
        f" (at {missed['rate_rps']:.4g} requests/s: {'; '.join(missed['misses'])})" if missed else "")
