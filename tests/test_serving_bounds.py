"""What a server answers cannot stall or grow a serving step (issue 46, items 8, 9, 10 and 13), against a stand-in on
127.0.0.1 that each test starts and stops: a server that keeps streaming past the request's deadline, one that sends
one endless line or an endless error body, one whose answer is malformed, and a capacity step whose probe its time
limit cuts short or whose start rate lies below the grid. Every stand-in stops by itself (a time or byte bound) and is
shut down by its test."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("httpx")

from qbuild.serving.client import MAX_LINE_BYTES, Workload, stream_byte_limit, sweep

ENDLESS_BYTES = 128 << 20   # what an "endless" answer sends at most: far past every bound, and it still ends
STAND_IN_SECONDS = 8.0      # how long a stand-in that keeps streaming goes on at most


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with self.server.lock:
            index = len(self.server.seen)
            self.server.seen.append((self.path, body))
        try:
            self.server.answer(self, index)
        except OSError:   # the client closed the connection: what a bound is meant to do
            self.server.cut.set()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def stand_in(answer):
    """An HTTP server on 127.0.0.1 whose every POST is `answer(handler, index)` (index: the requests before it)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.answer, server.seen, server.lock, server.cut, server.sent = answer, [], threading.Lock(), threading.Event(), 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def sse_head(h, status: int = 200, kind: str = "text/event-stream") -> None:
    h.send_response(status)
    h.send_header("Content-Type", kind)
    h.end_headers()


def send(h, data: str) -> None:
    h.wfile.write(f"data: {data}\n\n".encode())
    h.wfile.flush()


TOKEN = json.dumps({"choices": [{"text": "a", "index": 0, "finish_reason": None}]})


def well_formed(h, tokens: int = 4, gap_s: float = 0.0, usage: str | None = None) -> None:
    """A completion as llama-server streams one: a chunk per token, the finish, the usage, [DONE]."""
    sse_head(h)
    for _ in range(tokens):
        send(h, TOKEN)
        time.sleep(gap_s)
    send(h, json.dumps({"choices": [{"text": "", "index": 0, "finish_reason": "length"}]}))
    send(h, usage or json.dumps({"choices": [], "usage": {"completion_tokens": tokens, "prompt_tokens": 3}}))
    send(h, "[DONE]")


def one_request(timeout_s: float = 30.0, requests: int = 1, warmup: int = 0) -> Workload:
    return Workload(prompts=["a prompt"], output_len=4, requests=requests, warmup=warmup, timeout_s=timeout_s,
                    model="m")


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def peak_rss_growth():
    """This process's resident memory over what it was before, at its peak while the block runs (sampled every 2 ms:
    the client reads in this process)."""
    import httpx  # noqa: F401  (imported before the baseline: its first import is not what the block grows by)

    base, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    growth = SimpleNamespace(bytes=0)
    try:
        yield growth
    finally:
        done.set()
        sampler.join()
        growth.bytes = max(peak[0], rss_bytes()) - base


def endless(h, head: bytes) -> None:
    """`head`, then one line of "x" that goes on until ENDLESS_BYTES: a server writing without end."""
    h.wfile.write(head)
    block = b"x" * (64 << 10)
    while h.server.sent < ENDLESS_BYTES:
        h.wfile.write(block)
        h.server.sent += len(block)


def wait_for_cut(server, seconds: float = 3.0) -> bool:
    return server.cut.wait(seconds)


# --- 8. a total deadline per request ----------------------------------------------------------------------------
def test_a_server_that_keeps_streaming_fails_the_request_at_its_deadline():
    """timeout_s is the request's whole time: a server that streams a token every 50 ms for ever (here: 8 s) kept the
    request open for as long as it streamed (httpx's timeout is per read)."""
    def keeps_streaming(h, index):
        sse_head(h)
        until = time.monotonic() + STAND_IN_SECONDS
        while time.monotonic() < until:
            send(h, TOKEN)
            time.sleep(0.05)

    with stand_in(keeps_streaming) as (server, url):
        started = time.monotonic()
        [p] = sweep(url, one_request(timeout_s=1), [1])
        took = time.monotonic() - started
        assert wait_for_cut(server)   # the client closed the connection at the deadline
    assert (p["requests"], p["completed"], p["errors"]) == (1, 0, 1)
    assert p["first_error"] == "timed out: not done within timeout_s 1 s"
    assert took < 3, took


def test_a_slow_request_within_its_deadline_is_measured():
    with stand_in(lambda h, index: well_formed(h, tokens=4, gap_s=0.2)) as (_, url):
        [p] = sweep(url, one_request(timeout_s=5), [1])
    assert p["errors"] == 0 and p["completed"] == 1 and p["e2e_ms_p50"] >= 600


# --- 9. bounded lines and bodies ---------------------------------------------------------------------------------
def _one_endless_line(h, index):
    sse_head(h)
    endless(h, b"data: ")


def _endless_error(h, index):
    sse_head(h, status=500, kind="text/plain")
    endless(h, b"")


@pytest.mark.parametrize(("answer", "error"), [
    # one SSE line without end: the client read it whole (4.1 → 5.0 GB in 10 s)
    (_one_endless_line, f"ResponseTooLarge: a line of the stream passed {MAX_LINE_BYTES} bytes"),
    # an error body without end: read only as far as its reason is kept
    (_endless_error, "HTTP 500: " + "x" * 200),
], ids=["endless-line", "endless-error-body"])
def test_an_endless_answer_fails_the_request_quickly_and_memory_stays_bounded(answer, error):
    """The request fails once the answer passes its bound, the connection is closed, and the reading process grows
    by a few MiB, not by the 128 MiB the stand-in would send."""
    with stand_in(answer) as (server, url), peak_rss_growth() as growth:
        started = time.monotonic()
        [p] = sweep(url, one_request(), [1])
        took = time.monotonic() - started
        assert wait_for_cut(server), "the stand-in was never cut off"
        sent = server.sent
    assert (p["completed"], p["errors"]) == (0, 1)
    assert p["first_error"] == error
    assert took < 3, took
    assert sent < 32 << 20, sent             # cut off long before the stand-in's 128 MiB (socket buffers aside)
    assert growth.bytes < 48 << 20, growth.bytes   # 128 MiB read whole would grow it by more than that


def test_a_stream_far_longer_than_the_tokens_asked_for_is_cut():
    """Short, well-formed lines that never end: the stream is bounded by the tokens asked for."""
    def floods(h, index):
        sse_head(h)
        line = f"data: {TOKEN}\n\n".encode() * 1000
        while h.server.sent < ENDLESS_BYTES:
            h.wfile.write(line)
            h.server.sent += len(line)

    with stand_in(floods) as (server, url):
        started = time.monotonic()
        [p] = sweep(url, one_request(), [1])
        assert wait_for_cut(server)
    assert p["errors"] == 1 and p["first_error"] == f"ResponseTooLarge: the stream passed {stream_byte_limit(4)} bytes"
    assert time.monotonic() - started < 5


# --- 10. a malformed answer is one failed request ------------------------------------------------------------------
MALFORMED = {
    "usage not a count": ('{"choices": [], "usage": {"completion_tokens": "many", "prompt_tokens": 3}}',
                          "MalformedResponse: usage.completion_tokens is 'many', not a count"),
    "prompt tokens not a count": ('{"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": [3]}}',
                                  "MalformedResponse: usage.prompt_tokens is [3], not a count"),
    "text not text": ('{"choices": [{"text": 5, "finish_reason": null}]}',
                      "MalformedResponse: choices[0].text is int, not text"),
    "chunk not an object": ("[1, 2]", "MalformedResponse: a chunk is list, not an object"),
    "choices not a list": ('{"choices": "abc"}', "MalformedResponse: choices is not a list of objects"),
    "usage not an object": ('{"choices": [], "usage": 7}', "MalformedResponse: usage is int, not an object"),
    "not JSON": ("{not json", "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
                              "(char 1)"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_one_malformed_answer_is_one_failed_request_and_the_others_are_measured(case):
    """Request 3 of 5 (one warm-up, 4 measured, one stream) gets a malformed last chunk: that request fails with the
    reason, the step goes on ("completion_tokens": "many" raised TypeError out of the whole sweep)."""
    bad, reason = MALFORMED[case]

    def answer(h, index):
        well_formed(h, usage=bad if index == 2 else None)

    with stand_in(answer) as (_, url):
        [p] = sweep(url, one_request(requests=4, warmup=1), [1])
    assert (p["requests"], p["completed"], p["errors"]) == (4, 3, 1)
    assert p["first_error"] == reason


def test_token_ids_of_the_wrong_type_end_the_conversation_not_the_step():
    """/tokenize answering ids that are not integers: the conversation's next turn is not sent (it was sent with
    them as its prompt)."""
    from dataclasses import replace

    def answer(h, index):
        if h.path == "/tokenize":
            sse_head(h, kind="application/json")
            h.wfile.write(b'{"tokens": ["a", "b"]}')
        else:
            well_formed(h)

    with stand_in(answer) as (server, url):
        [p] = sweep(url, replace(Workload(prompts=[[1, 2, 3]] * 4, output_len=4, requests=2, warmup=0, timeout_s=10,
                                          model="m"), turns=2), [1])
        paths = [path for path, _ in server.seen]
    assert (p["requests"], p["completed"], p["errors"]) == (4, 2, 2)
    assert p["first_error"].startswith("not sent: ConversationError: POST /tokenize answered HTTP 200 without token ids")
    assert paths == ["/v1/completions", "/tokenize", "/v1/completions", "/tokenize"]


# --- 8 and 13: the capacity step's time limit inside a probe, and a start rate below the grid ----------------------
FAMILY = "c" * 64


def capacity_step(tmp_path, monkeypatch, url: str, start_rps: float, max_minutes: float) -> tuple[dict, list[str]]:
    """The `capacity[...]` step's runner on the stand-in at `url` (the server plugin, its lifecycle and the prompt
    corpus replaced by stand-ins; everything else as a run does it): its result and its log."""
    import qbuild.evaluate.data
    import qbuild.serving.server
    from qbuild.plugins import servers
    from qbuild.serving import capacity_step as runner

    @contextlib.contextmanager
    def running(launch, log, label, ready_timeout_s):
        yield SimpleNamespace(url=url, check_alive=lambda: None, peak_rss_bytes=lambda: None)

    launch = SimpleNamespace(engine="stand-in", command=("stand-in", "--port", "8080"), model_name="m",
                             ignore_eos=True)
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(qbuild.serving.server, "running", running)
    monkeypatch.setattr(qbuild.evaluate.data, "load_tokens", lambda path: (np.arange(4000), {}))
    monkeypatch.setattr(servers, "get", lambda name: SimpleNamespace(name="stand-in", launch=lambda *a, **k: launch))
    log: list[str] = []
    (tmp_path / "out").mkdir()
    ctx = SimpleNamespace(
        params={"workload": {"input_len": 8, "output_len": 4, "seed": 0, "timeout_s": 30, "warmup": 1,
                             "prefix_tokens": 0, "requests": 16, "rounds": 1},
                "capacity": {"slo": {"ttft_p99_ms": 5000}, "max_minutes": max_minutes, "max_error_pct": 1.0,
                             "start_rps": start_rps},
                "server": "stand-in", "config": {"name": "default"}, "slots": 4, "context": 64},
        runtime_args={"label": "q8_0", "probe_family": FAMILY}, step_name="capacity[q8_0@default]",
        inputs={"model": tmp_path / "model.gguf", "prompts": tmp_path / "prompts"}, threads=1, out=tmp_path / "out",
        log=log.append, progress=lambda *a: None)
    return runner.run(ctx)["metrics"], log


def test_a_probe_stops_at_max_minutes_and_is_neither_judged_nor_kept(tmp_path, monkeypatch):
    """The budget was checked only between probes: a probe of slow requests ran to its end however long that took.
    Now no request is sent past max_minutes (2.4 s here), those in flight end there, and the probe, cut short, is not
    judged and not kept for other searches; the search says it was stopped by its time limit."""
    from qbuild.serving.capacity_step import cached_probe, grid_index, rate_of

    def answer(h, index):   # the warm-up request answers at once, every later one streams for 10 s
        well_formed(h, tokens=4, gap_s=0.0 if index == 0 else 2.5)

    with stand_in(answer) as (server, url):
        started = time.monotonic()
        result, log = capacity_step(tmp_path, monkeypatch, url, start_rps=4, max_minutes=0.04)
        took = time.monotonic() - started
        sent = len(server.seen)
    k = grid_index(4)
    assert took < 6, took   # 2.4 s of budget; the probe's 16 requests of 10 s each would take some 14 s
    assert result["complete"] is False and result["stopped_by"] == "max_minutes" and result["probes"] == []
    stopped = result["stopped_probe"]
    assert stopped["stopped_by"] == "max_minutes" and stopped["rate_rps"] == rate_of(k)
    assert 1 <= stopped["stopped_requests"] == stopped["requests"] - stopped["completed"] and stopped["completed"] == 0
    assert sent <= 1 + stopped["requests"] < 1 + 16   # the warm-up, then only the arrivals due before the limit
    assert cached_probe(FAMILY, k) is None   # another search measures this rate whole
    assert any("stopped by max_minutes 0.04" in line and "not judged, not kept" in line for line in log)
    assert json.loads((tmp_path / "out" / "capacity.json").read_text())["stopped_by"] == "max_minutes"


def test_a_start_rate_below_the_grid_starts_at_its_lowest_rate(tmp_path, monkeypatch):
    """start_rps: 0.001 (the schema takes any positive rate) failed the step with "ValueError: expected non-negative
    integer": the start is clamped to the grid's lowest rate, 1/256 requests/s, where the first arrival is due
    minutes later, past max_minutes (3 s here), so the step ends at its budget."""
    from qbuild.serving.capacity_step import LOWEST_K, rate_of

    with stand_in(lambda h, index: well_formed(h)) as (_, url):
        started = time.monotonic()
        result, _ = capacity_step(tmp_path, monkeypatch, url, start_rps=0.001, max_minutes=0.05)
        took = time.monotonic() - started
    assert result["start_rps"] == rate_of(LOWEST_K) == 1 / 256
    assert result["stopped_probe"]["k"] == LOWEST_K and result["stopped_by"] == "max_minutes"
    assert took < 6, took


# --- the served check's question: one bounded exchange, its answer validated -----------------------------------
def _served_check_answer(tops):
    def answer(h, index):
        data = json.dumps({"choices": [{"logprobs": {"top_logprobs": [tops]}}]}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return answer


def _ask_and_check(url: str, timeout_s: float = 30.0) -> dict:
    from qbuild.serving.served_check import checked_logprobs, openai_next_token_logprobs

    return checked_logprobs(openai_next_token_logprobs(url, "m", [1, 2, 3], 20, timeout_s), vocab=100, k=20,
                            engine="stand-in")


@pytest.mark.parametrize(("tops", "says"), [
    ({"token_id:5": float("nan")}, "log-probability nan"),   # NaN would pass every bound unnoticed
    ({"token_id:5": 0.5}, "log-probability 0.5"),
    ({"token_id:100": -0.1}, "token id 100, outside the vocabulary of 100"),
    ({"token_id:-1": -0.1}, "token id -1"),
    ({f"token_id:{i}": -5.0 for i in range(21)}, "answered 21 log-probs for a top 20"),
])
def test_a_lying_top_k_answer_is_one_line(tops, says):
    from qbuild.serving.client import MalformedResponse

    with stand_in(_served_check_answer(tops)) as (_, url), pytest.raises(MalformedResponse, match=says) as raised:
        _ask_and_check(url)
    assert "\n" not in str(raised.value)


def test_the_served_checks_question_is_bounded_in_time_and_size():
    """An endless answer is cut at the body bound without growing this process by more than a few MB, and a server
    that keeps a request open is cut at the whole exchange's deadline (not httpx's per-read timeout)."""
    def flood(h, index):
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        endless(h, b'{"choices": "')

    from qbuild.serving.client import MAX_JSON_BODY_BYTES, ResponseTooLarge

    with stand_in(flood) as (server, url), peak_rss_growth() as growth, pytest.raises(ResponseTooLarge):
        _ask_and_check(url)
    assert wait_for_cut(server) and growth.bytes < 3 * MAX_JSON_BODY_BYTES

    def trickle(h, index):
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        for _ in range(int(STAND_IN_SECONDS / 0.1)):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.1)

    started = time.monotonic()
    with stand_in(trickle) as (_, url), pytest.raises(RuntimeError, match="did not answer within 1 s"):
        _ask_and_check(url, timeout_s=1.0)
    assert time.monotonic() - started < STAND_IN_SECONDS / 2
