"""The rules of the `deploy` step (its runner: qbuild.serving.deploy_step): which deployment to ship. It reads every
candidate's screen (one closed-loop point at its full batch: throughput, latencies, the server's peak RSS, a draft's
acceptance rate) and the quality of its weights under its KV cache, rejects what breaks the memory or quality bounds,
then runs the capacity search (qbuild.serving.capacity_step's probes, grid and judgement) on the rest in order of
their screened throughput.

Why the order prunes soundly: a server cannot sustain arrivals faster than it completes requests with every slot busy,
so a candidate's screened full-batch throughput bounds its capacity at any SLO from above (with SCREEN_SLACK for a
short point's noise). The search runs first for the choice (from the highest bound down, while a bound can beat the
best capacity measured within the bounds), then for the front: a candidate whose bound is below the capacity already
measured for another candidate that needs no more memory and has no higher KLD (within noise: FRONT_MEMORY_TOLERANCE,
FRONT_KLD_TOLERANCE) can neither be chosen nor be meaningfully on the Pareto front: it is never searched, and says
so. The rest are searched (at most `max_searched`, within `max_minutes`), their probes shared with the capacity
steps' cache.

The answer: the chosen candidate (most capacity per replica within every bound; candidates within one grid step of it,
4.4 %, the search's resolution, are reported as ties and broken by memory, then KLD, then name), its exact server
command, the replicas a `target_rps` needs, the Pareto front (capacity ↑, peak RSS ↓, KLD ↓) of the searched
candidates, and for every other candidate the bound it missed or why it was not searched."""

from __future__ import annotations

import json
import math

RESULT = "deploy.json"
SCREEN_SLACK = 0.25   # a screen is one short point: its throughput may read this much low (measured: 8-request
# points on llama-server repeat within ~10 %)
# strategy challenge: a candidate is challenged at the leader's rates when its screen, read this much low, could reach
# within one grid step of the leader's capacity. Wider than SCREEN_SLACK: a challenge costs one to three probes, and
# the screens of one configuration differed by up to 37 % between two cold runs of recipes/deploy.yaml (docs/serving.md)
CHALLENGE_SLACK = 0.5
BYTES_PER_MB = 1024 * 1024
# Within these a candidate's smaller memory or lower KLD is not worth a capacity search for the front: a server's peak
# RSS differs by a few MiB between screens of one configuration, and a KLD a tenth lower is no reason to ship another
# artifact. Measured on the demo's first search: without them the front pass searched 7 more of 12 candidates, each
# kept on the front by a few MiB or a slightly lower KLD (docs/serving.md).
FRONT_MEMORY_TOLERANCE = (0.05, 16.0)   # relative, and MiB: the larger of the two
FRONT_KLD_TOLERANCE = (0.10, 1e-3)      # relative, and absolute


def rows_from_screens(candidates: list[dict], screens: dict[str, dict], quality: dict[str, dict | None],
                      baseline_ppl: float | None, bounds: dict) -> list[dict]:
    """One row per candidate: what its screen measured, its quality, and the bounds it misses (`rejected`)."""
    rows = []
    for c in candidates:
        screen = screens[c["screen"]]
        point = screen["points"][0]
        q = quality.get(c["quality"]) or {}
        rss = screen.get("peak_rss_bytes")
        row = {"name": f"{c['label']}@{c['config']['name']}", "variant": c["label"], "config": c["config"],
               "draft": c.get("draft"), "command": screen.get("command"),
               "peak_rss_mb": round(rss / BYTES_PER_MB, 1) if rss else None,
               "screen": {k: point.get(k) for k in ("concurrency", "requests_s", "output_tok_s", "ttft_ms_p99",
                                                    "tpot_ms_p50", "errors")},
               "kld": q.get("kld"), "ppl": q.get("ppl"),
               "delta_ppl_pct": (round(100 * (q["ppl"] / baseline_ppl - 1), 3)
                                 if q.get("ppl") and baseline_ppl else None),
               "capacity_bound_rps": (round(point["requests_s"] * (1 + SCREEN_SLACK), 4)
                                      if point.get("requests_s") else None)}
        if screen.get("speculative") is not None:
            row["speculative"] = screen["speculative"]
        row["rejected"] = missed_bounds(row, bounds)
        rows.append(row)
    return rows


def missed_bounds(row: dict, bounds: dict) -> list[str]:
    """The memory and quality bounds a row misses, each with its figure (a bound with no figure to judge misses)."""
    out = []
    if row["screen"].get("errors"):
        out.append(f"{row['screen']['errors']} request(s) failed while screening")
    for field, value, unit in (("max_memory_mb", row["peak_rss_mb"], " MiB peak RSS"), ("max_kld", row["kld"], " KLD"),
                               ("max_delta_ppl_pct", row["delta_ppl_pct"], " % PPL over the baseline")):
        bound = bounds.get(field)
        if bound is None:
            continue
        if value is None:
            out.append(f"{field} {bound:g}: not measured")
        elif value > bound:
            out.append(f"{field} {bound:g}: {value:g}{unit}")
    return out


def no_worse(a: dict, b: dict) -> bool:
    """`a` needs no more memory and has no higher KLD than `b`, each within its front tolerance."""
    mem_a, mem_b, kld_a, kld_b = (a["peak_rss_mb"] or 0), (b["peak_rss_mb"] or 0), (a["kld"] or 0), (b["kld"] or 0)
    rel, floor = FRONT_MEMORY_TOLERANCE
    if mem_a > mem_b + max(rel * mem_b, floor):
        return False
    rel, floor = FRONT_KLD_TOLERANCE
    return kld_a <= kld_b + max(rel * kld_b, floor)


def dominated_by(row: dict, searched: list[dict]) -> dict | None:
    """A searched row whose measured capacity is at least `row`'s bound, with no more memory and no higher KLD (within
    the front tolerances: `row` cannot be meaningfully better on either)."""
    bound = row["capacity_bound_rps"] or 0.0
    for m in searched:
        if m.get("capacity_rps") is not None and m["capacity_rps"] >= bound and no_worse(m, row):
            return m
    return None


def pareto_front(rows: list[dict]) -> list[str]:
    """Names of the searched rows no other one beats on capacity, peak RSS and KLD at once."""
    measured = [r for r in rows if r.get("capacity_rps") is not None]

    def beats(a, b) -> bool:
        ge = (a["capacity_rps"] >= b["capacity_rps"] and (a["peak_rss_mb"] or 0) <= (b["peak_rss_mb"] or 0)
              and (a["kld"] or 0) <= (b["kld"] or 0))
        gt = (a["capacity_rps"] > b["capacity_rps"] or (a["peak_rss_mb"] or 0) < (b["peak_rss_mb"] or 0)
              or (a["kld"] or 0) < (b["kld"] or 0))
        return ge and gt

    return [r["name"] for r in measured if not any(beats(o, r) for o in measured if o is not r)]


def could_tie(row: dict, leader_k: int) -> bool:
    """Whether `row`'s screened full-batch throughput, read CHALLENGE_SLACK low, reaches one grid step below the
    leader's capacity (grid index `leader_k`): the least a tie needs."""
    from qbuild.serving.capacity_step import rate_of

    screened = row["screen"].get("requests_s") or 0.0
    return screened * (1 + CHALLENGE_SLACK) >= rate_of(leader_k - 1)


def choose(rows: list[dict]) -> tuple[dict | None, list[str]]:
    """The searched row with the most capacity within every bound, and the names of those tied with it (within one
    grid step); ties broken by peak RSS, then KLD, then name."""
    ok = [r for r in rows if r.get("capacity_rps") is not None and not r["rejected"]]
    if not ok:
        return None, []
    top_k = max(r["k"] for r in ok)
    tied = [r for r in ok if top_k - r["k"] <= 1]
    tied.sort(key=lambda r: (r["peak_rss_mb"] or 0, r["kld"] or 0, r["name"]))
    best = tied[0]
    return best, [r["name"] for r in tied[1:]]


def replicas(target_rps: float | None, row: dict | None) -> dict | None:
    """Replicas of `row` for `target_rps`: at its measured capacity, and at the next grid rate (which it missed) as
    the fewest its interval allows."""
    if target_rps is None or row is None:
        return None
    most = math.ceil(target_rps / row["capacity_rps"])
    fewest = math.ceil(target_rps / row["next_rps"]) if row.get("next_rps") else most
    return {"target_rps": target_rps, "replicas": most, "range": [fewest, most]}


def compare_drafts(rows: list[dict]) -> None:
    """Each speculative row beside the same weights and settings without a draft: its TPOT and capacity change."""
    def levers(r: dict) -> tuple[str, str]:   # the row's weights and settings, its draft left out
        return r["variant"], json.dumps({k: v for k, v in r["config"].items()
                                         if k not in ("name", "draft", "draft_max", "draft_min")}, sort_keys=True)

    plain = {levers(r): r for r in rows if not r.get("draft")}
    for r in rows:
        other = plain.get(levers(r)) if r.get("draft") else None
        if other is not None:
            r["without_draft"] = {"name": other["name"], "tpot_ms_p50": other["screen"]["tpot_ms_p50"],
                                  "capacity_rps": other.get("capacity_rps")}
