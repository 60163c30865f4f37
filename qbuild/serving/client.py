"""The load generator: streaming `/v1/completions` requests from an asyncio client (httpx), as users hit a server.

Closed loop: at concurrency C, C streams each send their next request as soon as the last one ends, until
`warmup + requests` have been sent. The first `warmup` requests are left out of the latencies, and the measured
ones follow them without a pause, so the point is measured in steady state (not from an idle server). Its rates
(output tok/s, requests/s) count what the server delivered while every stream was busy, from the first measured
request sent (and every stream started) to the first stream left without a request: every streamed token in that
window, and every request for the share of its tokens streamed in it (guidellm also counts token timestamps
within its measurement window). So neither the ramp at the start nor the tail, with fewer streams busy, bends
them. With `rampup_s` the streams start that many seconds apart in all (stream k at k/C of it), as guidellm's
`rampup_duration` does: with fixed lengths, streams that start together stay in step and prefill together, so
the time to first token of the whole run depends on that first instant.

Open loop (`request_rates`): requests start at Poisson arrival times of the given
rate (seeded), however many are in flight.

Conversations (`Workload.turns` > 1): each unit above (a stream's next job, an arrival) is a conversation of `turns`
requests instead of one request, sent one after the other as the last one ends (after `think_s`, a user reading the
answer). Turn k's prompt is turn k-1's prompt, what the server generated for it, then turn k's own input, as a chat
client resends the whole history: text prompts append the generated text; token-id prompts append it as the server's
own `/tokenize` (llama-server, vLLM) gives it back, as a chat server tokenizes the history it is sent. A turn that
fails ends its conversation: the turns not sent count as errors.

Per request: time to first token (TTFT), the gaps between streamed tokens (ITL), time per output token after the
first (TPOT = (e2e - TTFT) / (tokens - 1)) and end-to-end latency. TTFT and end-to-end latency count from the
moment the request's headers start onto the wire (httpcore's trace event), as guidellm does: the client's own work
before that (opening a connection, building the request, waiting for the event loop) is not the server's latency.
Per point: p50/p90/p99 of each, requests/s, output tok/s, errors, and with turns, TTFT and prompt tokens per turn
(`by_turn`: later turns find their history in the server's prompt cache).

What a server answers is bounded, so no server can stall or grow the step: each request has a total deadline
(`timeout_s`, from when the client starts it to its last byte; httpx's own timeout is per read, which a server that
keeps streaming never trips), a line of the stream is at most MAX_LINE_BYTES, a stream at most stream_byte_limit()
and an error body is read only as far as its reason is kept. A request past a bound, or whose answer is malformed
(not JSON, a field of the wrong type), is one failed request with its reason, and its connection is closed.
`Workload.stop_at` (time.monotonic) is a time limit of the caller's (a capacity search's budget): past it no request
is sent, and requests in flight end there, failed with STOPPED_AT_LIMIT.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

# numpy is imported by the functions that measure: a cached run's summary loads this module and never needs it
PERCENTILES = (50, 90, 99)
MAX_LINE_BYTES = 1 << 20          # one line of a stream: a chunk's JSON is a few hundred bytes
STREAM_BYTES_PER_TOKEN = 16 << 10  # a stream's bound grows with the tokens asked for (about 300 bytes each, as served)
MAX_ERROR_BODY_BYTES = 4096       # of an error answer: only its first 200 characters are kept
MAX_JSON_BODY_BYTES = 16 << 20    # /tokenize's answer: the token ids of one turn's text
STOPPED_AT_LIMIT = "stopped at the time limit"


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0       # perf_counter when the request was sent, and when its stream ended
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)   # perf_counter of each streamed chunk
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    text: str = ""                      # what was generated (a conversation's next turn carries it)
    turn: int = 0                       # the request's place in its conversation, from 0
    prompt_tokens: int | None = None    # the server's own count (usage), where it reports one

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]] | list[str]   # token ids (exact input lengths) or text (a stand-in without a tokenizer)
    output_len: int | list[int]            # tokens to generate: for every request, or per prompt (same indices)
    requests: int
    warmup: int = 2
    timeout_s: float = 120.0
    ignore_eos: bool = True
    model: str = "model"
    rampup_s: float = 0.0
    turns: int = 1        # requests per conversation; `requests` and `warmup` count conversations
    think_s: float = 0.0  # the pause before a conversation's next turn
    stop_at: float | None = None   # time.monotonic() past which nothing is sent and requests in flight end

    def past_stop(self) -> bool:
        return self.stop_at is not None and time.monotonic() >= self.stop_at

    def request(self, i: int) -> tuple[list[int] | str, int]:
        """The prompt (a conversation's later turn: its own input) and output length of request i (turn i % turns
        of conversation i // turns)."""
        k = i % len(self.prompts)
        return self.prompts[k], self.output_len[k] if isinstance(self.output_len, list) else self.output_len

    def prompt(self, i: int, history: list[int] | str | None = None) -> list[int] | str:
        """What request i sends: its own prompt, after its conversation's `history` (the earlier turns) if any."""
        own = self.request(i)[0]
        return own if history is None else history + own


class ConversationError(RuntimeError):
    """A conversation that cannot go on (the server gave no token ids for what it generated)."""


class ResponseTooLarge(RuntimeError):
    """An answer past one of the client's bounds (a line, a stream, a body)."""


class MalformedResponse(ValueError):
    """An answer that is not what the OpenAI completions API sends (a chunk that is no object, a field of the wrong
    type)."""


def stream_byte_limit(output_len: int) -> int:
    """The most bytes a completion stream of `output_len` tokens may take."""
    return MAX_LINE_BYTES + STREAM_BYTES_PER_TOKEN * output_len


# asked of every server: a compressed answer would bound what arrives, not what it inflates to
PLAIN = {"Accept-Encoding": "identity"}


async def _lines(resp, max_line: int, max_total: int):
    """The lines of a streamed body (without their ends), read in the chunks the socket gives: a line longer than
    `max_line` bytes, or a body past `max_total`, raises ResponseTooLarge (aiter_lines would keep the whole line)."""
    pending = b""
    total = 0
    async for chunk in resp.aiter_raw():
        total += len(chunk)
        if total > max_total:
            raise ResponseTooLarge(f"the stream passed {max_total} bytes")
        lines = (pending + chunk).splitlines(keepends=True)
        pending = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        for line in lines:
            yield line.rstrip(b"\r\n").decode(errors="replace")
        if len(pending) > max_line:
            raise ResponseTooLarge(f"a line of the stream passed {max_line} bytes")
    if pending:
        yield pending.decode(errors="replace")


async def _body(resp, limit: int, truncate: bool) -> bytes:
    """At most `limit` bytes of a body: the rest is left unread (truncate) or raises ResponseTooLarge."""
    out = bytearray()
    async for chunk in resp.aiter_raw():
        out += chunk
        if len(out) > limit:
            if truncate:
                return bytes(out[:limit])
            raise ResponseTooLarge(f"the answer passed {limit} bytes")
    return bytes(out)


def post_json(url: str, body: dict, timeout_s: float, limit: int = MAX_JSON_BODY_BYTES) -> object:
    """One JSON request and its JSON answer, bounded as every answer here is: the whole exchange within `timeout_s`
    (not per read), the answer at most `limit` bytes (an error answer's first MAX_ERROR_BODY_BYTES). A refusal, an
    overrun or an answer that is not JSON raises one line naming the URL."""
    data = _bounded_exchange("POST", url, body, timeout_s, limit)
    try:
        return json.loads(data)
    except ValueError:
        raise MalformedResponse(f"{url} answered {len(data)} bytes that are not JSON") from None


def get_text(url: str, timeout_s: float, limit: int = MAX_JSON_BODY_BYTES) -> str:
    """A GET's answer as text (a server's /metrics), bounded as post_json's."""
    return _bounded_exchange("GET", url, None, timeout_s, limit).decode(errors="replace")


def _bounded_exchange(method: str, url: str, body: dict | None, timeout_s: float, limit: int) -> bytes:
    import httpx

    async def exchange() -> tuple[int, bytes]:
        # trust_env off: no proxy between us and the server we started
        async with (asyncio.timeout(timeout_s), httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client,
                    client.stream(method, url, headers=PLAIN, json=body) as resp):
            ok = resp.status_code == 200
            return resp.status_code, await _body(resp, limit if ok else MAX_ERROR_BODY_BYTES, truncate=not ok)

    try:
        status, data = asyncio.run(exchange())
    except TimeoutError:
        raise RuntimeError(f"{url} did not answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise RuntimeError(f"{url}: {type(exc).__name__}: {exc}") from None
    if status != 200:
        raise RuntimeError(f"{url} answered HTTP {status}: {data[:200].decode(errors='replace')}")
    return data


def _count(value, name: str) -> int | None:
    """A token count from the server: a non-negative integer or absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedResponse(f"usage.{name} is {value!r:.40}, not a count")
    return value


def _chunk_fields(data: str) -> tuple[object, dict, dict | None]:
    """A stream chunk's error (None without one), usage ({} without one) and first choice (None without one),
    each of the type the API gives it, or MalformedResponse naming what is not."""
    chunk = json.loads(data)
    if not isinstance(chunk, dict):
        raise MalformedResponse(f"a chunk is {type(chunk).__name__}, not an object")
    usage, choices = chunk.get("usage") or {}, chunk.get("choices") or []
    if not isinstance(usage, dict):
        raise MalformedResponse(f"usage is {type(usage).__name__}, not an object")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MalformedResponse("choices is not a list of objects")
    choice = choices[0] if choices else None
    if choice is not None and not isinstance(choice.get("text") or "", str):
        raise MalformedResponse(f"choices[0].text is {type(choice['text']).__name__}, not text")
    return chunk.get("error"), usage, choice


async def one_request(client, url: str, i: int, work: Workload, history: list[int] | str | None = None
                      ) -> RequestResult:
    """Request i, after its conversation's `history` (the earlier turns) if any."""
    result = await _stream(client, url, work.prompt(i, history), work.request(i)[1], work)
    result.turn = i % work.turns
    return result


async def _conversation(client, url: str, work: Workload, first: int, results: dict[int, RequestResult],
                        done: Callable[[], None]) -> None:
    """Requests first .. first + turns - 1, each sent as the last one ends (after think_s), each after the
    conversation so far."""
    history = None
    for turn in range(work.turns):
        if turn and work.think_s:
            await asyncio.sleep(work.think_s if work.stop_at is None
                                else min(work.think_s, max(work.stop_at - time.monotonic(), 0.0)))
        results[first + turn] = result = await one_request(client, url, first + turn, work, history)
        done()
        if turn + 1 == work.turns:
            return
        try:
            if not result.ok:
                raise ConversationError(f"turn {turn + 1} failed")
            if work.past_stop():
                raise ConversationError(STOPPED_AT_LIMIT)
            history = await _so_far(client, url, work.prompt(first + turn, history), result.text, work.model,
                                    work.timeout_s)
        except Exception as exc:   # the conversation ends here: its turns not sent count as errors
            now = time.perf_counter()
            for rest in range(first + turn + 1, first + work.turns):
                results[rest] = RequestResult(False, start=now, end=now, turn=rest - first,
                                              error=f"not sent: {type(exc).__name__}: {exc}"[:200])
                done()
            return


async def _so_far(client, url: str, prompt: list[int] | str, generated: str, model: str,
                  timeout_s: float = 120.0) -> list[int] | str:
    """A conversation after a turn: its prompt and what was generated, as text or (for token ids) as the server's
    own tokenizer reads the generated text (within `timeout_s` in all)."""
    if isinstance(prompt, str):
        return prompt + generated
    # llama-server reads `content`/`add_special`, vLLM `prompt`/`add_special_tokens`; each ignores the other's
    async with asyncio.timeout(timeout_s):
        async with client.stream("POST", url + "/tokenize", headers=PLAIN, json={
                "model": model, "content": generated, "prompt": generated, "add_special": False,
                "add_special_tokens": False}) as resp:
            body = await _body(resp, MAX_JSON_BODY_BYTES, truncate=False) if resp.status_code == 200 else b""
    answer = json.loads(body) if body else None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ConversationError(f"POST /tokenize answered HTTP {resp.status_code} without token ids: the server "
                                "cannot continue a conversation of token-id prompts")
    return prompt + tokens


async def _stream(client, url: str, prompt: list[int] | str, output_len: int, work: Workload) -> RequestResult:
    import numpy as np

    body = {"model": work.model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if work.ignore_eos:
        body["ignore_eos"] = True
    sent: list[float] = []

    async def on_the_wire(event: str, info: dict) -> None:   # httpcore's trace hook
        if not sent and event.endswith(".send_request_headers.started"):
            sent.append(time.perf_counter())

    failed = RequestResult(False, start=time.perf_counter())
    stamps: list[float] = []
    usage_tokens = prompt_tokens = None
    pieces: list[str] = []   # the generated text, chunk by chunk
    budget, past_budget = work.timeout_s, f"timed out: not done within timeout_s {work.timeout_s:g} s"
    if work.stop_at is not None and work.stop_at - time.monotonic() < budget:
        budget, past_budget = work.stop_at - time.monotonic(), STOPPED_AT_LIMIT
        if budget <= 0:   # not sent at all
            return replace(failed, end=failed.start, error=STOPPED_AT_LIMIT)
    deadline = asyncio.timeout(budget)
    try:
        async with deadline, client.stream("POST", url + "/v1/completions", json=body, headers=PLAIN,
                                           extensions={"trace": on_the_wire}) as resp:
            if resp.status_code != 200:
                text = (await _body(resp, MAX_ERROR_BODY_BYTES, truncate=True)).decode(errors="replace")
                return replace(failed, end=time.perf_counter(), error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in _lines(resp, MAX_LINE_BYTES, stream_byte_limit(output_len)):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                error, usage, choice = _chunk_fields(data)
                if error:
                    return replace(failed, end=time.perf_counter(), error=str(error)[:200])
                if usage.get("completion_tokens") is not None:
                    usage_tokens = _count(usage["completion_tokens"], "completion_tokens")
                    prompt_tokens = _count(usage.get("prompt_tokens"), "prompt_tokens")
                if choice is not None and (choice.get("text") or choice.get("finish_reason") is None):
                    stamps.append(time.perf_counter())
                    pieces.append(choice.get("text") or "")
    except Exception as exc:   # refused/reset, past a deadline or bound, malformed: an error of this request alone
        error = past_budget if deadline.expired() else f"{type(exc).__name__}: {exc}"
        return replace(failed, end=time.perf_counter(), error=error[:200])
    end = time.perf_counter()
    if not stamps:
        return replace(failed, end=end, error="no token streamed")
    start = sent[0] if sent else failed.start
    tokens = usage_tokens if usage_tokens is not None else len(stamps)
    result = RequestResult(True, start=start, end=end, ttft_s=stamps[0] - start, e2e_s=end - start,
                           itl_s=list(np.diff(stamps)), output_tokens=tokens, token_times=stamps, text="".join(pieces),
                           prompt_tokens=prompt_tokens)
    if work.ignore_eos and tokens < output_len:
        result.ok, result.error = False, f"{tokens} of {output_len} tokens"
    return result


async def _closed_loop(client, url: str, work: Workload, concurrency: int, first: int, count: int,
                       done: Callable[[], None], rampup_s: float = 0.0
                       ) -> tuple[list[RequestResult], tuple[float, float]]:
    """Conversations first .. first + count - 1 (of one request each without turns) over `concurrency` streams: their
    requests' results in the order of their indices, and the time in which every stream was busy (from the last
    stream's first request to the first stream that found none left)."""
    queue = list(range(first, first + count))
    results: dict[int, RequestResult] = {}
    busy_at: list[float] = []
    idle_at: list[float] = []

    async def stream(k: int):
        if rampup_s:
            await asyncio.sleep(rampup_s * k / concurrency)
        busy_at.append(time.perf_counter())
        while queue and not work.past_stop():
            await _conversation(client, url, work, queue.pop(0) * work.turns, results, done)
        idle_at.append(time.perf_counter())

    await asyncio.gather(*(stream(k) for k in range(min(concurrency, count))))
    now = time.perf_counter()
    return [results[i] for i in sorted(results)], (max(busy_at, default=now), min(idle_at, default=now))


# the shortest every-stream-busy window a rate is read from, in typical requests' time
MIN_WINDOW_REQUESTS = 2


def _typical_request_s(results: list[RequestResult]) -> float:
    """The median end-to-end time of the requests that completed (0 when none did)."""
    import numpy as np

    e2e = [r.e2e_s for r in results if r.ok]
    return float(np.median(e2e)) if e2e else 0.0


async def _open_loop(client, url: str, work: Workload, rate: float, first: int, count: int, seed: int,
                     done: Callable[[], None]) -> list[RequestResult]:
    import numpy as np

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return await _replay(client, url, work, np.cumsum(gaps).tolist(), first, done)


async def _replay(client, url: str, work: Workload, arrivals: list[float], first: int,
                  done: Callable[[], None]) -> list[RequestResult]:
    """Conversations (requests, without turns) first, first+1, ... started at `arrivals` (seconds from the start,
    ascending), however many are in flight: a user's trace replayed. Their requests' results, in index order (those
    due past `work.stop_at` are not sent, and have none)."""
    start = time.perf_counter()
    tasks = []
    results: dict[int, RequestResult] = {}
    for k, at in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if work.stop_at is not None and time.monotonic() + max(delay, 0.0) >= work.stop_at:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_conversation(client, url, work, (first + k) * work.turns, results, done)))
    await asyncio.gather(*tasks)
    return [results[i] for i in sorted(results)]


def replay(url: str, work: Workload, arrivals: list[float]) -> dict:
    """A trace's point: after `work.warmup` requests one at a time, request `warmup + k` sent at `arrivals[k]`."""
    return asyncio.run(_replay_point(url, work, arrivals))


async def _replay_point(url: str, work: Workload, arrivals: list[float]) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(arrivals) + 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(work.timeout_s, connect=10.0), limits=limits,
                                 trust_env=False) as client:
        if work.warmup:
            await _closed_loop(client, url, work, 1, 0, work.warmup, lambda: None)
        start = time.perf_counter()
        results = await _replay(client, url, work, arrivals, work.warmup, lambda: None)
        return summarize_point(results, time.perf_counter() - start)


def summarize_point(results: list[RequestResult], seconds: float | None = None,
                    window: tuple[float, float] | None = None, around: list[RequestResult] = ()) -> dict:
    """Numbers of one point. Rates: over `seconds` from the results alone, or over `window` (perf_counter times)
    from every token and request end of `results` and `around` (the warm-up) that falls inside it."""
    import numpy as np

    ok = [r for r in results if r.ok]
    if window is not None:
        t0, t1 = window
        seconds = t1 - t0
        everything = [r for r in (*around, *results) if r.ok]
        # each request counts for the share of its tokens streamed inside the window (a request that ends just
        # after the window, as the streams finishing the same wave do, still counts for what it delivered)
        shares = [(r.output_tokens, sum(1 for t in r.token_times if t0 <= t <= t1) / len(r.token_times))
                  for r in everything if r.token_times]
        tokens, ended = sum(n * share for n, share in shares), sum(share for _, share in shares)
    else:
        tokens, ended = sum(r.output_tokens for r in ok), len(ok)

    def pcts(name: str, values: list[float]) -> dict:
        if not values:
            return {f"{name}_p{p}": None for p in PERCENTILES}
        arr = np.array(values) * 1000
        return {f"{name}_p{p}": round(float(np.percentile(arr, p)), 3) for p in PERCENTILES}

    out = {"requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
           "seconds": round(seconds, 4),
           "requests_s": round(ended / seconds, 4) if seconds > 0 else None,
           "output_tok_s": round(tokens / seconds, 3) if seconds > 0 else None,
           **pcts("ttft_ms", [r.ttft_s for r in ok]),
           **pcts("tpot_ms", [r.tpot_s for r in ok if r.tpot_s is not None]),
           **pcts("itl_ms", [g for r in ok for g in r.itl_s]),
           **pcts("e2e_ms", [r.e2e_s for r in ok]),
           # per request (ms), so goodput can be computed later against any SLO without measuring again
           "samples": {"ttft_ms": [round(r.ttft_s * 1000, 2) for r in ok],
                       "tpot_ms": [round(r.tpot_s * 1000, 3) if r.tpot_s is not None else None for r in ok],
                       # and what a point measured in rounds pools and resamples (qbuild.serving.confidence)
                       "itl_ms": [[round(g * 1000, 3) for g in r.itl_s] for r in ok],
                       "e2e_ms": [round(r.e2e_s * 1000, 2) for r in ok]}}
    turns = max((r.turn for r in results), default=0) + 1
    if turns > 1:   # conversations: each request's turn, and what each turn measured
        out["samples"] |= {"turn": [r.turn for r in ok], "prompt_tokens": [r.prompt_tokens for r in ok]}
        out["by_turn"] = by_turn(out["samples"], turns)
    first_error = next((r.error for r in results if not r.ok), None)
    if first_error:
        out["first_error"] = first_error
    return out


def by_turn(samples: dict, turns: int) -> list[dict]:
    """Per turn of the conversations (from 1): its completed requests, their TTFT p50/p99 (ms) and their mean prompt
    tokens as the server counted them (None where it reports none)."""
    import numpy as np

    out = []
    for turn in range(turns):
        ttft = [v for v, t in zip(samples["ttft_ms"], samples["turn"], strict=True) if t == turn]
        prompt = [v for v, t in zip(samples["prompt_tokens"], samples["turn"], strict=True) if t == turn]
        out.append({"turn": turn + 1, "completed": len(ttft),
                    **{f"ttft_ms_p{p}": round(float(np.percentile(ttft, p)), 3) if ttft else None for p in (50, 99)},
                    "prompt_tokens_mean": round(float(np.mean(prompt)), 1) if prompt and None not in prompt else None})
    return out


def turns_text(turns: list[dict]) -> str:
    """A point's by_turn in one line: each turn's TTFT p50 and mean prompt tokens, "61.0 ms (32 tok) | 48.4 ms ..."."""
    return " | ".join(("-" if t["ttft_ms_p50"] is None else f"{t['ttft_ms_p50']:.1f} ms")
                      + (f" ({t['prompt_tokens_mean']:.0f} tok)" if t.get("prompt_tokens_mean") is not None else "")
                      for t in turns)


def goodput(point: dict, ttft_ms: float | None, tpot_ms: float | None) -> float | None:
    """Requests/s that met both SLOs (a bound that is None always holds)."""
    samples = point.get("samples")
    if not samples or not point.get("seconds"):
        return None
    good = sum(1 for t, p in zip(samples["ttft_ms"], samples["tpot_ms"], strict=True)
               if (ttft_ms is None or t <= ttft_ms) and (tpot_ms is None or (p is not None and p <= tpot_ms)))
    return round(good / point["seconds"], 4)


def sweep(url: str, work: Workload, concurrency: list[int], request_rates: list[float] | None = None, seed: int = 0,
          between: Callable[[], None] = lambda: None, progress: Callable[[int, int, str], None] = lambda *a: None
          ) -> list[dict]:
    """Every point of the sweep, in order: concurrency levels, then request rates. `between` runs after each point
    (the caller checks the server is still alive there)."""
    return asyncio.run(_sweep(url, work, concurrency, request_rates or [], seed, between, progress))


async def _sweep(url, work, concurrency, rates, seed, between, progress) -> list[dict]:
    import httpx

    points: list[dict] = []
    n_points = len(concurrency) + len(rates)
    total = n_points * (work.requests + work.warmup) * work.turns
    done = 0

    def tick(desc: str):
        def f():
            nonlocal done
            done += 1
            progress(done, total, desc)
        return f

    limits = httpx.Limits(max_connections=max([*concurrency, 1]) + work.requests * work.turns,
                          max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(work.timeout_s, connect=10.0), limits=limits,
                                 trust_env=False) as client:   # trust_env off: no proxy between us and 127.0.0.1
        offset = 0
        for c in concurrency:
            results, (all_busy, first_idle) = await _closed_loop(
                client, url, work, c, offset, work.warmup + work.requests, tick(f"concurrency {c}"), work.rampup_s)
            measured = results[work.warmup * work.turns:]
            # the rates' window: the warm-up sent and every stream busy, until the first stream runs out of requests
            window = (max(min(r.start for r in measured), all_busy), first_idle)
            if window[1] - window[0] < MIN_WINDOW_REQUESTS * _typical_request_s(measured):
                # every stream busy for less than two requests' time (a ramp-up about as long as the run): a
                # stream's tokens in so short a window are counted to within a request at each edge, which read
                # up to 13 % above the streams' physical limit in CI, so the whole span of the measured requests
                window = (min(r.start for r in measured), max(r.end for r in measured))
            points.append({"concurrency": c, **summarize_point(measured, window=window,
                                                                around=results[:work.warmup])})
            offset += work.warmup + work.requests
            between()
        for k, rate in enumerate(rates):
            await _closed_loop(client, url, work, 1, offset, work.warmup, tick(f"warm-up, rate {rate}/s"))
            start = time.perf_counter()
            results = await _open_loop(client, url, work, rate, offset + work.warmup, work.requests, seed + k,
                                       tick(f"rate {rate}/s"))
            points.append({"request_rate": rate, **summarize_point(results, time.perf_counter() - start)})
            offset += work.warmup + work.requests
            between()
    return points
