"""The `deploy` step's runner: the deployment search (qbuild.serving.deploy_search holds its rules and says why they
are sound). Reads the screens and quality passes the plan made (qbuild.planning.deploy), then runs the capacity
search (qbuild.serving.capacity_step.search_server) on the candidates that can still win, most promising first,
within `max_searched` searches and `max_minutes`."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path


def run(ctx) -> dict:
    from qbuild.serving.capacity_step import rate_of, search_server
    from qbuild.serving.config import ServedConfig
    from qbuild.serving.deploy_search import (
        BYTES_PER_MB,
        RESULT,
        choose,
        compare_drafts,
        could_tie,
        dominated_by,
        missed_bounds,
        pareto_front,
        replicas,
        rows_from_screens,
    )

    p = ctx.params
    screens = {c["screen"]: json.loads((Path(ctx.inputs[c["screen"]]) / "serving.json").read_text())
               for c in p["candidates"]}
    quality = {c["quality"]: ctx.input_manifests[c["quality"]].get("metrics", {})
               for c in p["candidates"] if c["quality"]}
    baseline_ppl = ctx.input_manifests.get("quality-baseline", {}).get("metrics", {}).get("ppl")
    rows = rows_from_screens(p["candidates"], screens, quality, baseline_ppl, p["bounds"])
    by_name = {r["name"]: (r, c) for r, c in zip(rows, p["candidates"], strict=True)}
    started = time.monotonic()
    stop_at = started + p["max_minutes"] * 60
    order = sorted((r for r in rows if not r["rejected"] and r["capacity_bound_rps"]),
                   key=lambda r: (-r["capacity_bound_rps"], r["name"]))
    searched: list[dict] = []
    serial = itertools.count(1)   # numbers every search and challenge (a row searched after its challenge, twice)

    def search_row(row, challenge_k: int | None = None) -> None:
        _, c = by_name[row["name"]]
        what = "capacity search" if challenge_k is None else f"challenge of the leader's {rate_of(challenge_k):.4g}/s"
        ctx.log(f"{what} ({next(serial)}): {row['name']} (screened bound {row['capacity_bound_rps']:g} "
                "requests/s)")
        found = search_server(
            ctx, label=row["name"], model=Path(ctx.inputs[f"model-{c['label']}"]),
            draft=Path(ctx.inputs[f"model-{c['draft']}"]) if c.get("draft") else None,
            config=ServedConfig(**c["config"]), server_name=c["server"], slots=c["slots"], context=c["context"],
            workload=p["workload"], family=c["family"],
            search_params={"slo": p["slo"], "max_error_pct": p["max_error_pct"],
                           "start_rps": row["screen"]["requests_s"] * 0.75},
            stop_at=stop_at, workdir=ctx.out / "searches" / row["name"],
            budget=f"deploy.max_minutes {p['max_minutes']:g}", challenge_k=challenge_k)
        row.update({"capacity_rps": found["capacity_rps"], "k": found["k"], "next_rps": found["next_rps"],
                    "search_complete": found["complete"], "probes_measured": found["probes_measured"],
                    "probes_reused": found["probes_reused"]})
        slower = challenge_k is not None and found["challenge"] == "below"   # than the leader, beyond one grid step
        if challenge_k is not None and found["challenge"] is not None:   # (cut short: reported as a search cut short)
            row["challenge"] = {"leader_rps": rate_of(challenge_k), "outcome": found["challenge"],
                                **({"below_rps": found["below_rps"]} if slower else {})}
        if found.get("peak_rss_bytes"):   # the search's own peak counts against the budget too
            row["peak_rss_mb"] = max(row["peak_rss_mb"] or 0, round(found["peak_rss_bytes"] / BYTES_PER_MB, 1))
            row["rejected"] = missed_bounds(row, p["bounds"])
        if found["capacity_rps"] is None and not slower:
            if found["complete"]:
                row["rejected"].append("no rate meets the SLOs")
            else:   # its capacity is unknown, not zero: say why, as for a candidate never searched
                row["not_searched"] = (f"{'challenge' if challenge_k is not None else 'search'} cut short by "
                                       f"max_minutes {p['max_minutes']:g} before any rate was judged")
        if row not in searched:
            searched.append(row)

    strategy = p.get("strategy", "prune")
    grid = strategy == "grid"   # every candidate searched: what the pruning is measured against

    def out_of_budget(row) -> bool:
        if not grid and len(searched) >= p["max_searched"]:
            row["not_searched"] = f"max_searched {p['max_searched']} reached"
        elif time.monotonic() >= stop_at:
            row["not_searched"] = f"max_minutes {p['max_minutes']:g} reached"
        return "not_searched" in row

    def within_bounds() -> list[dict]:
        return [m for m in searched if m.get("capacity_rps") and not m["rejected"]]

    def best_capacity() -> float:
        return max((m["capacity_rps"] for m in within_bounds()), default=0.0)

    def leader() -> dict | None:
        return max(within_bounds(), key=lambda m: m["k"], default=None)

    # first the choice: in order of the bound, while a bound can still beat the best capacity measured within the
    # bounds (challenge: once a leader is measured, each candidate whose screen, read CHALLENGE_SLACK low, could
    # reach within one grid step of it is challenged at the leader's rates); then the front: what is left, unless a
    # searched candidate beats it on capacity, memory and KLD at once
    for row in order:
        lead = leader() if strategy == "challenge" else None
        if lead is not None:
            if could_tie(row, lead["k"]) and not out_of_budget(row):
                search_row(row, challenge_k=lead["k"])
        elif (grid or row["capacity_bound_rps"] > best_capacity()) and not out_of_budget(row):
            search_row(row)
    # when the choice was settled: what a search costs before the front pass (the bench compares it with a grid)
    choice_settled = {"searched": len(searched), "seconds": round(time.monotonic() - started, 1)}
    for row in order:
        below = (row.get("challenge") or {}).get("below_rps")
        if below is not None:   # slower than the leader, yet maybe on the front (less memory, lower KLD)
            row["capacity_bound_rps"] = min(row["capacity_bound_rps"], below)
        elif "capacity_rps" in row or "not_searched" in row:
            continue
        if not p.get("front", True) and not grid:
            row["not_searched"] = "front: false (the choice was settled without it)"
            continue
        better = dominated_by(row, searched)
        if better is not None:
            row["not_searched"] = (f"its screened full-batch throughput bounds its capacity at "
                                   f"{row['capacity_bound_rps']:.4g} requests/s, which {better['name']} already "
                                   f"sustains ({better['capacity_rps']:.4g}/s) with no more memory and no higher KLD, "
                                   f"within noise ({better['peak_rss_mb']} against {row['peak_rss_mb']} MiB, KLD "
                                   f"{better['kld']} against {row['kld']})")
        elif not out_of_budget(row):
            search_row(row)
    compare_drafts(rows)
    best, ties = choose(rows)
    result = {"chosen": best and {k: best[k] for k in ("name", "variant", "config", "command", "capacity_rps",
                                                         "next_rps", "peak_rss_mb", "kld", "delta_ppl_pct")},
              "ties": ties, "replicas": replicas(p["target_rps"], best), "front": pareto_front(rows),
              "slo": p["slo"], "bounds": p["bounds"], "strategy": p.get("strategy", "prune"), "searched": len(searched),
              "screened": len(rows), "choice_settled": choice_settled,
              "seconds": round(time.monotonic() - started, 1), "candidates": rows}
    (ctx.out / RESULT).write_text(json.dumps(result, indent=2))
    ctx.log(f"deploy: {best['name'] if best else 'nothing meets every bound'}"
            + (f" at {best['capacity_rps']:g} requests/s per replica" if best else "")
            + f"; {len(rows)} screened, {len(searched)} searched")
    return {"format": "metrics", "metrics": result}
