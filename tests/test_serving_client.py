"""The streaming load generator against `guidellm mock-server` (guidellm 0.8: an OpenAI-compatible stand-in with set
TTFT and inter-token latency, run without --processor), started and stopped by qbuild's own server lifecycle: the
numbers the client reports are the latencies the stand-in was told to produce."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[1]
TTFT_MS, ITL_MS = 120.0, 15.0


def guidellm() -> str | None:
    local = REPO / ".venv-guidellm" / "bin" / "guidellm"
    return str(local) if local.is_file() else shutil.which("guidellm")


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory):
    from qbuild.serving.server import ServerLaunch, running

    exe = guidellm()
    if exe is None:
        pytest.skip("guidellm is not installed (scripts/install.sh dev puts it in .venv-guidellm)")
    launch = ServerLaunch((exe, "mock-server", "--host", "127.0.0.1", "--port", "{port}", "--model", "mock",
                           "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS)), engine="guidellm-mock",
                          model_name="mock", ready_path="/health")
    with running(launch, tmp_path_factory.mktemp("mock") / "mock.log", "stand-in", ready_timeout_s=180) as srv:
        yield srv


def work(n: int, output_len: int = 10, warmup: int = 1):
    from qbuild.serving.client import Workload

    return Workload(prompts=[f"prompt number {i} about the standard library" for i in range(n + warmup)],
                    output_len=output_len, requests=n, warmup=warmup, timeout_s=30, model="mock")


def test_latencies_are_what_the_stand_in_was_told(mock_server):
    from qbuild.serving.client import sweep

    points = sweep(mock_server.url, work(8), [1, 4], between=mock_server.check_alive)
    one, four = points
    for p in points:
        assert p["errors"] == 0 and p["completed"] == 8
        # never faster than the stand-in's own delays; slower only by HTTP and scheduling (generous: 2 busy cores)
        assert TTFT_MS - 5 <= p["ttft_ms_p50"] <= TTFT_MS + 120
        assert ITL_MS - 3 <= p["tpot_ms_p50"] <= ITL_MS + 15 and ITL_MS - 3 <= p["itl_ms_p50"] <= ITL_MS + 15
        assert p["ttft_ms_p50"] <= p["ttft_ms_p90"] <= p["ttft_ms_p99"]
        assert p["e2e_ms_p50"] == pytest.approx(p["ttft_ms_p50"] + 9 * p["tpot_ms_p50"], rel=0.25)
        assert p["output_tok_s"] == pytest.approx(10 * p["requests_s"], rel=1e-3)   # 10 tokens streamed each
    # the stand-in serves requests in parallel: 4 in flight → about 4 times the requests per second
    assert four["requests_s"] == pytest.approx(4 * one["requests_s"], rel=0.2)


def test_time_spent_in_the_client_before_the_request_is_sent_is_not_latency(mock_server):
    """Two requests through a client pool of one connection: the second waits in the client until the first has
    finished (as a loaded client would), but its TTFT counts from when it went onto the wire, as guidellm's does."""
    import asyncio

    import httpx

    from qbuild.serving.client import one_request

    async def go():
        async with httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=1)) as client:
            return await asyncio.gather(*(one_request(client, mock_server.url, i, work(2)) for i in range(2)))

    asked = time.perf_counter()
    first, second = asyncio.run(go())
    assert first.ok and second.ok
    assert second.start - asked >= TTFT_MS / 1000 + 9 * ITL_MS / 1000 - 0.02   # it left after the first ended
    for r in (first, second):
        assert TTFT_MS - 5 <= r.ttft_s * 1000 <= TTFT_MS + 120


def test_rampup_spreads_the_first_requests_and_the_warm_up_leads_into_the_measured_ones(mock_server):
    import asyncio

    import httpx

    from qbuild.serving.client import _closed_loop

    async def run(rampup_s):
        async with httpx.AsyncClient(trust_env=False) as client:
            # 30 tokens: a request (120 + 29 × 15 ms) outlasts the ramp-up, so requests 1..4 are the streams' first
            return await _closed_loop(client, mock_server.url, work(8, output_len=30), 4, 0, 8, lambda: None,
                                      rampup_s)

    (together, _), (spread, _) = asyncio.run(run(0.0)), asyncio.run(run(0.4))
    assert all(r.ok for r in together + spread)
    offsets = lambda rs: [r.start - rs[0].start for r in rs[:4]]   # the four streams' first requests
    assert max(offsets(together)) < 0.1
    assert offsets(spread) == pytest.approx([0.0, 0.1, 0.2, 0.3], abs=0.05)
    # closed loop: each stream sends its next request as its last one ends, so requests 5..8 follow 1..4 directly
    for first, nxt in zip(spread[:4], spread[4:], strict=True):
        assert 0 <= nxt.start - first.end < 0.05


def test_a_ramp_up_about_as_long_as_the_run_still_gives_its_rate(mock_server):
    """Short requests and a long ramp-up: the first stream has done most of the work before the last one starts,
    so every stream is busy at once only for an instant. The rate comes from the whole span then, not from that
    instant (which gave 0 tok/s)."""
    from dataclasses import replace

    from qbuild.serving.client import sweep

    per_request_s = (TTFT_MS + ITL_MS) / 1000
    for n in range(11, 17):   # the queue runs out at, or just after, the last stream's start
        [p] = sweep(mock_server.url, replace(work(n, output_len=2, warmup=1), rampup_s=1.2), [4])
        assert p["errors"] == 0
        # never more than 4 streams' worth, and not far below what one stream alone delivers
        assert 2 / per_request_s * 0.5 < p["output_tok_s"] < 4 * 2 / per_request_s, (n, p["output_tok_s"])


def test_each_request_asks_for_its_own_output_length(mock_server):
    from dataclasses import replace

    from qbuild.serving.client import sweep

    lengths = [3, 9, 5, 12, 7, 4, 10, 6, 8]   # warm-up's first, then the 8 measured ones, by index
    [p] = sweep(mock_server.url, replace(work(8), output_len=lengths), [2])
    assert p["errors"] == 0 and p["completed"] == 8
    # every request streamed exactly what it asked for (ignore_eos): the tokens add up to the measured ones' lengths
    assert p["output_tok_s"] * p["seconds"] == pytest.approx(sum(lengths[1:]), rel=0.25)
    assert p["output_tok_s"] / p["requests_s"] == pytest.approx(sum(lengths[1:]) / 8, rel=0.25)


def test_poisson_arrivals_follow_the_rate(mock_server):
    from qbuild.serving.client import sweep

    rate = 10.0
    [p] = sweep(mock_server.url, work(30), [], request_rates=[rate], seed=3)
    assert p["request_rate"] == rate and p["errors"] == 0 and p["completed"] == 30
    # 30 arrivals at 10/s take about 3 s (+ the last request's own latency): the measured rate is near 10/s
    assert p["requests_s"] == pytest.approx(rate, rel=0.4)


def test_goodput_counts_requests_within_the_slos(mock_server):
    from qbuild.serving.client import goodput, sweep

    [p] = sweep(mock_server.url, work(6), [2])
    assert goodput(p, ttft_ms=10_000, tpot_ms=10_000) == pytest.approx(p["requests_s"], rel=1e-3)
    assert goodput(p, ttft_ms=1, tpot_ms=None) == 0


def test_a_dead_server_is_counted_as_errors_not_a_hang():
    from qbuild.serving.client import sweep
    from qbuild.serving.server import free_port

    started = time.monotonic()
    [p] = sweep(f"http://127.0.0.1:{free_port()}", work(5), [2])
    assert p["errors"] == 5 and p["completed"] == 0 and "Connect" in p["first_error"]
    assert time.monotonic() - started < 20
