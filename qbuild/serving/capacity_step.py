"""The `capacity[<artifact>@<config>]` step: the highest open-loop request rate an artifact's server sustains within SLOs.

Rates lie on one grid for every search, 2^(k/16) requests/s for integer k (steps of 4.4 %), so that searches under
another SLO, or restarted with another budget, ask for the same rates. The search brackets (from `start_rps`, or, by
default, from the rate the server completes requests sent one at a time, measured with a few lone requests: its
capacity lies within a factor of a few of it, where probes are short; doubling while the rate meets the SLOs,
halving while it does not) and then bisects the grid index between the
highest rate that met them and the lowest that did not, until they are neighbours. Each probe is a measured point:
`rounds` rounds of Poisson arrivals (each after its own warm-up, with prompts and arrivals of its own, seeded by the
rate and the round), pooled, with bootstrap intervals (qbuild.serving.confidence). A probe meets the SLOs when its
pooled TTFT p99 / TPOT p50 are within the bounds, at most `max_error_pct` % of its requests failed, and requests did
not arrive faster than the server completed them while every slot was busy (`saturated_rps`, the server's own
throughput at full batch, measured inside the probe) beyond that throughput's noise; within its noise the probe
runs more rounds (up to twice its rounds), then leaves the call to the latencies. Its intervals and verdict (met,
missed, within noise) are kept beside it. The last condition is what makes a short probe honest: above the rate a
server completes, its queue grows for as long as arrivals go on, and 24 arrivals can end before the queue breaks a
latency bound (measured: a probe at 2.83/s "met" TTFT p99 ≤ 1.5 s on a server guidellm found completes 2.37/s).

The search's budget, `max_minutes`, holds inside a probe too: past it no request is sent, the requests in flight end
(failed with the client's STOPPED_AT_LIMIT), and the probe, cut short, is neither judged nor kept: the search stops
(`complete: false`, `stopped_by: max_minutes`) with what it found, and keeps the cut probe apart (`stopped_probe`).

Probes are kept in the step's result, and in a per-user cache (QBUILD_CACHE/capacity-probes) under the identity of
everything that decides what they measure except the SLOs: the artifact, the server and its flags, the workload,
the hardware and the rate. A search under another SLO is another step, which measures only the probes it does not
find there (and starts the server only if it must measure one).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist

import numpy as np

from qbuild.base.bootstrap import LEVEL

STEPS_PER_DOUBLING = 16       # grid resolution: 2^(1/16) = 4.4 % between neighbouring rates
LOWEST_K = -8 * STEPS_PER_DOUBLING    # 1/256 requests/s: below it the artifact has no capacity worth the name
HIGHEST_K = 12 * STEPS_PER_DOUBLING   # 4096 requests/s
RESULT = "capacity.json"
SERVER_LOG = "server.log"
MORE_ROUNDS_FACTOR = 2        # a probe whose full-batch check is within noise runs up to this many times its rounds
LONE_REQUESTS = 3             # requests sent one at a time (after the warm-up) to find where the search starts
ONE_AT_A_TIME = "one-at-a-time"   # the cache entry of that measurement, beside the probes
FULL_BATCH = "full_batch_rps"     # a probe's uncertain list names the full-batch check so when it was within noise
# recipe SLO field → the probe's figure, as selection names them
SLO_FIELDS = {"ttft_p99_ms": "ttft_ms_p99", "tpot_p50_ms": "tpot_ms_p50", "itl_p99_ms": "itl_ms_p99",
              "e2e_p99_ms": "e2e_ms_p99"}


def rate_of(k: int) -> float:
    return 2 ** (k / STEPS_PER_DOUBLING)


def grid_index(rate: float) -> int:
    """The grid index of the rate nearest `rate` (in ratio)."""
    return int(round(STEPS_PER_DOUBLING * np.log2(rate)))


def judge(probe: dict, slo: dict, max_error_pct: float) -> dict:
    """A probe's verdict under `slo` (field → bound): {meets, misses, uncertain}. The pooled value decides; a bound
    whose 95 % interval straddles it is listed as within noise. Arrivals faster than the server completes requests
    with every slot busy, beyond that throughput's noise, are a miss whatever the latencies: its queue grows. Within
    its noise the latencies decide, and FULL_BATCH is listed as uncertain."""
    from qbuild.serving.confidence import verdict

    misses, uncertain = [], []
    error_pct = 100 * probe["errors"] / probe["requests"] if probe["requests"] else 100.0
    if error_pct > max_error_pct:
        misses.append(f"errors {error_pct:.1f} % > {max_error_pct:g} %")
    keeping_up = full_batch_verdict(probe)
    if keeping_up == "missed":
        misses.append(f"requests arriving at {probe['arrival_rps']:.3g}/s outpace the {probe['saturated_rps']:.3g}/s "
                      "the server completes with every slot busy: its queue grows")
    elif keeping_up == "uncertain":
        uncertain.append(FULL_BATCH)
    for field, bound in slo.items():
        value = probe.get(SLO_FIELDS[field])
        if value is None:
            misses.append(f"{field}: not measured")
            continue
        if value > bound:
            misses.append(f"{field} {value:.4g} > {bound:.4g}")
        if verdict(value, (probe.get("ci") or {}).get(SLO_FIELDS[field]), bound, "max") == "uncertain":
            uncertain.append(field)
    return {"meets": not misses, "misses": misses, "uncertain": uncertain}


def search(measure: Callable[[int], dict], slo: dict, max_error_pct: float, start_k: int | None,
           out_of_time: Callable[[], bool] = lambda: False, known: dict[int, dict] | None = None) -> dict:
    """Bracket, then bisect the grid index. `measure(k)` is the probe at rate_of(k) (measured or cached; one with
    `stopped_by` was cut short by the time limit); the result: {capacity_rps, k, concurrency, probes (in the order
    asked, each with its verdict), bracketed, complete, stopped_probe (the cut one, unjudged, or None)}. A start_k of
    None (the time ran out before a start was found) probes nothing. `known`: probes already judged (by challenge)."""
    probes: dict[int, dict] = dict(known or {})
    order: list[int] = list(probes)
    stopped: list[dict] = []

    def measured(k: int) -> bool | None:
        if k in probes:
            return probes[k]["meets"]
        p = _probe_at(measure, slo, max_error_pct, k, out_of_time)
        if p is None or p.get("stopped_by"):
            stopped.extend([p] if p else [])
            return None
        probes[k] = p
        order.append(k)
        return p["meets"]

    good, bad = None, None   # the highest index that met the SLOs, the lowest that did not
    k = start_k
    complete = start_k is not None
    while complete and (good is None or bad is None):
        ok = measured(k)
        if ok is None:
            complete = False
            break
        if ok:
            good = k
            if bad is None:
                if k + STEPS_PER_DOUBLING > HIGHEST_K:
                    break
                k += STEPS_PER_DOUBLING
        else:
            bad = k
            if good is None:
                if k - STEPS_PER_DOUBLING < LOWEST_K:
                    break
                k -= STEPS_PER_DOUBLING
    bracketed = good is not None and bad is not None
    while complete and bracketed and bad - good > 1:
        mid = (good + bad) // 2
        ok = measured(mid)
        if ok is None:
            complete = False
            break
        good, bad = (mid, bad) if ok else (good, mid)
    return _settled([probes[i] for i in order], good, bad, complete, stopped[0] if stopped else None)


def challenge(measure: Callable[[int], dict], slo: dict, max_error_pct: float, leader_k: int,
              out_of_time: Callable[[], bool] = lambda: False) -> dict:
    """Whether a server can match a leader that sustains rate_of(leader_k) and misses the next grid rate, in at most
    three probes instead of a whole search: the leader's missed rate first (met: it beats the leader, and the
    search goes on upward from there), then the leader's rate (met: a tie), then one grid step below (met: within
    the search's resolution, a tie too). Missing all three, it sustains less than rate_of(leader_k - 1): `k` None,
    `below_rps` that rate. The result has search()'s fields and `challenge`: beats | ties | below | None (cut short
    by the time limit)."""
    probes: list[dict] = []
    for k in (leader_k + 1, leader_k, leader_k - 1):
        probe = _probe_at(measure, slo, max_error_pct, k, out_of_time)
        if probe is None or probe.get("stopped_by"):
            return {**_settled(probes, None, None, complete=False, stopped=probe), "challenge": None}
        probes.append(probe)
        if not probe["meets"]:
            continue
        if k > leader_k:   # it beats the leader: the whole search, upward from the rate it met
            found = search(measure, slo, max_error_pct, k, out_of_time, known={k: probe})
            return {**found, "challenge": "beats"}
        return {**_settled(probes, k, k + 1, complete=True), "challenge": "ties"}
    return {**_settled(probes, None, leader_k - 1, complete=True), "challenge": "below",
            "below_rps": rate_of(leader_k - 1)}


def _probe_at(measure, slo: dict, max_error_pct: float, k: int, out_of_time) -> dict | None:
    """The probe at rate_of(k) with its verdict under `slo` (measure() gives it without one: a cached probe has none
    of its own); one cut short by the time limit (`stopped_by`: too few of its requests ran to judge the rate by)
    comes back unjudged; None when the time ran out before it."""
    if out_of_time():
        return None
    p = {**measure(k), "rate_rps": rate_of(k), "k": k}
    return p if p.get("stopped_by") else {**p, **judge(p, slo, max_error_pct)}


def _settled(probes: list[dict], good: int | None, bad: int | None, complete: bool, stopped: dict | None = None) -> dict:
    """A search's result: its capacity (grid index `good`, the highest met), the next rate (`bad`, the lowest missed),
    the probes in the order asked and the one the time limit cut short."""
    best = next((p for p in probes if p["k"] == good), None)
    return {"capacity_rps": rate_of(good) if good is not None else None, "k": good,
            "concurrency": best.get("mean_in_flight") if best else None,
            "next_rps": rate_of(bad) if bad is not None else None, "bracketed": good is not None and bad is not None,
            "complete": complete, "probes": probes, "stopped_probe": stopped}


def mean_in_flight(results) -> float | None:
    """The time-averaged number of requests in flight over a probe (Little's law: the sum of their durations over
    the span from the first start to the last end): the concurrency the server settled at under that rate."""
    done = [r for r in results if r.end > r.start]
    if not done:
        return None
    span = max(r.end for r in done) - min(r.start for r in done)
    return round(sum(r.end - r.start for r in done) / span, 3) if span > 0 else None


def pace(results, slots: int) -> dict:
    """How fast the server completed requests when it was full: the time during which `slots` or more requests were
    in flight (every slot of the server busy, the rest queued) and the requests that ended in it. That is its
    throughput at full batch (what guidellm's throughput benchmark measures), read from the probe's own requests:
    unlike the completions' overall pace, it does not lag the arrivals of a server that keeps up."""
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results if r.ok])
    in_flight, full_s, full_ends, last = 0, 0.0, 0, None
    # the full time splits into blocks of `slots` completions (a full spell always ends with one): the spread of the
    # blocks' times is the throughput's noise. Blocks, not single completions: the slots end in turn, so the gaps
    # between single completions vary with the slots' phases even on a server whose every request takes as long
    block, block_ends, blocks = 0.0, 0, []
    for t, step in events:
        if in_flight >= slots:
            full_s += t - last
            block += t - last
            if step < 0:
                full_ends += 1
                block_ends += 1
                if block_ends == slots:
                    blocks.append(block)
                    block, block_ends = 0.0, 0
        in_flight += step
        last = t
    span = max((r.end for r in results), default=0.0) - min((r.start for r in results), default=0.0)
    return {"full_completions": full_ends, "full_s": round(full_s, 4), "blocks": len(blocks),
            "blocks_s": round(sum(blocks), 4), "blocks_sq_s2": round(sum(b * b for b in blocks), 6),
            "span_s": round(max(span, 0.0), 4)}


# a server whose queue grows is full from the moment the queue forms; one full for less of the probe than this had
# slots idle most of it (seeded simulation, tests/test_serving_capacity.py: judging only from 40 % on, no probe at
# 80 % of capacity is rejected and 96 % at 120 % are; a few short full spells under light load read low)
FULL_SHARE_TO_JUDGE = 0.4


def saturated_rps(paces: list[dict], slots: int) -> float | None:
    """The full-batch throughput of one or more rounds (their counts over their times, summed: rounds pool as one
    longer probe would). None when the server was full for less than FULL_SHARE_TO_JUDGE of the probe, or fewer
    than `slots` requests ended while it was: that says too little of its throughput, and such a server kept up."""
    full_s, ends = sum(p["full_s"] for p in paces), sum(p["full_completions"] for p in paces)
    span = sum(p["span_s"] for p in paces)
    if ends < slots or full_s <= 0 or full_s < FULL_SHARE_TO_JUDGE * span:
        return None
    return round(ends / full_s, 4)


def saturated_ci(paces: list[dict], slots: int) -> list[float | None] | None:
    """The 95 % interval of saturated_rps (None where it is): the mean time per block of `slots` completions while
    full, ± its standard error over the blocks (the normal interval, at the level of every other interval), per
    completion, inverted. Open ([0, None]: nothing known) with fewer than two blocks, and unbounded above when the
    interval of the time reaches zero. Paces measured before blocks were kept have no interval."""
    if saturated_rps(paces, slots) is None or any("blocks" not in p for p in paces):
        return None
    n = sum(p["blocks"] for p in paces)
    if n < 2:
        return [0.0, None]
    total = sum(p["blocks_s"] for p in paces)
    var = max(sum(p["blocks_sq_s2"] for p in paces) - total ** 2 / n, 0.0) / (n - 1)
    per_completion = sum(p["full_s"] for p in paces) / sum(p["full_completions"] for p in paces)
    half = NormalDist().inv_cdf(0.5 + LEVEL / 2) * (var / n) ** 0.5 / slots
    return [round(1 / (per_completion + half), 4),
            round(1 / (per_completion - half), 4) if per_completion > half else None]


def full_batch_verdict(probe: dict) -> str:
    """Whether the server kept up with the probe's arrivals: "met" (its full-batch throughput is above the arrival
    rate beyond noise, or it was never full long enough to judge), "missed" (below it beyond noise), "uncertain" (the
    interval straddles it). Without an interval the measured value alone decides."""
    arriving, full = probe.get("arrival_rps"), probe.get("saturated_rps")
    if not arriving or full is None:
        return "met"
    from qbuild.serving.confidence import verdict

    lo, hi = probe.get("saturated_rps_ci") or (full, full)
    return verdict(full, [lo, float("inf") if hi is None else hi], arriving, "min")


def probe_seed(seed: int, k: int, r: int) -> int:
    return int(np.random.SeedSequence([seed, k - LOWEST_K, r]).generate_state(1)[0])


FAMILY = re.compile(r"^[0-9a-f]{64}$")


def _probe_root() -> Path:
    from qbuild.base.fingerprint import cache_dir

    return cache_dir() / "capacity-probes"


def _only_probes(root: Path) -> str | None:
    """An `adopt` test: the folder holds nothing but probe families of ours (made before it had a marker)."""
    foreign = sorted(e for e in os.listdir(root) if not FAMILY.match(e))
    return f"it holds {', '.join(foreign[:3])}" if foreign else None


def cached_probe(family: str, k: int | str) -> dict | None:
    """The probe at grid index `k` (or the ONE_AT_A_TIME measurement) an earlier search of `family` kept."""
    if not FAMILY.match(family):
        return None
    try:
        return json.loads((_probe_root() / family / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None


def keep_probe(family: str, k: int | str, probe: dict) -> None:
    """Keep a measured probe for searches under another SLO: written only through a root qbuild owns (its marker
    checked, no link followed), under the per-user cache."""
    from qbuild.base.owned import keep_in_cache

    if FAMILY.match(family):   # unwritten (a read-only home, a folder not ours): another SLO measures it again
        keep_in_cache(_probe_root(), "capacity-probes", f"{family}/{k}.json", json.dumps(probe).encode(),
                      adopt=_only_probes)


def run(ctx) -> dict:
    from qbuild.serving.config import ServedConfig

    p = ctx.params
    cap = p["capacity"]
    label = ctx.runtime_args.get("label", ctx.step_name)
    result = search_server(ctx, label=label, model=ctx.inputs["model"], draft=ctx.inputs.get("draft"),
                           config=ServedConfig(**p["config"]), server_name=p["server"], slots=p["slots"],
                           context=p["context"], workload=p["workload"], family=ctx.runtime_args["probe_family"],
                           search_params=cap, stop_at=time.monotonic() + cap["max_minutes"] * 60, workdir=ctx.out,
                           budget=f"max_minutes {cap['max_minutes']}", check=True)
    result["stopped_by"] = None if result["complete"] else "max_minutes"
    _write_result(ctx, label, result, cap["max_minutes"])
    return {"format": "metrics", "metrics": result}


def search_server(ctx, *, label: str, model: Path, draft: Path | None, config, server_name: str, slots: int,
                  context: int, workload: dict, family: str, search_params: dict, stop_at: float, workdir: Path,
                  budget: str, check: bool = False, challenge_k: int | None = None) -> dict:
    """The capacity search of one server (`config` on `model`), its probes read from and kept in `family`'s cache;
    the server is started only if a probe must be measured (and then served-checked when `check`), and stopped
    before this returns. `search_params`: slo, max_error_pct and start_rps (None: from the one-at-a-time rate);
    `budget`: the limit `stop_at` stands for, as the logs name it. `challenge_k`: instead of a whole search, whether
    this server matches a leader sustaining rate_of(challenge_k) (challenge())."""
    import contextlib

    from qbuild.evaluate.data import load_tokens
    from qbuild.plugins import servers
    from qbuild.serving.bench_step import _portable, _tail, check_served
    from qbuild.serving.server import running

    w, cap = workload, search_params
    server = servers.get(server_name)
    tokens, _ = load_tokens(ctx.inputs["prompts"])
    workdir.mkdir(parents=True, exist_ok=True)
    launch = server.launch(model, config, threads=ctx.threads, slots=slots, context=context, workdir=workdir,
                           log=ctx.log, draft=draft)
    log = workdir / SERVER_LOG
    started = time.monotonic()
    stack = contextlib.ExitStack()
    srv = None
    counts = {"measured": 0, "reused": 0}
    checks: list[dict | None] = []   # the served check of each server started (none when every probe was reused)

    def start_server():
        ctx.log(f"starting {launch.engine} for {label}: {shlex.join(_portable(list(launch.command), model, draft))}")
        started_srv = stack.enter_context(running(launch, log, label, ctx.runtime_args.get("ready_timeout_s", 300.0)))
        if check:
            checks.append(check_served(ctx, started_srv, server, launch, label, w["timeout_s"]))
        return started_srv

    def measure(k: int) -> dict:
        nonlocal srv
        hit = cached_probe(family, k)
        if hit is not None:
            counts["reused"] += 1
            ctx.log(f"rate {rate_of(k):.4g}/s: reused (measured by an earlier search)")
            return {**hit, "reused": True}
        if srv is None:
            srv = start_server()
        probe = measure_probe(srv.url, tokens, w, k, launch.model_name, slots, launch.ignore_eos,
                              between=srv.check_alive, stop_at=stop_at)
        counts["measured"] += 1
        if probe.get("stopped_by"):   # cut short: another search must measure it whole
            ctx.log(f"rate {rate_of(k):.4g}/s: stopped by {budget} after "
                    f"{probe['completed']} of {probe['requests']} requests sent completed; not judged, not kept")
            return probe
        ctx.log(f"rate {rate_of(k):.4g}/s: TTFT p99 {probe['ttft_ms_p99']} ms, TPOT p50 {probe['tpot_ms_p50']} ms, "
                f"{probe['errors']} errors, {probe['mean_in_flight']} in flight, full-batch throughput "
                f"{probe['saturated_rps'] or '-'} requests/s {_interval(probe.get('saturated_rps_ci'))}, "
                f"{len(probe.get('rounds') or [None])} round(s)")
        keep_probe(family, k, probe)
        return probe

    def out_of_time() -> bool:
        return time.monotonic() >= stop_at

    start = {"one_at_a_time_rps": None, "one_at_a_time_reused": None}

    def start_k() -> int | None:
        nonlocal srv
        if cap.get("start_rps") is not None:   # the schema allows any positive rate: the grid's ends bound it
            return start_index(cap["start_rps"])
        lone = cached_probe(family, ONE_AT_A_TIME)
        start["one_at_a_time_reused"] = lone is not None
        if lone is None:
            if srv is None:
                srv = start_server()
            rps = one_at_a_time_rps(srv.url, tokens, w, launch.model_name, launch.ignore_eos, stop_at)
            if rps is None:
                ctx.log(f"stopped by {budget} while sending requests one at a time")
                return None
            lone = {"rps": rps}
            keep_probe(family, ONE_AT_A_TIME, lone)
        start["one_at_a_time_rps"] = lone["rps"]
        ctx.log(f"one request at a time: {lone['rps']:.4g} requests/s; the search starts there")
        return start_index(lone["rps"])

    try:
        with stack:
            if challenge_k is not None:
                first = challenge_k + 1
                found = challenge(measure, cap["slo"], cap["max_error_pct"], challenge_k, out_of_time)
            else:
                first = start_k()
                found = search(measure, cap["slo"], cap["max_error_pct"], first, out_of_time)
            peak_rss = srv.peak_rss_bytes() if srv is not None else None
    except BaseException:
        if log.exists():
            print(f"--- {SERVER_LOG} (last lines) ---\n" + "\n".join(_tail(log, 20)), flush=True)
        raise
    return {**found, "start_rps": rate_of(first) if first is not None else None, **start, "slo": cap["slo"],
            "max_error_pct": cap["max_error_pct"], "server": server.name, "engine": launch.engine,
            "config": config.canonical(), "workload": w,
            "command": shlex.join(_portable(list(launch.command), model, draft)),
            "seconds": round(time.monotonic() - started, 1), "probes_measured": counts["measured"],
            "probes_reused": counts["reused"], "peak_rss_bytes": peak_rss,
            "served_check": checks[0] if checks else None}


def _write_result(ctx, label: str, result: dict, max_minutes) -> None:
    """The search's result file, and its one-line summary in the step's log."""
    (ctx.out / RESULT).write_text(json.dumps(result, indent=2))
    where = (f"{result['capacity_rps']} requests/s ({result['concurrency']} in flight)" if result["capacity_rps"]
             else "no rate meets the SLOs")
    ctx.log(f"capacity of {label}: {where}; {result['probes_measured']} probe(s) measured, {result['probes_reused']} reused"
            + ("" if result["complete"] else f"; stopped by max_minutes {max_minutes}"))


def _interval(ci) -> str:
    return "" if not ci else f"[{ci[0]:.4g}, {'∞' if ci[1] is None else f'{ci[1]:.4g}'}]"


def start_index(rps: float) -> int:
    """Where the search starts: the grid rate nearest `rps` (start_rps, or the one-at-a-time rate), within the
    grid's ends."""
    return min(max(grid_index(rps), LOWEST_K), HIGHEST_K)


def one_at_a_time_rps(url: str, tokens: np.ndarray, w: dict, model: str, ignore_eos: bool = True,
                      stop_at: float | None = None) -> float | None:
    """The rate at which the server completes requests sent one at a time: 1 / the median end-to-end time of
    LONE_REQUESTS requests (after `w["warmup"]`), of the workload's prompts and lengths. With conversations, a rate of
    new conversations: `turns` requests and the think times between them. None when `stop_at` (time.monotonic) came
    first."""
    import asyncio

    import httpx

    from qbuild.serving.client import _closed_loop

    conversation = w.get("conversation", {})
    turns = conversation.get("turns", 1)
    # four words of entropy where a probe's seed has three: no probe shares these prompts
    seed = int(np.random.SeedSequence([w["seed"], 0, 0, 1]).generate_state(1)[0])
    work = workload(tokens, w, LONE_REQUESTS, seed, model, ignore_eos, stop_at)

    async def lone() -> list:
        async with httpx.AsyncClient(timeout=httpx.Timeout(work.timeout_s, connect=10.0), trust_env=False) as client:
            results, _ = await _closed_loop(client, url, work, 1, 0, w["warmup"] + LONE_REQUESTS, lambda: None)
        return results[w["warmup"] * turns:]

    results = asyncio.run(lone())
    if work.past_stop() and (len(results) < LONE_REQUESTS * turns or not all(r.ok for r in results)):
        return None
    e2e = [r.e2e_s for r in results if r.ok]
    if not e2e:
        raise RuntimeError(f"none of {LONE_REQUESTS} requests sent one at a time to {url} completed")
    conversation_s = turns * float(np.median(e2e)) + (turns - 1) * conversation.get("think_s", 0.0)
    return round(1.0 / conversation_s, 4)


def measure_probe(url: str, tokens: np.ndarray, w: dict, k: int, model: str, slots: int, ignore_eos: bool = True,
                  between: Callable[[], None] = lambda: None, stop_at: float | None = None) -> dict:
    """The probe at rate_of(k): `w["rounds"]` rounds (more while its full-batch check is within noise: settled;
    workload `w` as the step's params hold it), each after its
    own warm-up, with prompts (windows of `tokens`), output lengths and arrivals seeded by the rate and the round,
    on a server running `slots` requests at once. With a conversation, the rate is of new conversations (each of
    `turns` requests, their latencies pooled). A round that `stop_at` (time.monotonic) cuts short ends the probe, as
    `stopped_by: max_minutes` with what its rounds sent."""
    turns = w.get("conversation", {}).get("turns", 1)

    def one_round(r: int) -> dict:
        seed = probe_seed(w["seed"], k, r)
        point = probe_round(url, workload(tokens, w, w["requests"], seed, model, ignore_eos, stop_at), rate_of(k),
                            seed, slots)
        between()
        return point

    # the rate the probe asks for, in requests: what a capacity at this rate would claim (the arrivals one round
    # happened to draw are faster or slower by chance; 24 Poisson arrivals vary by about 20 %)
    return settled(one_round, w["rounds"],
                   lambda rounds: {**_pooled(rounds, w["seed"], slots), "arrival_rps": round(rate_of(k) * turns, 4)})


def settled(one_round: Callable[[int], dict], rounds: int, pooled: Callable[[list[dict]], dict]) -> dict:
    """A probe of `rounds` rounds (`one_round(r)` measures round r), pooled; then one more round at a time, up to
    MORE_ROUNDS_FACTOR × `rounds`, while its full-batch check is within noise of its rate. Whether the server keeps
    up at a rate is a fact of the rate, not of any SLO, so it is settled here, in the probe every search reuses."""
    done: list[dict] = []
    while True:
        done.append(one_round(len(done)))
        if done[-1].get("stopped_by"):
            return stopped_probe(done)
        if len(done) < rounds:
            continue
        probe = pooled(done)
        if len(done) >= MORE_ROUNDS_FACTOR * rounds or full_batch_verdict(probe) != "uncertain":
            return probe


def stopped_probe(rounds: list[dict]) -> dict:
    """A probe the time limit cut short: what its rounds sent and completed, unpooled (too few requests to judge)."""
    return {"stopped_by": "max_minutes", **{n: sum(r.get(n, 0) for r in rounds) for n in
                                           ("requests", "completed", "errors", "stopped_requests")},
            "rounds": [{k: v for k, v in r.items() if k != "samples"} for r in rounds]}


def workload(tokens: np.ndarray, w: dict, requests: int, seed: int, model: str, ignore_eos: bool,
             stop_at: float | None = None):
    """`requests` conversations (one request each without turns) after `w["warmup"]`, of workload `w` as the step's
    params hold it: prompts (windows of `tokens`, after the shared prefix) and output lengths drawn from `seed`; nothing
    is sent past `stop_at`."""
    from qbuild.serving.bench_step import conversation_prompts, drawn_lengths, prompts_from
    from qbuild.serving.client import Workload

    conversation = w.get("conversation", {})
    turns = conversation.get("turns", 1)
    count = (requests + w["warmup"]) * turns
    prefix = w.get("prefix_tokens", 0)
    return Workload(prompts=conversation_prompts(prompts_from(tokens, w["input_len"], count, seed, prefix), turns,
                                                 prefix),
                    output_len=drawn_lengths(w["output_len"], count, seed + 2), requests=requests,
                    warmup=w["warmup"], timeout_s=w["timeout_s"], ignore_eos=ignore_eos, model=model, turns=turns,
                    think_s=conversation.get("think_s", 0.0), stop_at=stop_at)


def probe_round(url: str, work, rate: float, seed: int, slots: int) -> dict:
    """One round of a probe: `warmup` requests one at a time, then `requests` Poisson arrivals at `rate`; with
    `stopped_by` when the workload's stop_at cut it short."""
    import asyncio

    return asyncio.run(_probe_round(url, work, rate, seed, slots))


async def _probe_round(url: str, work, rate: float, seed: int, slots: int) -> dict:
    import httpx

    from qbuild.serving.client import STOPPED_AT_LIMIT, _closed_loop, _open_loop, summarize_point

    limits = httpx.Limits(max_connections=work.requests + 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(work.timeout_s, connect=10.0), limits=limits,
                                 trust_env=False) as client:
        warmed = []
        if work.warmup:
            warmed, _ = await _closed_loop(client, url, work, 1, 0, work.warmup, lambda: None)
        start = time.perf_counter()
        results = await _open_loop(client, url, work, rate, work.warmup, work.requests, seed, lambda: None)
        point = summarize_point(results, time.perf_counter() - start)
    stopped = [r for r in (*warmed, *results) if STOPPED_AT_LIMIT in r.error]
    if stopped or len(results) < work.requests * work.turns:   # cut short by the time limit: not a probe to judge
        return {**point, "stopped_by": "max_minutes", "stopped_requests": len(stopped)}
    point["mean_in_flight"] = mean_in_flight(results)
    point["pace"] = pace(results, slots)
    point["saturated_rps"] = saturated_rps([point["pace"]], slots)
    point["saturated_rps_ci"] = saturated_ci([point["pace"]], slots)
    return point


def _pooled(rounds: list[dict], seed: int, slots: int) -> dict:
    from qbuild.serving.confidence import combine_rounds

    if len(rounds) == 1:
        return {k: v for k, v in rounds[0].items() if k != "samples"}
    out = combine_rounds(rounds, seed)
    out["mean_in_flight"] = round(float(np.mean([r["mean_in_flight"] or 0 for r in rounds])), 3)
    out["saturated_rps"] = saturated_rps([r["pace"] for r in rounds], slots)
    out["saturated_rps_ci"] = saturated_ci([r["pace"] for r in rounds], slots)
    out.pop("samples", None)
    # per-request samples stay out of the stored probe (its figures and interval suffice); copies, as the rounds are
    # pooled again when the probe runs more
    out["rounds"] = [{k: v for k, v in r.items() if k != "samples"} for r in out["rounds"]]
    return out
