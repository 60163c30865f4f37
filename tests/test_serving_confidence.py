"""A serving point measured in rounds (qbuild.serving.confidence): pooled figures, every round kept, and seeded
bootstrap intervals that widen with the spread between rounds; from rounds the real client summarized."""

from __future__ import annotations

import numpy as np
import pytest

from qbuild.serving.client import RequestResult, summarize_point
from qbuild.serving.confidence import CI_FIELDS, combine_rounds, intervals


def a_round(ttft_s: float, itl_s: float, n: int = 16, tokens: int = 8, seconds: float = 10.0, jitter: float = 0.02,
            seed: int = 0) -> dict:
    """A round summarized by the client from n requests around the given TTFT and ITL (seeded jitter)."""
    rng = np.random.default_rng(seed)
    results = []
    for _ in range(n):
        ttft = ttft_s * (1 + jitter * rng.standard_normal())
        gaps = list(itl_s * (1 + jitter * rng.standard_normal(tokens - 1)))
        results.append(RequestResult(True, ttft_s=ttft, e2e_s=ttft + sum(gaps), itl_s=gaps, output_tokens=tokens))
    return summarize_point(results, seconds)


def test_a_point_pools_its_rounds_and_keeps_each():
    rounds = [a_round(0.5, 0.025, seed=1), a_round(0.6, 0.030, seed=2), a_round(0.55, 0.027, seed=3)]
    point = combine_rounds(rounds, seed=0)
    ttft = [v for r in rounds for v in r["samples"]["ttft_ms"]]
    gaps = [g for r in rounds for req in r["samples"]["itl_ms"] for g in req]
    assert point["ttft_ms_p50"] == pytest.approx(np.percentile(ttft, 50), abs=1e-3)
    assert point["ttft_ms_p99"] == pytest.approx(np.percentile(ttft, 99), abs=1e-3)
    assert point["itl_ms_p99"] == pytest.approx(np.percentile(gaps, 99), abs=1e-3)
    assert point["output_tok_s"] == pytest.approx(np.mean([r["output_tok_s"] for r in rounds]), abs=1e-3)
    assert point["requests"] == point["completed"] == 48 and point["errors"] == 0 and point["seconds"] == 30
    assert len(point["samples"]["ttft_ms"]) == 48   # goodput: every round's requests over every round's seconds
    assert point["rounds"] == rounds


def test_every_interval_holds_its_figure_and_is_seeded():
    rounds = [a_round(0.5, 0.025, seed=1, seconds=10), a_round(0.6, 0.030, seed=2, seconds=11),
              a_round(0.55, 0.027, seed=3, seconds=9)]
    point = combine_rounds(rounds, seed=7)
    assert set(point["ci"]) == set(CI_FIELDS)
    for field, (lo, hi) in point["ci"].items():
        assert lo <= point[field] <= hi, field
        assert lo < hi, field
    assert combine_rounds(rounds, seed=7)["ci"] == point["ci"]   # the same stored rounds, the same intervals
    assert intervals(rounds, seed=8) != point["ci"]


def test_the_spread_between_rounds_widens_the_interval():
    """Rounds that agree give a narrow interval; rounds that differ (a busy machine during one) a wide one, though
    each round alone is just as tight: rounds, not requests, are what is resampled."""
    steady = [a_round(0.5, 0.025, seed=s, seconds=10) for s in (1, 2, 3)]
    shifted = [a_round(t, 0.025, seed=s, seconds=sec) for s, t, sec in ((1, 0.5, 10), (2, 0.8, 14), (3, 0.5, 10))]
    narrow, wide = intervals(steady, seed=0), intervals(shifted, seed=0)
    for field in ("ttft_ms_p50", "output_tok_s"):
        assert wide[field][1] - wide[field][0] > 3 * (narrow[field][1] - narrow[field][0]), field
    # the ITL of those rounds did not move: its interval does not widen
    assert wide["itl_ms_p50"][1] - wide["itl_ms_p50"][0] < 2 * (narrow["itl_ms_p50"][1] - narrow["itl_ms_p50"][0])


def test_one_round_has_no_interval():
    assert intervals([a_round(0.5, 0.025)], seed=0) is None


def test_a_figure_nothing_measured_has_no_interval():
    """Requests that streamed one token have no TPOT or ITL: no interval for those, the rest still has one."""
    one_token = [summarize_point([RequestResult(True, ttft_s=0.1 * k, e2e_s=0.1 * k, output_tokens=1)
                                  for k in range(1, 5)], 1.0 + s) for s in range(3)]
    ci = intervals(one_token, seed=0)
    assert ci["tpot_ms_p50"] is None and ci["itl_ms_p99"] is None
    assert ci["ttft_ms_p50"] is not None and ci["output_tok_s"] is not None


def test_intervals_are_shown_in_the_table_the_report_and_the_model_card():
    import io

    from rich.console import Console

    from qbuild.artifacts.modelcard import render_model_card
    from qbuild.results.report import render_html
    from qbuild.results.summary import render_serving

    rounds = [a_round(0.5, 0.025, seed=1, seconds=10), a_round(0.6, 0.030, seed=2, seconds=11),
              a_round(0.55, 0.027, seed=3, seconds=9)]
    point = {"config": "default", "concurrency": 4, **combine_rounds(rounds, seed=0), "peak_rss_mb": 200.0,
             "goodput_requests_s": None}
    lo, hi = point["ci"]["ttft_ms_p99"]
    row = {"variant": "q8_0", "status": "built", "size_bytes": 2**20, "serving": [point], "key": "k", "digest": "d"}
    out = io.StringIO()
    render_serving({"variants": [row]}, Console(file=out, width=400))
    assert f"{point['ttft_ms_p99']:.1f} ±{(hi - lo) / 2:.1f}" in out.getvalue()
    assert "± half the 95 % interval over 3 rounds" in out.getvalue()
    card = render_model_card({"format": "gguf", "files": [{"path": "model.gguf", "size": 10}]}, row)
    assert f"| {point['ttft_ms_p99']:.1f} ±{(hi - lo) / 2:.1f} |" in card and "measured in 3 independent rounds" in card
    page = render_html({"recipe": "r", "variants": [row], "steps": [], "counts": {}})
    assert f"<td>{point['ttft_ms_p99']:.1f} [{lo:.1f}, {hi:.1f}]</td>" in page


def test_a_conversation_points_turns_pool_over_its_rounds():
    """Rounds of conversations (qbuild.serving.client's by_turn): the point's turns pool every round's requests."""
    def round_of(ttft_by_turn: list[float], n: int = 4) -> dict:
        results = [RequestResult(True, ttft_s=t * (1 + 0.01 * k), e2e_s=t + 0.1, itl_s=[0.05, 0.05], output_tokens=3,
                                 turn=turn, prompt_tokens=20 + 30 * turn)
                   for k in range(n) for turn, t in enumerate(ttft_by_turn)]
        return summarize_point(results, 5.0)

    rounds = [round_of([0.4, 0.2, 0.25]), round_of([0.5, 0.3, 0.35])]
    assert [t["completed"] for t in rounds[0]["by_turn"]] == [4, 4, 4]
    point = combine_rounds(rounds, seed=0)
    assert [t["turn"] for t in point["by_turn"]] == [1, 2, 3] and [t["completed"] for t in point["by_turn"]] == [8] * 3
    assert [t["prompt_tokens_mean"] for t in point["by_turn"]] == [20, 50, 80]
    first = [v for r in rounds for v, turn in zip(r["samples"]["ttft_ms"], r["samples"]["turn"], strict=True)
             if turn == 0]
    assert point["by_turn"][0]["ttft_ms_p50"] == pytest.approx(np.percentile(first, 50), abs=1e-3)
    assert "by_turn" not in combine_rounds([a_round(0.5, 0.025, seed=1), a_round(0.6, 0.03, seed=2)], seed=0)
