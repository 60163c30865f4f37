"""`qbuild report`: a self-contained HTML page (and Markdown for CI logs) from a run record.

Plots are inline SVG (no JS, no network): quality vs size and speed vs size, Pareto front marked.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from qbuild.base.bootstrap import half_width
from qbuild.base.errors import UserError
from qbuild.base.units import human_size


def _well_formed(record: dict | None) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("recipe"), str)
            and isinstance(record.get("variants", []), list) and isinstance(record.get("steps", []), list)
            and all(isinstance(v, dict) for v in record.get("variants", []) + record.get("steps", [])))


def find_run(store, name: str | None) -> dict:
    """A run id, a recipe name (its latest run), a recipe file, or None (the store's latest run).

    NAME never becomes a path by itself: a run id or recipe name must follow the name grammar (qbuild/base/names.py).
    Unreadable or damaged run records are skipped (or, named by id, refused in one line)."""
    from qbuild.artifacts.store import read_json
    from qbuild.base.names import valid_name

    runs = [r for r in store.runs() if _well_formed(r)]   # oldest first, by when they finished
    if not runs:
        raise UserError(f"no runs in store {store.root}; run `qbuild RECIPE` first")
    if name:
        if valid_name(name):
            exact = store.root / "runs" / f"{name}.json"
            if exact.is_file() and not exact.is_symlink():
                record = read_json(exact)
                if not _well_formed(record):
                    raise UserError(f"run record {exact} is unreadable or damaged")
                return record
        if Path(name).is_file() and Path(name).suffix in (".yaml", ".yml"):  # a recipe path: use its name
            from qbuild.planning.recipe import load_recipe

            name = load_recipe(name).name
        elif not valid_name(name):
            raise UserError(f"invalid run id or recipe name {name[:80]!r}: use letters, digits, '.', '_' or '-'")
        matching = [r for r in runs if r.get("recipe") == name]
        if not matching:
            raise UserError(f"no run of recipe {name!r} (or run id) in store {store.root}")
        runs = matching
    return runs[-1]


def pareto(points: list[tuple[float, float, str]], lower_y_better: bool) -> set[str]:
    """Names on the front: no other point is at most as large and at least as good."""
    front = set()
    for x, y, name in points:
        dominated = any(
            (x2 <= x and (y2 <= y if lower_y_better else y2 >= y)) and (x2, y2) != (x, y) for x2, y2, _ in points
        )
        if not dominated:
            front.add(name)
    return front


def svg_scatter(points: list[tuple[float, float, str]], xlabel: str, ylabel: str, lower_y_better: bool) -> str:
    if not points:
        return "<p><em>not measured</em></p>"
    w, h, m = 520, 320, 56
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs) * 0.9, max(xs) * 1.05
    y0, y1 = min(ys) - 0.05 * (max(ys) - min(ys) or 1), max(ys) + 0.1 * (max(ys) - min(ys) or 1)

    def sx(x):
        return m + (x - x0) / (x1 - x0 or 1) * (w - 2 * m)

    def sy(y):
        return h - m - (y - y0) / (y1 - y0 or 1) * (h - 2 * m)

    front = pareto(points, lower_y_better)
    fp = sorted((p for p in points if p[2] in front), key=lambda p: p[0])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
             f'<rect width="{w}" height="{h}" fill="white" stroke="#ccc"/>',
             f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="#333"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="#333"/>',
             f'<text x="{w / 2}" y="{h - 14}" text-anchor="middle" font-size="13">{html.escape(xlabel)}</text>',
             f'<text x="16" y="{h / 2}" text-anchor="middle" font-size="13" transform="rotate(-90 16 {h / 2})">'
             f'{html.escape(ylabel)}</text>']
    for v in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text x="{m - 6}" y="{sy(v) + 4}" text-anchor="end" font-size="11">{v:.3g}</text>')
    for v in (x0, (x0 + x1) / 2, x1):
        parts.append(f'<text x="{sx(v)}" y="{h - m + 16}" text-anchor="middle" font-size="11">{v:.3g}</text>')
    if len(fp) > 1:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in fp)
        parts.append(f'<polyline points="{path}" fill="none" stroke="#d62728" stroke-dasharray="5,3"/>')
    for x, y, name in points:
        color = "#d62728" if name in front else "#1f77b4"
        parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{color}"><title>{html.escape(name)}</title></circle>')
        parts.append(f'<text x="{sx(x) + 7:.1f}" y="{sy(y) - 7:.1f}" font-size="11">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
HISTORY_METRICS = [("ppl", "perplexity", "{:.4g}"), ("kld", "KLD", "{:.4g}"), ("decode_tok_s", "decode tokens/s", "{:.4g}"),
                   ("size_bytes", "size (MiB)", "{:.4g}")]


def history_series(runs: list[dict], field: str) -> dict[str, list[tuple[int, float, str]]]:
    """variant → [(index of the run, value, run id)] over `runs` (oldest first), where the variant was measured."""
    series: dict[str, list[tuple[int, float, str]]] = {}
    for i, run in enumerate(runs):
        for r in run.get("variants", []):
            v = r.get(field)
            if v is None:
                continue
            series.setdefault(r["variant"], []).append((i, v / 2**20 if field == "size_bytes" else v, run.get("run_id", "?")))
    return series


def left_margin(ticks: list[str]) -> int:
    """Room left of the y axis for the rotated axis label (~22 px) and the widest tick label (~6.5 px a character at
    font-size 11), so neither overlaps the other (long values such as KLD 0.004567 need more than the default)."""
    return max(56, 30 + round(6.5 * max((len(t) for t in ticks), default=0)))


def svg_lines(series: dict[str, list[tuple[int, float, str]]], n_runs: int, ylabel: str, field: str) -> str:
    """One polyline per variant over the runs (x: run, oldest left), each point titled with its run and value."""
    if not series:
        return "<p><em>not measured</em></p>"
    w, h = 520, 300
    ys = [y for pts in series.values() for _, y, _ in pts]
    y0, y1 = min(ys), max(ys)
    pad = 0.1 * (y1 - y0) if y1 > y0 else (abs(y0) * 0.05 or 1)
    y0, y1 = y0 - pad, y1 + pad
    ticks = [f"{v:.4g}" for v in (y0, (y0 + y1) / 2, y1)]
    m = left_margin(ticks)
    w += m - 56   # the plot area keeps its width

    def sx(i):
        return m + (i / (n_runs - 1) if n_runs > 1 else 0.5) * (w - m - 56 - 90)

    def sy(y):
        return h - 56 - (y - y0) / (y1 - y0) * (h - 2 * 56)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" data-metric="{field}">',
             f'<rect width="{w}" height="{h}" fill="white" stroke="#ccc"/>',
             f'<line x1="{m}" y1="{h - 56}" x2="{w - 56 - 90}" y2="{h - 56}" stroke="#333"/>',
             f'<line x1="{m}" y1="56" x2="{m}" y2="{h - 56}" stroke="#333"/>',
             f'<text x="{(w - 90 + m - 56) / 2}" y="{h - 14}" text-anchor="middle" font-size="13">run (oldest left)</text>',
             f'<text x="16" y="{h / 2}" text-anchor="middle" font-size="13" transform="rotate(-90 16 {h / 2})">'
             f'{html.escape(ylabel)}</text>']
    for v, tick in zip((y0, (y0 + y1) / 2, y1), ticks, strict=True):
        parts.append(f'<text x="{m - 6}" y="{sy(v) + 4}" text-anchor="end" font-size="11">{tick}</text>')
    for k, (variant, pts) in enumerate(sorted(series.items())):
        color = PALETTE[k % len(PALETTE)]
        name = html.escape(variant)
        parts.append(f'<g class="series" data-variant="{name}" stroke="{color}" fill="{color}">')
        if len(pts) > 1:
            path = " ".join(f"{sx(i):.1f},{sy(y):.1f}" for i, y, _ in pts)
            parts.append(f'<polyline points="{path}" fill="none"/>')
        for i, y, run_id in pts:
            parts.append(f'<circle cx="{sx(i):.1f}" cy="{sy(y):.1f}" r="4" data-run="{html.escape(run_id)}" '
                         f'data-value="{y!r}"><title>{name} · {html.escape(run_id)}: {y:.6g}</title></circle>')
        parts.append(f'<text x="{w - 56 - 80}" y="{56 + 14 * k}" font-size="11" stroke="none">{name}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _history_html(history: list[dict] | None) -> str:
    """The history view: each variant's metrics over the recipe's runs (one plot per metric, one line per variant)."""
    if not history or len(history) < 2:
        return ""
    figures = []
    for field, label, _ in HISTORY_METRICS:
        series = history_series(history, field)
        if series:
            figures.append(f"<figure><figcaption>{html.escape(label)} over runs</figcaption>"
                           f"{svg_lines(series, len(history), label, field)}</figure>")
    runs = ", ".join(f"<code>{html.escape(r.get('run_id', '?'))}</code>" for r in history)
    return (f'<section id="history"><h2>History: {len(history)} runs</h2><p>{runs}</p>'
            f'<div class="plots">{"".join(figures)}</div></section>')


SERVING_PLOTS = (("ttft_ms_p99", "TTFT p99 (ms)", "ttft_p99_ms"), ("tpot_ms_p50", "TPOT p50 (ms/token)", "tpot_p50_ms"))


def _axes(m: float, w: int, h: int, right: int, xlabel: str, ylabel: str, ticks: list[str], sx, sy, x1: float,
          y1: float) -> list[str]:
    """A latency plot's frame: background, both axes from 0 with their labels, and ticks at 0, half and the top."""
    parts = [f'<rect width="{w}" height="{h}" fill="white" stroke="#ccc"/>',
             f'<line x1="{m}" y1="{h - 56}" x2="{w - right}" y2="{h - 56}" stroke="#333"/>',
             f'<line x1="{m}" y1="56" x2="{m}" y2="{h - 56}" stroke="#333"/>',
             f'<text x="{(m + w - right) / 2}" y="{h - 14}" text-anchor="middle" font-size="13">{xlabel}</text>',
             f'<text x="16" y="{h / 2}" text-anchor="middle" font-size="13" transform="rotate(-90 16 {h / 2})">'
             f'{html.escape(ylabel)}</text>']
    for v, tick in zip((0.0, y1 / 2, y1), ticks, strict=True):
        parts.append(f'<text x="{m - 6}" y="{sy(v) + 4}" text-anchor="end" font-size="11">{tick}</text>')
    for v in (0.0, x1 / 2, x1):
        parts.append(f'<text x="{sx(v)}" y="{h - 56 + 16}" text-anchor="middle" font-size="11">{v:.3g}</text>')
    return parts


def svg_serving(variant: str, points: list[dict], metric: str, ylabel: str, slo: dict | None, min_tok_s: dict | None,
                selected: dict | None) -> str:
    """Latency against throughput for one artifact: a line per serving config through its concurrency points
    (x: output tok/s of the whole server, y: `metric`), the SLO lines, and the selected point ringed."""
    pts = [p for p in points if p.get(metric) is not None and p.get("output_tok_s") is not None
           and "concurrency" in p]
    if not pts:
        return "<p><em>not measured</em></p>"
    xs = [p["output_tok_s"] for p in pts] + ([min_tok_s["value"]] if min_tok_s else [])
    ys = [p[metric] for p in pts] + ([slo["value"]] if slo else [])
    x0, x1 = 0.0, max(xs) * 1.1
    y0, y1 = 0.0, max(ys) * 1.15
    ticks = [f"{v:.4g}" for v in (y0, y1 / 2, y1)]
    m, w, h, right = left_margin(ticks), 560, 320, 110
    w += m - 56

    def sx(x):
        return m + (x - x0) / (x1 - x0 or 1) * (w - m - right)

    def sy(y):
        return h - 56 - (y - y0) / (y1 - y0 or 1) * (h - 2 * 56)

    name = html.escape(variant)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" class="serving" '
             f'data-variant="{name}" data-metric="{metric}">',
             *_axes(m, w, h, right, "output tokens/s (whole server)", ylabel, ticks, sx, sy, x1, y1)]
    if slo:
        parts.append(f'<g class="slo" data-slo="{metric}"><line x1="{m}" y1="{sy(slo["value"]):.1f}" x2="{w - right}" '
                     f'y2="{sy(slo["value"]):.1f}" stroke="#d62728" stroke-dasharray="6,4"/><text x="{m + 4}" '
                     f'y="{sy(slo["value"]) - 4:.1f}" font-size="11" fill="#d62728">SLO at concurrency '
                     f'{slo["concurrency"]}</text></g>')
    if min_tok_s:
        parts.append(f'<g class="slo" data-slo="min_output_tok_s"><line x1="{sx(min_tok_s["value"]):.1f}" y1="56" '
                     f'x2="{sx(min_tok_s["value"]):.1f}" y2="{h - 56}" stroke="#d62728" stroke-dasharray="2,3"/>'
                     f'<text x="{sx(min_tok_s["value"]) + 3:.1f}" y="52" font-size="11" fill="#d62728">min tok/s</text></g>')
    configs = list(dict.fromkeys(p["config"] for p in pts))
    for k, config in enumerate(configs):
        color = PALETTE[k % len(PALETTE)]
        line = sorted((p for p in pts if p["config"] == config), key=lambda p: p["concurrency"])
        parts.append(f'<g class="series" data-config="{html.escape(config)}" stroke="{color}" fill="{color}">')
        if len(line) > 1:
            path = " ".join(f"{sx(p['output_tok_s']):.1f},{sy(p[metric]):.1f}" for p in line)
            parts.append(f'<polyline points="{path}" fill="none"/>')
        for p in line:
            parts.append(f'<circle cx="{sx(p["output_tok_s"]):.1f}" cy="{sy(p[metric]):.1f}" r="4" '
                         f'data-concurrency="{p["concurrency"]}"><title>{name} @ {html.escape(config)}, concurrency '
                         f'{p["concurrency"]}: {p["output_tok_s"]:.4g} tok/s, {p[metric]:.4g}</title></circle>'
                         f'<text x="{sx(p["output_tok_s"]) + 6:.1f}" y="{sy(p[metric]) - 6:.1f}" font-size="10" '
                         f'stroke="none">c={p["concurrency"]}</text>')
        parts.append(f'<text x="{w - right + 4}" y="{70 + 14 * k}" font-size="11" stroke="none">'
                     f'{html.escape(config)}</text></g>')
    if selected and selected["variant"] == variant:
        hit = next((p for p in pts if p["config"] == selected["config"] and p["concurrency"] == selected.get("at")),
                   None)
        if hit:
            parts.append(f'<circle class="selected" cx="{sx(hit["output_tok_s"]):.1f}" cy="{sy(hit[metric]):.1f}" r="9" '
                         f'fill="none" stroke="#2ca02c" stroke-width="3"><title>selected</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


CAPACITY_METRICS = {"ttft_p99_ms": ("ttft_ms_p99", "TTFT p99 (ms)"), "tpot_p50_ms": ("tpot_ms_p50", "TPOT p50 (ms/token)"),
                    "itl_p99_ms": ("itl_ms_p99", "ITL p99 (ms)"), "e2e_p99_ms": ("e2e_ms_p99", "e2e p99 (ms)")}


def svg_capacity(variant: str, capacity: dict, slo_field: str) -> str:
    """Latency against load for one (artifact, config) of a capacity search: each probe's pooled figure at its request
    rate, its 95 % interval as a band, the SLO line, and the capacity ringed (probes that met the SLOs filled)."""
    metric, ylabel = CAPACITY_METRICS[slo_field]
    bound = (capacity.get("slo") or {}).get(slo_field)
    pts = sorted((p for p in capacity.get("probes") or [] if p.get(metric) is not None), key=lambda p: p["rate_rps"])
    if not pts:
        return "<p><em>no probe measured</em></p>"
    lows = [((p.get("ci") or {}).get(metric) or [p[metric], p[metric]])[0] for p in pts]
    highs = [((p.get("ci") or {}).get(metric) or [p[metric], p[metric]])[1] for p in pts]
    x1 = max(p["rate_rps"] for p in pts) * 1.1
    y1 = max([*highs, bound or 0]) * 1.15
    ticks = [f"{v:.4g}" for v in (0.0, y1 / 2, y1)]
    m, w, h, right = left_margin(ticks), 560, 320, 40
    w += m - 56

    def sx(x):
        return m + x / (x1 or 1) * (w - m - right)

    def sy(y):
        return h - 56 - y / (y1 or 1) * (h - 2 * 56)

    name = html.escape(f"{variant} @ {capacity['config']}")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" class="capacity" '
             f'data-variant="{html.escape(variant)}" data-config="{html.escape(str(capacity["config"]))}" '
             f'data-metric="{metric}">',
             *_axes(m, w, h, right, "request rate (requests/s, Poisson arrivals)", ylabel, ticks, sx, sy, x1, y1)]
    band = [f"{sx(p['rate_rps']):.1f},{sy(hi):.1f}" for p, hi in zip(pts, highs, strict=True)]
    band += [f"{sx(p['rate_rps']):.1f},{sy(lo):.1f}" for p, lo in reversed(list(zip(pts, lows, strict=True)))]
    parts.append(f'<polygon class="band" points="{" ".join(band)}" fill="#1f77b4" fill-opacity="0.18" stroke="none"/>')
    line = " ".join(f"{sx(p['rate_rps']):.1f},{sy(p[metric]):.1f}" for p in pts)
    parts.append(f'<polyline points="{line}" fill="none" stroke="#1f77b4"/>')
    for p in pts:
        fill = "#1f77b4" if p.get("meets") else "white"
        parts.append(f'<circle class="probe" cx="{sx(p["rate_rps"]):.1f}" cy="{sy(p[metric]):.1f}" r="4" '
                     f'fill="{fill}" stroke="#1f77b4" data-rate="{p["rate_rps"]:.4g}" data-meets="{str(p.get("meets")).lower()}">'
                     f'<title>{name}: {p["rate_rps"]:.4g} requests/s, {p[metric]:.4g}'
                     f'{" (reused)" if p.get("reused") else ""}</title></circle>')
    if bound:
        parts.append(f'<g class="slo" data-slo="{slo_field}"><line x1="{m}" y1="{sy(bound):.1f}" x2="{w - right}" '
                     f'y2="{sy(bound):.1f}" stroke="#d62728" stroke-dasharray="6,4"/><text x="{m + 4}" '
                     f'y="{sy(bound) - 4:.1f}" font-size="11" fill="#d62728">SLO {bound:g}</text></g>')
    best = next((p for p in pts if capacity.get("capacity_rps") is not None
                 and abs(p["rate_rps"] - capacity["capacity_rps"]) < 1e-3 * capacity["capacity_rps"]), None)
    if best:
        parts.append(f'<circle class="capacity-point" cx="{sx(best["rate_rps"]):.1f}" cy="{sy(best[metric]):.1f}" '
                     f'r="9" fill="none" stroke="#2ca02c" stroke-width="3"><title>capacity {best["rate_rps"]:.4g} '
                     f'requests/s ({capacity.get("concurrency")} in flight)</title></circle>'
                     f'<text x="{sx(best["rate_rps"]) + 10:.1f}" y="{sy(best[metric]) + 16:.1f}" font-size="11" '
                     f'fill="#2ca02c">capacity {best["rate_rps"]:.3g}/s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _capacity_html(rows: list[dict]) -> str:
    figures = []
    for r in rows:
        for cap in r.get("capacity") or []:
            for slo_field in cap.get("slo") or {}:
                where = (f"capacity {cap['capacity_rps']:.4g} requests/s, {cap.get('concurrency')} in flight"
                         if cap.get("capacity_rps") else "no rate met the SLOs")
                figures.append(f"<figure><figcaption>{html.escape(r['variant'])} @ {html.escape(str(cap['config']))}: "
                               f"{html.escape(CAPACITY_METRICS[slo_field][1])} vs request rate ({where})</figcaption>"
                               f"{svg_capacity(r['variant'], cap, slo_field)}</figure>")
    return f'<h3>Capacity</h3><div class="plots">{"".join(figures)}</div>' if figures else ""


def _serving_html(run: dict) -> str:
    rows = [r for r in run.get("variants", []) if r.get("serving")]
    if not rows:
        return ""
    sel = run.get("selection") or {}
    bounds = sel.get("bounds") or {}
    chosen = dict(sel["selected"], at=sel.get("concurrency")) if sel.get("selected") else None
    figures = []
    for r in rows:
        for metric, label, bound in SERVING_PLOTS:
            plot = svg_serving(r["variant"], r["serving"], metric, label, bounds.get(bound),
                               bounds.get("min_output_tok_s"), chosen)
            figures.append(f"<figure><figcaption>{html.escape(r['variant'])}: {html.escape(label)} vs throughput "
                           f"(one line per serving config)</figcaption>{plot}</figure>")
    if chosen:
        verdict = (f"<p class=ok>Selected: <b>{html.escape(chosen['variant'])}</b> @ "
                   f"<b>{html.escape(str(chosen['config']))}</b> (objective {html.escape(sel['objective'])})"
                   + (f"; serve it with <code>{html.escape(chosen['command'])}</code>" if chosen.get("command") else "")
                   + "</p>")
        if sel.get("tie"):
            from qbuild.results.summary import tie_line

            verdict += f"<p>Tie: {html.escape(tie_line(sel))}</p>"
        verdict += "".join(f"<p>Accepted within noise (on_uncertain: accept): {html.escape(n)}</p>"
                           for n in chosen.get("uncertain") or [])
    elif sel:
        verdict = f"<p class=bad>{html.escape(sel.get('reason') or 'Nothing meets every selection bound.')}</p>"
    else:
        verdict = ""
    misses = "".join(f"<li>{html.escape(x['variant'])} @ {html.escape(str(x['config']))}: {html.escape(x['why'])}</li>"
                     for x in sel.get("rejected", []))
    return (f'<section id="serving"><h2>Serving under load</h2>{verdict}'
            f'{"<ul>" + misses + "</ul>" if misses else ""}{_config_quality_html(rows)}{_serving_points_html(rows)}'
            f'<div class="plots">{"".join(figures)}</div>{_capacity_html(rows)}</section>')


POINT_FIGURES = (("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"), ("TTFT p99 ms", "ttft_ms_p99", "{:.1f}"),
                 ("TPOT p50 ms", "tpot_ms_p50", "{:.2f}"), ("TPOT p99 ms", "tpot_ms_p99", "{:.2f}"),
                 ("ITL p50 ms", "itl_ms_p50", "{:.2f}"), ("ITL p99 ms", "itl_ms_p99", "{:.2f}"),
                 ("output tok/s", "output_tok_s", "{:.1f}"), ("requests/s", "requests_s", "{:.2f}"))


def _serving_points_html(rows: list[dict]) -> str:
    """Every serving point's figures, each with its 95 % interval [lo, hi] where it was measured in rounds."""
    def cell(p: dict, field: str, fmt: str) -> str:
        v, ci = p.get(field), (p.get("ci") or {}).get(field)
        if v is None:
            return "-"
        return fmt.format(v) + (f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else "")

    from qbuild.serving.client import turns_text

    chats = any(p.get("by_turn") for r in rows for p in r["serving"])   # conversations: a column of their turns
    lines = []
    for r in rows:
        for p in r["serving"]:
            if "concurrency" not in p and "request_rate" not in p:
                continue
            where = str(p["concurrency"]) if "concurrency" in p else f"{p['request_rate']:g}/s"
            cells = [r["variant"], p["config"], where, *(cell(p, f, fmt) for _, f, fmt in POINT_FIGURES),
                     str(len(p.get("rounds") or []) or 1), str(p.get("errors")),
                     *([turns_text(p.get("by_turn") or [])] if chats else [])]
            lines.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not lines:
        return ""
    head = "".join(f"<th>{c}</th>" for c in ("variant", "config", "load", *(n for n, _, _ in POINT_FIGURES),
                                               "rounds", "errors", *(["TTFT p50 by turn (prompt tokens)"] if chats
                                                                     else [])))
    return (f'<table class="serving-points"><caption>Serving points: each figure with its 95 % bootstrap interval '
            f'[lo, hi] over the point\'s rounds (none with one round)</caption><tr>{head}</tr>{"".join(lines)}'
            f'</table>')


def _config_quality_html(rows: list[dict]) -> str:
    """Per (artifact, serving config): what its KV cache costs in quality beside what it saves in memory."""
    lines = []
    for r in rows:
        for config in dict.fromkeys(p["config"] for p in r["serving"]):
            pts = [p for p in r["serving"] if p["config"] == config]
            first = next((p for p in pts if "kld" in p), None)
            if first is None:
                continue   # a run recorded before serving points carried their quality
            rss = max((p.get("peak_rss_mb") or 0 for p in pts), default=0)
            cells = [r["variant"], config, first.get("kv_cache_dtype") or "engine default",
                     "-" if first.get("kv_bytes_per_token") is None else f"{first['kv_bytes_per_token']:,.0f}",
                     f"{rss:.0f} MiB" if rss else "-",
                     *("-" if first.get(f) is None else fmt.format(first[f])
                       for f, fmt in (("kld", "{:.4f}"), ("delta_ppl_pct", "{:+.2f} %"), ("ppl", "{:.3f}")))]
            lines.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    if not lines:
        return ""
    head = "".join(f"<th>{c}</th>" for c in ("variant", "config", "KV cache", "KV bytes/token", "peak RSS", "KLD",
                                               "ΔPPL", "PPL"))
    return (f'<table class="config-quality"><caption>Quality under each serving config (a quantized KV cache '
            f'measured in its own pass, against the same reference)</caption><tr>{head}</tr>{"".join(lines)}</table>')


COLUMNS = [("variant", "variant", "{}"), ("method", "method", "{}"), ("detail", "detail", "{}"),
           ("size", "size_bytes", None), ("PPL", "ppl", "{:.3f}"), ("ΔPPL", "delta_ppl", "{:+.3f}"),
           ("KLD", "kld", "{:.4f}"), ("top-1", "top1", "{:.1%}"), ("decode tok/s", "decode_tok_s", "{:.1f}"),
           ("prefill tok/s", "prefill_tok_s", "{:.1f}"), ("TTFT ms", "ttft_ms", "{:.1f}"), ("status", "status", "{}")]


def _cells(row: dict) -> list[str]:
    out = []
    for _, field, fmt in COLUMNS:
        v = row.get(field)
        out.append(human_size(v) if field == "size_bytes" else ("-" if v is None or v == "" else fmt.format(v)
                                                               + half_width(row.get(f"{field}_ci"), fmt)))
    return out


def _points(rows, field):
    return [(r["size_bytes"] / 2**20, r[field], r["variant"]) for r in rows
            if r.get(field) is not None and r.get("size_bytes")]


def _kld_points(rows):
    """Every artifact with a KLD, and each search's measured candidates beside the artifact it chose."""
    points = _points(rows, "kld")
    for r in rows:
        for c in (r.get("search") or {}).get("candidates", []):
            if c.get("kld") is not None and c.get("size_bytes"):
                points.append((c["size_bytes"] / 2**20, c["kld"], f"{r['variant']}~cand{c['candidate']}"))
    return points


def _gates_html(gates: dict | None) -> str:
    if not gates:
        return ""
    rows = []
    for g in gates["checks"]:
        value = g.get("note") or ("not measured" if g["value"] is None else f"{g['value']:.4g}")
        rows.append(f"<tr class={'ok' if g['passed'] else 'bad'}><td>{html.escape(g['variant'])}</td>"
                    f"<td>{g['check']}</td><td>{value}</td><td>{g['bound']}</td>"
                    f"<td>{'pass' if g['passed'] else 'FAIL'}</td></tr>")
    return (f"<h2>Quality gates: {'passed' if gates['passed'] else 'FAILED'}</h2><table><tr><th>variant</th>"
            f"<th>check</th><th>value</th><th>bound</th><th>result</th></tr>{''.join(rows)}</table>")


def hardware_text(hw) -> str:
    """The machine in words: "AMD EPYC 7B13 · 1 thread · GPU NVIDIA H100 (SM 9.0)"."""
    if not isinstance(hw, dict) or not hw:
        return "unknown"
    parts = [str(hw["cpu"])] if hw.get("cpu") else []
    if hw.get("threads") is not None:
        parts.append(f"{hw['threads']} thread{'' if str(hw['threads']) == '1' else 's'}")
    if hw.get("gpu"):
        parts.append(f"GPU {hw['gpu']}" + (f" (SM {hw['sm']})" if hw.get("sm") else ""))
    parts += [f"{k} {v}" for k, v in hw.items() if k not in ("cpu", "threads", "gpu", "sm")]
    return " · ".join(parts)


def _deploy_html(deploy: dict | None) -> str:
    """The deployment search (recipe deploy:): capacity per replica vs peak RSS of the searched candidates, Pareto
    front marked, the chosen deployment's command, and every candidate's line."""
    if not deploy or "chosen" not in deploy:
        return ""
    from qbuild.results.deploy_report import deploy_lines

    points = [(r["peak_rss_mb"], r["capacity_rps"], r["name"]) for r in deploy["candidates"]
              if r.get("capacity_rps") is not None and r.get("peak_rss_mb")]
    lines = "\n".join(deploy_lines(deploy))
    return (f"<h2>Deployment search</h2><figure><figcaption>Capacity per replica at the SLOs vs server peak RSS, "
            f"searched candidates (upper-left is better; red: Pareto front)</figcaption>"
            f"{svg_scatter(points, 'peak RSS (MiB)', 'capacity (requests/s)', False)}</figure>"
            f"<pre>{html.escape(lines)}</pre>")


def render_html(run: dict, history: list[dict] | None = None) -> str:
    """history: the recipe's run records up to this one, oldest first (`qbuild report` passes the store's)."""
    rows = run["variants"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c, _, _ in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r)) + "</tr>" for r in rows)
    protocol = json.dumps(run.get("protocol"), indent=2)
    gate_html = _gates_html(run.get("gates"))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>qbuild report · {html.escape(run['recipe'])}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} th{{background:#f3f3f3}}
td:first-child,td:nth-child(2),td:nth-child(3){{text-align:left}} .plots{{display:flex;gap:2em;flex-wrap:wrap}}
tr.bad td{{background:#fde2e2}} pre{{background:#f7f7f7;padding:1em}}
</style></head><body>
<h1>qbuild report · {html.escape(run['recipe'])}</h1>
<p>run <code>{html.escape(run.get('run_id', '?'))}</code> · store <code>{html.escape(run.get('store', '?'))}</code>
· hardware: {html.escape(hardware_text(run.get('hardware')))}</p>
<table><tr>{head}</tr>{body}</table>
{gate_html}
<div class="plots">
<figure><figcaption>Perplexity vs size (lower-left is better; red: Pareto front)</figcaption>
{svg_scatter(_points(rows, 'ppl'), 'size (MiB)', 'perplexity', True)}</figure>
<figure><figcaption>KLD vs size, with every measured candidate of a search (lower-left is better; red: Pareto
front)</figcaption>
{svg_scatter(_kld_points(rows), 'size (MiB)', 'KLD', True)}</figure>
<figure><figcaption>Decode speed vs size (upper-left is better; red: Pareto front)</figcaption>
{svg_scatter(_points(rows, 'decode_tok_s'), 'size (MiB)', 'decode tokens/s', False)}</figure>
</div>
{_serving_html(run)}
{_deploy_html(run.get("deploy"))}
{_history_html(history)}
<h2>Perplexity protocol</h2><p>Numbers are comparable only under this protocol.</p><pre>{html.escape(protocol)}</pre>
</body></html>
"""


def render_markdown(run: dict) -> str:
    lines = [f"# qbuild report · {run['recipe']}", "",
             f"run `{run.get('run_id')}`, hardware: {hardware_text(run.get('hardware'))}", "",
             "| " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in run["variants"]]
    if run.get("protocol"):
        lines += ["", f"Perplexity protocol: `{json.dumps(run['protocol'], sort_keys=True)}`"]
    if run.get("gates"):
        lines += ["", f"Quality gates: {'passed' if run['gates']['passed'] else 'FAILED'}"]
        lines += [f"- {g['variant']} {g['check']}: {g['value']} vs {g['bound']} → {'pass' if g['passed'] else 'FAIL'}"
                  for g in run["gates"]["checks"]]
    return "\n".join(lines) + "\n"
