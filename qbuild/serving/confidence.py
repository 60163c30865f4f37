"""A serving point measured in rounds: its figures over every round, and seeded 95 % bootstrap intervals on them.

A point's latency percentiles are taken over the requests of all its rounds, its rates (output tok/s, requests/s)
are the mean of the rounds' rates, and its counts are summed. The interval of each figure comes from a two-level
(hierarchical) bootstrap (qbuild.base.bootstrap): rounds are drawn with replacement, then requests within each drawn
round, the same requests for every latency. With fewer than two rounds there is no interval (None): one round says
nothing of how much the next would differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qbuild.base.bootstrap import LEVEL, RESAMPLES, percentile_interval, plus_minus
from qbuild.serving.client import PERCENTILES, by_turn

if TYPE_CHECKING:   # numpy is imported where intervals are computed: a cached run's summary never loads it
    import numpy as np

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
RATES = ("output_tok_s", "requests_s")
# the figures that get an interval: what SLOs and objectives read
CI_FIELDS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", *RATES)
# what each round keeps in the stored result besides its per-request samples
ROUND_FIELDS = (*(f"{m}_p{p}" for m in LATENCIES for p in PERCENTILES), *RATES, "requests", "completed", "errors",
                "seconds")


def combine_rounds(rounds: list[dict], seed: int) -> dict:
    """One point from the summaries of its rounds (qbuild.serving.client.summarize_point, each with its samples):
    the pooled figures, `rounds` (each round's figures and samples) and `ci` (field → [lo, hi], or None)."""
    import numpy as np

    pooled = {m: [v for r in rounds for v in _values(r, m)] for m in LATENCIES}
    seconds = sum(r["seconds"] for r in rounds)
    out = {"requests": sum(r["requests"] for r in rounds), "completed": sum(r["completed"] for r in rounds),
           "errors": sum(r["errors"] for r in rounds), "seconds": round(seconds, 4)}
    for rate in RATES:
        values = [r[rate] for r in rounds if r.get(rate) is not None]
        out[rate] = round(float(np.mean(values)), 4) if values else None
    for m in LATENCIES:
        for p in PERCENTILES:
            out[f"{m}_p{p}"] = round(float(np.percentile(pooled[m], p)), 3) if pooled[m] else None
    # goodput reads requests against SLOs over the measured time: every round's requests over every round's seconds
    out["samples"] = {m: [v for r in rounds for v in r["samples"][m]] for m in ("ttft_ms", "tpot_ms")}
    if "by_turn" in rounds[0]:   # conversations: the turns of every round, pooled
        out["samples"] |= {m: [v for r in rounds for v in r["samples"][m]] for m in ("turn", "prompt_tokens")}
        out["by_turn"] = by_turn(out["samples"], len(rounds[0]["by_turn"]))
    first_error = next((r["first_error"] for r in rounds if r.get("first_error")), None)
    if first_error:
        out["first_error"] = first_error
    out["rounds"] = rounds
    out["ci"] = intervals(rounds, seed)
    return out


def _values(round_: dict, metric: str) -> list[float]:
    """A round's per-request values of `metric` (ITL: every gap of every request), None left out."""
    s = round_["samples"].get(metric) or []
    if metric == "itl_ms":
        return [g for gaps in s for g in gaps]
    return [v for v in s if v is not None]


def intervals(rounds: list[dict], seed: int, resamples: int = RESAMPLES, level: float = LEVEL) -> dict | None:
    """field → [lo, hi] (the `level` percentile interval of `resamples` seeded bootstrap replicates), None for a
    field nothing was measured for; None with fewer than two rounds."""
    import numpy as np

    if len(rounds) < 2:
        return None
    # rounds, not requests alone, are the independent units: requests of one round share its server state and how
    # its streams happened to group, so resampling requests only would hide the run-to-run spread (Saravanan et al.
    # 2020, "Application of the hierarchical bootstrap to multi-level data"); within a drawn round, requests
    rng = np.random.default_rng(seed)
    per_round = [_request_table(r) for r in rounds]
    reps: dict[str, list[float]] = {f: [] for f in CI_FIELDS}
    rates = {rate: np.array([np.nan if r.get(rate) is None else r[rate] for r in rounds], dtype=float)
             for rate in RATES}
    for _ in range(resamples):
        drawn = rng.integers(0, len(rounds), len(rounds))
        pooled: dict[str, list[np.ndarray]] = {m: [] for m in ("ttft_ms", "tpot_ms", "itl_ms")}
        for k in drawn:
            table = per_round[k]
            n = len(table["ttft_ms"])
            if not n:
                continue
            counts = np.bincount(rng.integers(0, n, n), minlength=n)
            for m in ("ttft_ms", "tpot_ms"):
                pooled[m].append(np.repeat(table[m], counts))
            pooled["itl_ms"].append(np.repeat(table["itl_ms"], np.repeat(counts, table["itl_lengths"])))
        for m, parts in pooled.items():
            values = np.concatenate(parts) if parts else np.array([])
            values = values[~np.isnan(values)]
            p50, p99 = np.percentile(values, (50, 99)) if values.size else (np.nan, np.nan)
            reps[f"{m}_p50"].append(p50)
            reps[f"{m}_p99"].append(p99)
        for rate, values in rates.items():
            reps[rate].append(np.mean(values[drawn]))
    # None where a replicate lacks the figure (no request streamed twice, a round without rates)
    return {field: percentile_interval(values, level) for field, values in reps.items()}


def _request_table(round_: dict) -> dict:
    """A round's requests as arrays (TPOT NaN where a request streamed one token) and its ITL gaps, flattened, with
    how many each request has."""
    import numpy as np

    s = round_["samples"]
    gaps = s.get("itl_ms") or [[] for _ in s["ttft_ms"]]
    return {"ttft_ms": np.array(s["ttft_ms"], dtype=float),
            "tpot_ms": np.array([np.nan if v is None else v for v in s["tpot_ms"]], dtype=float),
            "itl_ms": np.array([g for req in gaps for g in req], dtype=float),
            "itl_lengths": np.array([len(req) for req in gaps], dtype=int)}


def with_ci(point: dict, field: str, spec: str) -> str:
    """A serving figure, "± half-width" of its 95 % interval where it was measured in rounds ("-" if absent)."""
    return plus_minus(point.get(field), (point.get("ci") or {}).get(field), spec)


def verdict(value: float, ci: list[float] | None, bound: float, kind: str) -> str:
    """"met", "missed", or "uncertain": the 95 % interval straddles the bound (without an interval, the value
    alone decides)."""
    lo, hi = ci if ci else (value, value)
    if kind == "max":
        return "met" if hi <= bound else "missed" if lo > bound else "uncertain"
    return "met" if lo >= bound else "missed" if hi < bound else "uncertain"
