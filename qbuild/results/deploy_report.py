"""The deployment search's answer (qbuild.serving.deploy_search) as a run's summary carries it and as `qbuild deploy`
prints it: the chosen deployment and its command, the replicas for the target load, the Pareto front, and one line
per other candidate with the bound it missed or why it was not searched."""

from __future__ import annotations


def from_outcomes(outcomes) -> dict | None:
    """The `deploy` step's result, or its status when it did not run (None: the recipe has no deploy:)."""
    for o in outcomes:
        if o.step.kind == "deploy":
            if o.status in ("built", "cached"):
                return {"status": o.status, **(o.metrics or {})}
            return {"status": str(o.status), "error": o.error}
    return None


def deploy_lines(deploy: dict) -> list[str]:
    if "chosen" not in deploy:
        return [f"deploy: not searched ({deploy['status']}{': ' + deploy['error'] if deploy.get('error') else ''})"]
    slo = ", ".join(f"{k} ≤ {v:g}" for k, v in deploy["slo"].items())
    chosen = deploy["chosen"]
    lines = []
    if chosen is None:
        lines.append(f"deploy: no candidate meets every bound at {slo} ({deploy['screened']} screened, "
                     f"{deploy['searched']} searched)")
    else:
        lines.append(f"deploy: {chosen['name']}: {chosen['capacity_rps']:.4g} requests/s per replica at {slo}"
                     + (f" ({chosen['next_rps']:.4g}/s missed)" if chosen.get("next_rps") else "")
                     + f", peak RSS {chosen['peak_rss_mb']:g} MiB"
                     + (f", KLD {chosen['kld']:.4f}" if chosen.get("kld") is not None else ""))
        lines.append(f"  command: {chosen['command']}")
        if deploy.get("ties"):
            lines.append(f"  tied within one grid step (4.4 %): {', '.join(deploy['ties'])}; broken by peak RSS, "
                         "then KLD, then name")
        rep = deploy.get("replicas")
        if rep:
            span = rep["range"]
            lines.append(f"  replicas for {rep['target_rps']:g} requests/s: {rep['replicas']}"
                         + (f" (between {span[0]} and {span[1]} within the search's resolution)"
                            if span[0] != span[1] else ""))
    lines.append(f"  Pareto front (capacity, peak RSS, KLD): {', '.join(deploy['front']) or '-'}")
    for r in deploy["candidates"]:
        if chosen is not None and r["name"] == chosen["name"]:
            continue
        lines.append(f"  {r['name']}: {candidate_text(r)}")
    return lines


def candidate_text(r: dict) -> str:
    screen = r["screen"]
    parts = []
    if r.get("capacity_rps") is not None:
        parts.append(f"{r['capacity_rps']:.4g} requests/s")
    parts.append(f"screen {_num(screen.get('requests_s'), '.3g')} requests/s at {screen.get('concurrency')} in flight, "
                 f"TPOT p50 {_num(screen.get('tpot_ms_p50'), '.1f')} ms")
    if r.get("peak_rss_mb") is not None:
        parts.append(f"{r['peak_rss_mb']:g} MiB")
    if r.get("speculative"):
        rate = r["speculative"].get("acceptance_rate")
        parts.append(f"draft acceptance {'-' if rate is None else format(rate, '.0%')}")
        plain = r.get("without_draft")
        if plain:
            capacity = plain.get("capacity_rps")
            parts.append(f"without the draft TPOT p50 {_num(plain.get('tpot_ms_p50'), '.1f')} ms"
                         + ("" if capacity is None else f", {capacity:.4g} requests/s"))
    challenge = r.get("challenge") or {}
    if challenge.get("below_rps") is not None and r.get("capacity_rps") is None:
        parts.append(f"challenged at the leader's {challenge['leader_rps']:.4g}/s: below {challenge['below_rps']:.4g}/s "
                     "(missed one grid step under the leader too)")
    elif challenge.get("outcome") in ("ties", "beats"):
        parts.append(f"challenged at the leader's {challenge['leader_rps']:.4g}/s: {challenge['outcome']}")
    why = "; ".join(r.get("rejected") or []) or r.get("not_searched")
    return ", ".join(parts) + (f": {'rejected: ' if r.get('rejected') else 'not searched: '}{why}" if why else "")


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)
