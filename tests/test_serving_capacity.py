"""Capacity search (qbuild/serving/capacity_step.py): bracket then bisect on a grid of rates, on constructed measurements
(a server whose latency grows with the rate like a queue's); `objective: max_capacity` and `target_rps` in
selection; and end to end on a real llama-server (tests marked slow: a search measures several rates)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from rich.console import Console

from qbuild.errors import RecipeError
from qbuild.planning.recipe import Selection, Serving, parse_recipe
from qbuild.results.selection import select
from qbuild.results.summary import render_selection
from qbuild.serving.capacity_step import (
    FULL_BATCH,
    MORE_ROUNDS_FACTOR,
    STEPS_PER_DOUBLING,
    full_batch_verdict,
    grid_index,
    judge,
    pace,
    rate_of,
    saturated_ci,
    saturated_rps,
    search,
    settled,
)
from qbuild.serving.client import RequestResult


def queue(saturation: float, errors_above: float | None = None):
    """A constructed server: TTFT p99 = 100 ms / (1 - rate/saturation) below saturation, a minute above it; every
    other request fails above `errors_above`."""
    asked = []

    def measure(k: int) -> dict:
        rate = rate_of(k)
        asked.append(k)
        ttft = 100 / (1 - rate / saturation) if rate < saturation else 60_000
        errors = 12 if errors_above is not None and rate > errors_above else 0
        return {"ttft_ms_p99": ttft, "tpot_ms_p50": 20.0, "requests": 24, "errors": errors,
                "mean_in_flight": round(rate * ttft / 1000, 3), "ci": {"ttft_ms_p99": [0.9 * ttft, 1.1 * ttft]}}
    return measure, asked


def test_bracket_then_bisect_finds_the_highest_grid_rate_meeting_the_slo():
    measure, asked = queue(saturation=5.3)
    found = search(measure, {"ttft_p99_ms": 500}, 1.0, grid_index(1.0))
    true = 5.3 * (1 - 100 / 500)   # TTFT p99 reaches 500 ms at 4.24 requests/s
    assert found["capacity_rps"] <= true < found["next_rps"]
    assert found["next_rps"] / found["capacity_rps"] == pytest.approx(2 ** (1 / STEPS_PER_DOUBLING), rel=1e-3)
    assert found["bracketed"] and found["complete"]
    # bracket: 1, 2, 4 met, 8 missed (doubling); then bisection of the index between 4 and 8: log2(16) = 4 probes
    assert [rate_of(k) for k in asked[:4]] == pytest.approx([1, 2, 4, 8])
    assert len(asked) == 4 + int(math.log2(STEPS_PER_DOUBLING))
    best = next(p for p in found["probes"] if p["k"] == found["k"])
    assert best["meets"] and found["concurrency"] == best["mean_in_flight"]
    assert all(p["meets"] == (p["rate_rps"] <= found["capacity_rps"]) for p in found["probes"])


def test_a_start_above_capacity_halves_down():
    measure, asked = queue(saturation=0.5)
    found = search(measure, {"ttft_p99_ms": 400}, 1.0, grid_index(4.0))
    assert [rate_of(k) for k in asked[:4]] == pytest.approx([4, 2, 1, 0.5])   # missed, missed, missed, missed
    assert found["capacity_rps"] <= 0.5 * (1 - 100 / 400) < found["next_rps"]


def test_errors_over_the_limit_are_a_miss_whatever_the_latency():
    measure, _ = queue(saturation=100.0, errors_above=3.0)
    found = search(measure, {"ttft_p99_ms": 10_000}, 1.0, grid_index(1.0))
    assert found["capacity_rps"] <= 3.0 < found["next_rps"]
    missed = next(p for p in found["probes"] if not p["meets"])
    assert missed["misses"] == ["errors 50.0 % > 1 %"]


def test_nothing_meets_the_slo():
    measure, _ = queue(saturation=5.0)
    found = search(measure, {"ttft_p99_ms": 50}, 1.0, grid_index(1.0))   # below even the idle server's 100 ms
    assert found["capacity_rps"] is None and found["concurrency"] is None and not found["bracketed"]


def test_another_slo_reuses_the_probes_it_can():
    measure, asked = queue(saturation=5.0)
    cache: dict[int, dict] = {}

    def cached(k):
        if k not in cache:
            cache[k] = measure(k)
        return cache[k]

    first = search(cached, {"ttft_p99_ms": 500}, 1.0, grid_index(1.0))
    n_first = len(asked)
    again = search(cached, {"ttft_p99_ms": 500}, 1.0, grid_index(1.0))
    assert len(asked) == n_first and again["capacity_rps"] == first["capacity_rps"]   # the same SLO: nothing new
    other = search(cached, {"ttft_p99_ms": 300}, 1.0, grid_index(1.0))   # capacity 3.33/s: same bracket 2..4
    assert len(asked) - n_first < len(other["probes"])   # 1, 2, 4 (and more) came from the first search
    assert other["capacity_rps"] <= 5.0 * (1 - 100 / 300) < other["next_rps"]


def test_a_budget_stops_the_search_with_what_it_found():
    measure, asked = queue(saturation=5.3)
    found = search(measure, {"ttft_p99_ms": 500}, 1.0, grid_index(1.0), out_of_time=lambda: len(asked) >= 5)
    assert len(asked) == 5 and not found["complete"] and found["bracketed"]
    assert 4.0 <= found["capacity_rps"] < found["next_rps"] <= 8.0


def test_judge_marks_a_bound_within_noise():
    probe = {"ttft_ms_p99": 480, "requests": 24, "errors": 0, "ci": {"ttft_ms_p99": [430, 530]}}
    assert judge(probe, {"ttft_p99_ms": 500}, 1.0) == {"meets": True, "misses": [], "uncertain": ["ttft_p99_ms"]}


def served(arrivals: list[float], service_s: float, slots: int) -> list[RequestResult]:
    """What a server with `slots` parallel slots, each taking `service_s` per request, does with requests arriving
    at `arrivals` (first come, first served): each request's send and end time."""
    free = [0.0] * slots
    out = []
    for t in arrivals:
        slot = min(range(slots), key=free.__getitem__)
        begin = max(t, free[slot])
        free[slot] = begin + service_s
        out.append(RequestResult(True, start=t, end=free[slot], ttft_s=begin - t + 0.05, e2e_s=free[slot] - t))
    return out


def short_probe(capacity_rps: float, requests: int = 24):
    """A constructed server completing `capacity_rps` requests/s (4 slots), probed with `requests` evenly spaced
    arrivals: its TTFT p99 is the queue the probe built, which stays short however far the rate is over capacity."""
    def measure(k: int) -> dict:
        rate = rate_of(k)
        results = served([i / rate for i in range(requests)], 4 / capacity_rps, 4)
        ttft = max(r.ttft_s for r in results) * 1000
        return {"ttft_ms_p99": ttft, "requests": requests, "errors": 0, "mean_in_flight": 1.0, "ci": None,
                "arrival_rps": rate, "saturated_rps": saturated_rps([pace(results, 4)], 4)}
    return measure


def test_the_full_batch_throughput_is_read_while_every_slot_is_busy():
    # 2/s arriving, 1.5 s each on 4 slots (2.67/s possible): at most 3 in flight, never full, nothing to judge by
    keeping_up = served([i * 0.5 for i in range(24)], service_s=1.5, slots=4)
    assert saturated_rps([pace(keeping_up, 4)], 4) is None
    # 2/s arriving, 2.5 s each (1.6/s possible): full from the 4th arrival on, ending 1.6 requests/s then (less the
    # time from the moment it filled to its first completion: 3 % here)
    behind = served([i * 0.5 for i in range(24)], service_s=2.5, slots=4)
    assert saturated_rps([pace(behind, 4)], 4) == pytest.approx(1.6, rel=0.05)
    # rounds pool as one longer probe: counts over times, summed
    worse = served([i * 0.5 for i in range(24)], service_s=3.0, slots=4)   # 1.33/s possible
    assert saturated_rps([pace(behind, 4), pace(worse, 4)], 4) == pytest.approx(1.45, rel=0.05)
    # ...and a server full for under 40 % of the probe is not judged: it had slots idle most of the time
    assert saturated_rps([pace(behind, 4), pace(keeping_up, 4), pace(keeping_up, 4)], 4) is None
    # fewer requests ended while full than the server has slots: too little to read its throughput from
    assert saturated_rps([pace(served([0.0, 0.1, 0.2, 0.3, 0.4], 2.5, 4), 4)], 4) is None


def test_a_rate_above_what_the_server_completes_misses_however_short_the_probe():
    # the defect this guards against (docs/serving.md, compared with guidellm): 24 arrivals above capacity end before
    # the queue breaks the TTFT bound, so latency alone lets the search report a capacity the server does not have
    measure = short_probe(capacity_rps=2.37)

    def latency_only(k):
        return {**measure(k), "saturated_rps": None}

    assert search(latency_only, {"ttft_p99_ms": 1500}, 1.0, grid_index(1.0))["capacity_rps"] > 2.37 * 1.1
    found = search(measure, {"ttft_p99_ms": 1500}, 1.0, grid_index(1.0))
    assert found["capacity_rps"] <= 2.37 < found["next_rps"]
    missed = next(p for p in found["probes"] if p["k"] == grid_index(found["next_rps"]))
    assert missed["misses"] and all("its queue grows" in m for m in missed["misses"])


def served_with_noise(rng, utilization: float, requests: int = 24):
    """A 4-slot server completing 2.37/s on average, service times ±30 %, fed `requests` Poisson arrivals."""
    service = 4 / 2.37
    rate = 2.37 * utilization
    arrivals = np.cumsum(rng.exponential(1 / rate, requests))
    return served_with(arrivals - arrivals[0], rng.uniform(0.7, 1.3, requests) * service, 4)


def served_with(arrivals, services, slots):
    free, out = [0.0] * slots, []
    for t, s in zip(arrivals, services, strict=True):
        slot = min(range(slots), key=free.__getitem__)
        free[slot] = max(t, free[slot]) + s
        out.append(RequestResult(True, start=float(t), end=free[slot]))
    return out


def full_batch_verdicts(rng, utilization: float, requests: int, rounds: int, probes: int = 200) -> dict:
    """How often the full-batch check of a probe (`rounds` rounds of `requests` Poisson arrivals, settled as
    measure_probe settles it) finds the simulated server met, missed, or within noise at `utilization`."""
    def pooled(done):
        paces = [d["pace"] for d in done]
        return {"arrival_rps": 2.37 * utilization, "saturated_rps": saturated_rps(paces, 4),
                "saturated_rps_ci": saturated_ci(paces, 4)}

    found = [full_batch_verdict(settled(lambda r: {"pace": pace(served_with_noise(rng, utilization, requests), 4)},
                                        rounds, pooled)) for _ in range(probes)]
    return {v: found.count(v) / probes for v in ("met", "missed", "uncertain")}


def test_one_probe_tells_a_server_that_keeps_up_from_one_that_cannot():
    """The check's power on probes of the default size (24 Poisson arrivals, 2 rounds, up to 4 while within noise),
    seeded: at 80 % of capacity it never rejects, at 120 % almost always; at capacity it mostly leaves the call to
    the latencies. A larger probe (40 × 3, the bench's) rejects at 110 % as well."""
    rng = np.random.default_rng(0)
    assert full_batch_verdicts(rng, 0.8, 24, 2)["missed"] == 0
    at_capacity = full_batch_verdicts(rng, 1.0, 24, 2)
    assert at_capacity["uncertain"] >= 0.75 and at_capacity["missed"] <= 0.1
    assert full_batch_verdicts(rng, 1.2, 24, 2)["missed"] >= 0.95
    assert full_batch_verdicts(rng, 1.1, 40, 3, probes=100)["missed"] >= 0.9


def test_a_probe_within_noise_of_keeping_up_runs_more_rounds_then_the_latencies_decide():
    def probe_of(ci):
        return lambda done: {"arrival_rps": 2.0, "saturated_rps": 1.9, "saturated_rps_ci": ci, "rounds": len(done)}

    assert settled(lambda r: {}, 2, probe_of([1.5, 2.4]))["rounds"] == 2 * MORE_ROUNDS_FACTOR   # within noise
    assert settled(lambda r: {}, 2, probe_of([1.8, 1.95]))["rounds"] == 2   # beyond noise: a miss, no more rounds
    probe = {"ttft_ms_p99": 300, "requests": 48, "errors": 0, "arrival_rps": 2.0, "saturated_rps": 1.9,
             "saturated_rps_ci": [1.5, 2.4]}
    assert judge(probe, {"ttft_p99_ms": 500}, 1.0) == {"meets": True, "misses": [], "uncertain": [FULL_BATCH]}
    assert not judge({**probe, "ttft_ms_p99": 600}, {"ttft_p99_ms": 500}, 1.0)["meets"]
    assert judge({**probe, "saturated_rps_ci": [1.8, 1.95]}, {"ttft_p99_ms": 500}, 1.0)["misses"] == [
        "requests arriving at 2/s outpace the 1.9/s the server completes with every slot busy: its queue grows"]
    assert judge({**probe, "saturated_rps_ci": [1.0, None]}, {"ttft_p99_ms": 500}, 1.0)["meets"]   # unbounded


def test_the_full_batch_interval_is_the_spread_of_the_time_per_completion():
    # 2/s arriving, 2.5 s each on 4 slots: completions while full come every 0.625 s, so the interval is narrow
    behind = pace(served([i * 0.5 for i in range(24)], service_s=2.5, slots=4), 4)
    lo, hi = saturated_ci([behind], 4)
    assert lo <= saturated_rps([behind], 4) <= hi and hi / lo < 1.1
    # the same server with service times ±30 %: wider, and still around the truth (4 / 2.5 = 1.6/s)
    rng = np.random.default_rng(1)
    noisy = pace(served_with([i * 0.5 for i in range(24)], rng.uniform(0.7, 1.3, 24) * 2.5, 4), 4)
    lo_n, hi_n = saturated_ci([noisy], 4)
    assert hi_n / lo_n > hi / lo and lo_n < 1.6 < hi_n
    assert saturated_ci([{**behind}], 4) is not None and saturated_ci([{k: v for k, v in behind.items()
                                                                       if k != "blocks"}], 4) is None


def test_judge_misses_arrivals_faster_than_the_full_server_completes():
    probe = {"ttft_ms_p99": 300, "requests": 24, "errors": 0, "arrival_rps": 2.8, "saturated_rps": 2.4}
    verdict = judge(probe, {"ttft_p99_ms": 500}, 1.0)
    assert not verdict["meets"] and verdict["misses"] == [
        "requests arriving at 2.8/s outpace the 2.4/s the server completes with every slot busy: its queue grows"]
    assert judge({**probe, "saturated_rps": 2.9}, {"ttft_p99_ms": 500}, 1.0)["meets"]
    assert judge({**probe, "saturated_rps": None}, {"ttft_p99_ms": 500}, 1.0)["meets"]   # never full: it kept up


def candidate(variant, config, capacity, rss, kld=0.01):
    return {"variant": variant, "status": "built", "size_bytes": 2**20, "kld": kld, "delta_ppl_pct": 1.0,
            "digest": "d" + variant, "key": "k" + variant,
            "serving": [{"config": config, "concurrency": 4, "ttft_ms_p50": 100, "ttft_ms_p99": 200, "tpot_ms_p50": 20,
                         "output_tok_s": 30.0, "errors": 0, "requests": 16, "peak_rss_mb": rss, "command": "srv"}],
            "capacity": [{"config": config, "capacity_rps": capacity, "concurrency": 2.0, "complete": True}]}


def test_max_capacity_selects_by_capacity_and_target_rps_counts_servers():
    rows = [candidate("q8_0", "default", 2.0, 300), candidate("q4km", "default", 1.5, 250)]
    out = select(Selection(objective="max_capacity", target_rps=5.0), rows, Serving(concurrency=[1, 4]))
    assert out["selected"]["variant"] == "q8_0" and out["selected"]["capacity_rps"] == 2.0
    assert "objective max_capacity prefers q8_0@default (2 requests/s vs 1.5 requests/s)" in out["rejected"][0]["why"]
    target = {r["variant"]: r for r in out["target"]["candidates"]}
    assert target["q8_0"]["servers"] == 3 and target["q4km"]["servers"] == 4   # ceil(5/2), ceil(5/1.5)
    assert out["target"]["cheapest"]["variant"] == "q8_0"
    console = Console(file=io.StringIO(), width=200)
    render_selection(out, console)
    text = console.file.getvalue()
    assert "selected: q8_0 @ default (objective max_capacity)" in text and "nothing meets" not in text
    assert "q4km @ default: 4 server(s) at 1.5 requests/s each, 1000 MiB in all" in text
    assert "cheapest: q8_0 @ default, 3 server(s)" in text


def test_equal_server_counts_go_to_the_smaller_memory_and_equal_capacity_to_tie_break():
    rows = [candidate("a", "default", 2.0, 300, kld=0.02), candidate("b", "default", 2.0, 250, kld=0.01)]
    out = select(Selection(objective="max_capacity", target_rps=3.0), rows, Serving(concurrency=[1, 4]))
    assert out["target"]["cheapest"]["variant"] == "b"   # 2 servers each: 500 MiB in all against 600
    assert out["selected"]["variant"] == "b" and out["tie"]["broken_by"] == "kld"


def test_capacity_fields_need_a_capacity_search():
    data = {"name": "t", "model": {"source": "local", "path": "/nonexistent"}, "evaluation": {"serving": {}},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}],
            "selection": {"objective": "max_capacity"}}
    with pytest.raises(RecipeError, match="evaluation.serving.capacity"):
        parse_recipe(data)
    data["evaluation"]["serving"]["capacity"] = {"slo": {}}
    with pytest.raises(RecipeError, match="ttft_p99_ms"):
        parse_recipe(data)


# --- end to end: the 2-layer SmolLM2 at Q8_0 behind a real llama-server -------------------------------------------
def capacity_recipe(model, store, ttft_p99_ms: float, **selection) -> dict:
    return {"name": "cap", "model": {"source": "local", "path": str(model)},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}],
            "evaluation": {"perplexity": None, "baseline": False,
                           "serving": {"concurrency": [1], "requests": 2, "warmup": 1, "rounds": 1, "input_len": 32,
                                       "output_len": 8, "variants": ["q8_0"],
                                       "capacity": {"slo": {"ttft_p99_ms": ttft_p99_ms}, "requests": 8, "rounds": 2,
                                                    "start_rps": 2, "max_minutes": 4}}},
            "selection": {"objective": "max_capacity", "target_rps": 50, **selection},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


@pytest.mark.slow
def test_without_a_start_rate_the_search_starts_at_the_one_at_a_time_rate(tmp_path, tiny_model_dir, monkeypatch):
    from serving_helpers import llama_server_bin

    from qbuild.serving.capacity_step import grid_index, rate_of

    from helpers import run_api, write_recipe

    monkeypatch.setenv("QBUILD_LLAMA_CPP_BIN", str(llama_server_bin()))
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))

    def recipe_for(ttft_p99_ms):
        data = capacity_recipe(tiny_model_dir, tmp_path / "store", ttft_p99_ms)
        del data["evaluation"]["serving"]["capacity"]["start_rps"]
        return write_recipe(tmp_path / "r.yaml", data)

    rc, summary = run_api(recipe_for(150))
    assert rc == 0, [s.get("error") for s in summary["steps"] if s.get("error")]
    [cap] = next(v for v in summary["variants"] if v["variant"] == "q8_0")["capacity"]
    lone = cap["one_at_a_time_rps"]
    # a 2-layer model answers an 8-token request in milliseconds: far from the 1/s a fixed start would probe first
    assert lone > 4 and cap["one_at_a_time_reused"] is False
    assert cap["probes"][0]["rate_rps"] == pytest.approx(cap["start_rps"]) == pytest.approx(rate_of(grid_index(lone)))
    assert cap["bracketed"] and cap["complete"], cap["probes"]

    rc, other = run_api(recipe_for(100))   # another SLO: the one-at-a-time rate is reused, so the start is the same
    assert rc == 0
    [cap2] = next(v for v in other["variants"] if v["variant"] == "q8_0")["capacity"]
    assert cap2["one_at_a_time_reused"] is True and cap2["one_at_a_time_rps"] == lone
    assert cap2["probes"][0]["reused"] and cap2["probes"][0]["rate_rps"] == cap["probes"][0]["rate_rps"]


@pytest.mark.slow
def test_capacity_search_on_a_real_server_reruns_nothing_and_another_slo_reuses_probes(
        tmp_path, tiny_model_dir, monkeypatch):
    from serving_helpers import llama_server_bin

    from helpers import qbuild, run_api, write_recipe

    bin_dir = llama_server_bin()
    # probes are cached per user: a cache of this test's own, so that an earlier run's probes are not found
    monkeypatch.setenv("QBUILD_LLAMA_CPP_BIN", str(bin_dir))
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path / "r.yaml", capacity_recipe(tiny_model_dir, tmp_path / "store", 150))
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    [cap] = next(v for v in summary["variants"] if v["variant"] == "q8_0")["capacity"]
    assert cap["status"] == "built" and cap["bracketed"] and cap["complete"], cap
    assert cap["probes_reused"] == 0 and cap["probes_measured"] == len(cap["probes"]) >= 3
    assert cap["next_rps"] / cap["capacity_rps"] == pytest.approx(2 ** (1 / STEPS_PER_DOUBLING), rel=1e-3)
    for p in cap["probes"]:   # each probe a measured point: 2 rounds of 8 (up to 4 while the full-batch check was
        # within noise), with an interval; the verdict follows it
        assert p["requests"] == 8 * p["rounds"] and p["ci"]["ttft_ms_p99"][0] <= p["ttft_ms_p99"] <= p["ci"]["ttft_ms_p99"][1]
        assert p["rounds"] == 4 or (p["rounds"] in (2, 3) and FULL_BATCH not in p["uncertain"])
        assert p["arrival_rps"] == pytest.approx(p["rate_rps"], rel=1e-3)
        # the server kept up: its full-batch throughput not below the arrivals beyond its noise (within noise the
        # latencies decide, and the probe says so)
        kept_up = full_batch_verdict(p) != "missed"
        assert kept_up == (p["saturated_rps"] is None or p["arrival_rps"] <= p["saturated_rps"]
                           or FULL_BATCH in p["uncertain"])
        assert p["meets"] == (p["ttft_ms_p99"] <= 150 and p["errors"] == 0 and kept_up)
        assert p["meets"] == (p["rate_rps"] <= cap["capacity_rps"] + 1e-9), cap["probes"]
    best = next(p for p in cap["probes"] if p["rate_rps"] == pytest.approx(cap["capacity_rps"], rel=1e-3))
    assert cap["concurrency"] == best["mean_in_flight"] > 0
    sel = summary["selection"]
    assert sel["selected"]["variant"] == "q8_0" and sel["selected"]["capacity_rps"] == cap["capacity_rps"]
    assert sel["target"]["cheapest"]["servers"] == math.ceil(50 / cap["capacity_rps"])

    rc, again = run_api(recipe)   # the same SLO: nothing is measured again
    assert rc == 0 and again["counts"]["built"] == 0

    # a tighter SLO is another search: it starts with the same bracket, so it reuses the probes it finds
    write_recipe(recipe, capacity_recipe(tiny_model_dir, tmp_path / "store", 100))
    rc, other = run_api(recipe)
    assert rc == 0
    [cap2] = next(v for v in other["variants"] if v["variant"] == "q8_0")["capacity"]
    assert cap2["status"] == "built" and cap2["probes_reused"] >= 1
    assert cap2["probes_reused"] + cap2["probes_measured"] == len(cap2["probes"])
    first = {p["rate_rps"]: p for p in cap["probes"]}
    for p in cap2["probes"]:
        if p["reused"]:   # the same measurement, judged under the other SLO
            assert p["ttft_ms_p99"] == first[p["rate_rps"]]["ttft_ms_p99"]

    out = qbuild("select", recipe, "--store", tmp_path / "store")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "selected: q8_0 @ default (objective max_capacity)" in out.stdout
    assert f"cheapest: q8_0 @ default, {math.ceil(50 / cap2['capacity_rps'])} server(s)" in out.stdout


def test_the_report_draws_latency_against_load_with_bands_the_slo_and_the_capacity():
    import re

    from qbuild.results.report import render_html

    measure, _ = queue(saturation=5.3)
    found = search(measure, {"ttft_p99_ms": 500}, 1.0, grid_index(1.0))
    cap = {"config": "default", "slo": {"ttft_p99_ms": 500}, **found}
    row = {**candidate("q8_0", "default", found["capacity_rps"], 300), "capacity": [cap]}
    page = render_html({"recipe": "r", "variants": [row], "steps": [], "counts": {}})
    svg = re.search(r'<svg[^>]*class="capacity".*?</svg>', page).group(0)
    assert 'data-metric="ttft_ms_p99"' in svg
    assert svg.count('class="probe"') == len(found["probes"])
    assert svg.count('data-meets="true"') == sum(p["meets"] for p in found["probes"])
    assert '<polygon class="band"' in svg and 'data-slo="ttft_p99_ms"' in svg and "SLO 500" in svg
    assert f"capacity {found['capacity_rps']:.3g}/s" in svg and 'class="capacity-point"' in svg
    assert f"capacity {found['capacity_rps']:.4g} requests/s" in page   # the figure's caption


def test_a_candidate_without_capacity_says_why():
    rows = [candidate("q8_0", "default", 2.0, 300), candidate("q4km", "default", None, 250)]
    rows[1]["capacity"][0].update(status="built", probes=[{"rate_rps": 0.25, "meets": False,
                                                           "misses": ["ttft_p99_ms 900 > 500"]}])
    out = select(Selection(objective="max_capacity"), rows, Serving(concurrency=[1, 4]))
    assert out["selected"]["variant"] == "q8_0"
    assert out["rejected"][0]["why"] == ("meets every bound, but objective max_capacity cannot rank it: no rate met "
                                         "the capacity SLOs (at 0.25 requests/s: ttft_p99_ms 900 > 500)")


def test_the_run_prints_one_line_per_capacity_search():
    from qbuild.results.summary import capacity_lines

    measure, _ = queue(saturation=5.3)
    found = search(measure, {"ttft_p99_ms": 500}, 1.0, grid_index(1.0))
    done = {"config": "default", "status": "built", "slo": {"ttft_p99_ms": 500}, "max_error_pct": 1.0,
            "probes_reused": 3, **found}
    failed = {"config": "kv8", "status": "failed", "error": "llama.cpp server for q8_0 exited", "capacity_rps": None,
              "slo": {"ttft_p99_ms": 500}, "max_error_pct": 1.0, "probes": []}
    stopped = {"config": "big", "status": "built", "capacity_rps": None, "stopped_by": "max_minutes",
               "slo": {"ttft_p99_ms": 500}, "max_error_pct": 1.0, "probes": []}
    lines = capacity_lines({"variants": [{"variant": "q8_0", "capacity": [done, failed, stopped]}]})
    assert lines == [f"capacity q8_0 @ default (ttft_p99_ms ≤ 500, errors ≤ 1.0 %): {found['capacity_rps']:.4g} "
                     f"requests/s ({found['concurrency']} in flight; {found['next_rps']:.4g}/s missed); "
                     f"{len(found['probes'])} probes, 3 reused",
                     "capacity q8_0 @ kv8 (ttft_p99_ms ≤ 500, errors ≤ 1.0 %): not found (failed: llama.cpp server "
                     "for q8_0 exited)",
                     # a search its time limit cut short says so, not that no rate meets the SLOs
                     "capacity q8_0 @ big (ttft_p99_ms ≤ 500, errors ≤ 1.0 %): not found: stopped by max_minutes "
                     "before a rate met the SLOs"]


def test_kept_probes_are_written_only_into_a_folder_qbuild_owns(tmp_path, monkeypatch):
    """The per-user probe cache goes through the guarded helper: a round trip works, a family folder that is a link
    to elsewhere is never written through, and a folder of someone else's files is not adopted."""
    from qbuild.serving.capacity_step import cached_probe, keep_probe

    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))
    family, other = "a" * 64, "b" * 64
    keep_probe(family, 3, {"rate": 1.5})
    assert cached_probe(family, 3) == {"rate": 1.5} and cached_probe(family, 4) is None
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "cache" / "capacity-probes" / other).symlink_to(outside)
    keep_probe(other, 1, {"rate": 2.0})
    assert list(outside.iterdir()) == []
    keep_probe("../../escape", 1, {"rate": 2.0})   # not a family name: nothing written anywhere
    assert not (tmp_path / "escape").exists()
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "foreign"))
    (tmp_path / "foreign" / "capacity-probes").mkdir(parents=True)
    (tmp_path / "foreign" / "capacity-probes" / "notes.txt").write_text("mine")
    keep_probe(family, 3, {"rate": 1.5})
    assert sorted(p.name for p in (tmp_path / "foreign" / "capacity-probes").iterdir()) == ["notes.txt"]


def test_a_conversation_makes_each_probe_arrival_a_conversation(monkeypatch):
    """With `conversation`, a probe's open-loop arrivals start conversations: the workload it sends carries the turns
    and think time, `turns` prompts per conversation (the shared prefix on each first turn only)."""
    from qbuild.serving import capacity_step

    sent = []
    monkeypatch.setattr(capacity_step, "probe_round", lambda url, work, rate, seed, slots: sent.append(work) or {
        "requests": 1, "completed": 1, "errors": 0, "ttft_ms_p99": 1.0, "mean_in_flight": 1.0})
    tokens = np.arange(5000)   # the prefix (the last 8 tokens) appears in no window
    w = {"requests": 4, "warmup": 1, "rounds": 1, "seed": 0, "input_len": 16, "output_len": 4, "timeout_s": 5,
         "prefix_tokens": 8, "conversation": {"turns": 3, "think_s": 0.5}}
    probe = capacity_step.measure_probe("http://127.0.0.1:1", tokens, w, 0, "m", slots=4)
    [work] = sent
    assert probe["arrival_rps"] == 3.0   # 1 conversation/s of 3 turns: what the full server must complete
    assert (work.turns, work.think_s, work.requests, work.warmup) == (3, 0.5, 4, 1)
    assert len(work.prompts) == (4 + 1) * 3
    prefix = tokens[-8:].tolist()
    assert all((p[:8] == prefix) == (i % 3 == 0) for i, p in enumerate(work.prompts))
    assert [len(p) for p in work.prompts[:3]] == [24, 16, 16]



@pytest.mark.slow
def test_capacity_search_with_conversations_on_a_real_server(tmp_path, tiny_model_dir, monkeypatch):
    """Each probe's arrivals are conversations of 2 turns (token-id prompts: the second turn appends the first's
    output through llama-server's /tokenize); every request completes, and the capacity is in conversations/s."""
    from serving_helpers import llama_server_bin

    from helpers import run_api, write_recipe

    monkeypatch.setenv("QBUILD_LLAMA_CPP_BIN", str(llama_server_bin()))
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))
    data = capacity_recipe(tiny_model_dir, tmp_path / "store", 400)
    serving = data["evaluation"]["serving"]
    serving["conversation"] = {"turns": 2}
    serving["capacity"].update({"requests": 4, "rounds": 1, "max_minutes": 3})
    rc, summary = run_api(write_recipe(tmp_path / "r.yaml", data))
    assert rc == 0, summary["steps"]
    [cap] = next(v for v in summary["variants"] if v["variant"] == "q8_0")["capacity"]
    assert cap["probes"] and cap["capacity_rps"]
    for p in cap["probes"]:   # 4 conversations of 2 turns a round, every one answered
        assert p["requests"] == 8 * p["rounds"] and p["errors"] == 0, p
