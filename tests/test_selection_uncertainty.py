"""`selection:` with the noise in it, on constructed measurements whose points carry 95 % intervals (as a serving
step measured in rounds stores them): a bound is met, missed or within noise (`on_uncertain` says how to read it);
the max_throughput objective compares intervals, and overlapping ones are a tie broken by `tie_break`, the same way
whatever the order of the candidates."""

from __future__ import annotations

import io
import itertools

import pytest
from rich.console import Console

from qbuild.errors import RecipeError
from qbuild.planning.recipe import Selection, Serving, parse_recipe
from qbuild.results.selection import select, verdict
from qbuild.results.summary import render_selection

SERVING = Serving(concurrency=[1, 4])


def point(config, tok_s, tok_ci, ttft99, ttft_ci, tpot50=30.0, rss=200.0):
    return {"config": config, "concurrency": 4, "output_tok_s": tok_s, "ttft_ms_p99": ttft99, "ttft_ms_p50": ttft99 / 2,
            "tpot_ms_p50": tpot50, "requests_s": tok_s / 32, "errors": 0, "requests": 48, "peak_rss_mb": rss,
            "command": f"llama-server --model {config}.gguf",
            "ci": {"output_tok_s": tok_ci, "ttft_ms_p99": ttft_ci, "tpot_ms_p50": [tpot50 - 1, tpot50 + 1]},
            "rounds": [{"output_tok_s": tok_s - 1}, {"output_tok_s": tok_s}, {"output_tok_s": tok_s + 1}]}


def row(variant, size_mb, kld, points):
    return {"variant": variant, "status": "built", "size_bytes": int(size_mb * 2**20), "kld": kld,
            "delta_ppl_pct": kld * 100, "serving": points, "digest": "d" + variant, "key": "k" + variant}


def test_verdicts():
    assert verdict(90, [80, 99], 100, "max") == "met"
    assert verdict(110, [101, 120], 100, "max") == "missed"
    assert verdict(101, [95, 107], 100, "max") == "uncertain" == verdict(99, [95, 107], 100, "max")
    assert verdict(40, [36, 44], 35, "min") == "met" and verdict(30, [28, 34], 35, "min") == "missed"
    assert verdict(34, [30, 38], 35, "min") == "uncertain"
    assert verdict(101, None, 100, "max") == "missed" and verdict(100, None, 100, "max") == "met"   # no rounds


# q4km misses TTFT p99 ≤ 2500 by 10 ms (0.4 %), less than its interval's half-width; q8_0 meets it outright
NEAR_MISS = [row("q8_0", 144, 0.004, [point("default", 36.6, [35.0, 38.1], 1061, [980, 1150])]),
             row("q4km", 105, 0.058, [point("default", 45.0, [43.0, 47.0], 2510, [2380, 2650])])]


def test_a_bound_missed_by_less_than_the_noise_is_uncertain_and_rejected_by_default():
    out = select(Selection(ttft_p99_ms=2500), NEAR_MISS, SERVING)
    assert out["on_uncertain"] == "reject"
    assert out["selected"]["variant"] == "q8_0" and out["tie"] is None
    (q4,) = out["rejected"]
    assert q4["slo"]["ttft_p99_ms"] == {"value": 2510, "ci": [2380, 2650], "bound": 2500.0, "concurrency": 4,
                                        "verdict": "uncertain"}
    assert q4["why"] == ("ttft_p99_ms 2510 [2380, 2650] ms at concurrency 4 straddles 2500: within noise "
                         "(on_uncertain: reject)")
    assert out["selected"]["slo"]["ttft_p99_ms"]["verdict"] == "met" and out["selected"]["uncertain"] == []


def test_on_uncertain_accept_lets_it_pass_and_says_so():
    out = select(Selection(ttft_p99_ms=2500, on_uncertain="accept"), NEAR_MISS, SERVING)
    assert out["selected"]["variant"] == "q4km"   # the faster one, its TTFT bound within noise
    assert out["selected"]["uncertain"] == ["ttft_p99_ms 2510 [2380, 2650] ms at concurrency 4 straddles 2500: "
                                            "within noise"]
    console_out = io.StringIO()
    render_selection(out, Console(file=console_out, width=300))
    assert "accepted within noise (on_uncertain: accept): ttft_p99_ms 2510 [2380, 2650]" in console_out.getvalue()


def test_a_bound_missed_beyond_the_noise_is_a_miss_either_way():
    rows = [row("q4km", 105, 0.058, [point("default", 45.0, [43.0, 47.0], 2900, [2700, 3100])])]
    for how in ("reject", "accept"):
        out = select(Selection(ttft_p99_ms=2500, on_uncertain=how), rows, SERVING)
        assert out["selected"] is None
        assert out["rejected"][0]["why"] == "ttft_p99_ms 2900 [2700, 3100] ms at concurrency 4 > 2500 (+400 ms, 16 %)"


def test_a_clear_winner_is_chosen_outright():
    rows = [row("q8_0", 144, 0.004, [point("default", 36.6, [35.0, 38.1], 1061, [980, 1150])]),
            row("q4km", 105, 0.058, [point("default", 45.0, [43.0, 47.0], 1309, [1200, 1400])])]
    out = select(Selection(ttft_p99_ms=2500), rows, SERVING)
    assert out["selected"]["variant"] == "q4km" and out["tie"] is None
    assert out["selected"]["output_tok_s_ci"] == [43.0, 47.0] and len(out["selected"]["rounds"]) == 3
    assert out["rejected"][0]["why"] == ("meets every bound; objective max_throughput prefers q4km@default "
                                         "(45 [43, 47] tok/s vs 36.6 [35, 38.1] tok/s)")


# the demo's case: q8_0 @ kv8 measured faster than q8_0 @ default, but within each other's noise
TIED = [row("q8_0", 144, 0.0044, [point("default", 36.6, [35.0, 38.1], 1061, [980, 1150], rss=317),
                                  dict(point("kv8", 38.0, [36.2, 39.6], 1105, [1000, 1200], rss=254), kld=0.0045)]),
        row("q4km", 105, 0.058, [point("default", 30.0, [29.0, 31.0], 1309, [1200, 1400], rss=284)])]


def test_overlapping_intervals_are_a_tie_broken_by_the_declared_order():
    out = select(Selection(ttft_p99_ms=2500), TIED, SERVING)
    # lower KLD first: q8_0 @ default (0.0044) over the faster-measured q8_0 @ kv8 (0.0045, under its q8_0 cache)
    assert (out["selected"]["variant"], out["selected"]["config"]) == ("q8_0", "default")
    assert out["tie"]["broken_by"] == "kld" and out["tie_break"] == ["kld", "memory", "size"]
    assert out["tie"]["candidates"] == [
        {"variant": "q8_0", "config": "default", "output_tok_s": 36.6, "ci": [35.0, 38.1]},
        {"variant": "q8_0", "config": "kv8", "output_tok_s": 38.0, "ci": [36.2, 39.6]}]
    why = {(r["variant"], r["config"]): r["why"] for r in out["rejected"]}
    assert why[("q8_0", "kv8")] == ("meets every bound; tied with q8_0@default on objective max_throughput "
                                    "(36.6 [35, 38.1] tok/s vs 38 [36.2, 39.6] tok/s: the intervals overlap), "
                                    "broken by lower KLD (KLD 0.0044 vs KLD 0.0045)")
    assert why[("q4km", "default")].startswith("meets every bound; objective max_throughput prefers q8_0@default")
    console_out = io.StringIO()
    render_selection(out, Console(file=console_out, width=300))
    assert ("tie: q8_0@default 36.6 [35, 38.1] and q8_0@kv8 38 [36.2, 39.6] tok/s overlap; broken by lower KLD "
            "(KLD 0.0044 vs KLD 0.0045) (tie_break: kld, memory, size): q8_0@default") in console_out.getvalue()
    # another declared order: the smaller server first
    by_memory = select(Selection(ttft_p99_ms=2500, tie_break=["memory", "kld"]), TIED, SERVING)
    assert by_memory["selected"]["config"] == "kv8" and by_memory["tie"]["broken_by"] == "memory"


def test_a_tie_is_broken_the_same_way_whatever_the_order():
    outcomes = set()
    for rows in itertools.permutations(TIED):
        for points in itertools.permutations(rows[0]["serving"]):
            shuffled = [dict(rows[0], serving=list(points)), *rows[1:]]
            out = select(Selection(ttft_p99_ms=2500), shuffled, SERVING)
            outcomes.add((out["selected"]["config"], out["tie"]["broken_by"],
                          tuple((c["variant"], c["config"]) for c in out["tie"]["candidates"])))
    assert outcomes == {("default", "kld", (("q8_0", "default"), ("q8_0", "kv8")))}


def test_equal_on_every_tie_break_the_higher_measured_figure_decides():
    same = [row("a", 100, 0.01, [point("default", 36.6, [35.0, 38.1], 1000, [900, 1100])]),
            row("b", 100, 0.01, [point("default", 37.0, [35.5, 38.5], 1000, [900, 1100])])]
    out = select(Selection(ttft_p99_ms=2500), same, SERVING)
    assert out["selected"]["variant"] == "b" and out["tie"]["broken_by"] == "output_tok_s"


def test_measure_more_needs_serving_and_rejects_what_stays_in_doubt():
    data = {"name": "t", "model": {"source": "local", "path": "/nonexistent"}, "evaluation": {},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}],
            "selection": {"objective": "min_size", "on_uncertain": "measure_more"}}
    with pytest.raises(RecipeError, match="on_uncertain: measure_more"):
        parse_recipe(data)
    rows = [row("a", 100, 0.01, [point("default", 30.0, [29.0, 31.0], 2510, [2380, 2650])])]
    out = select(Selection(ttft_p99_ms=2500, on_uncertain="measure_more"), rows, SERVING)
    assert out["selected"] is None and out["rejected"][0]["why"].endswith("within noise (on_uncertain: measure_more)")
