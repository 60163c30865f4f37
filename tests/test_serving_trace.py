"""Replaying a user's trace (evaluation.serving.trace, qbuild/serving/trace.py): the file's checks, each one line;
the client sending requests at the trace's arrival times (guidellm's mock server); and a recipe with a trace on a
real llama-server (slow), whose trace point is measured and whose key follows the file's contents."""

from __future__ import annotations

import json

import pytest

from qbuild.serving.trace import TraceError, read_trace


def write(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ({"arrival_s": -1, "input_len": 8, "output_len": 4}, "arrival_s must be a number of seconds >= 0, got -1"),
    ({"arrival_s": 0.5, "input_len": 8}, "output_len must be an integer >= 1, got None"),
    ({"arrival_s": 0.5, "output_len": 4}, "give prompt (text) or input_len (an integer >= 1), got None"),
    ({"arrival_s": 0.5, "prompt": "", "output_len": 4}, "prompt must be a non-empty string"),
    ({"arrival_s": 0.1, "input_len": 8, "output_len": 4}, "arrival_s 0.1 is before the previous request's 0.2"),
])
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "t.jsonl", [{"arrival_s": 0.2, "input_len": 8, "output_len": 4}, line])
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value) and "\n" not in str(err.value)


def test_a_trace_reads_token_lengths_and_texts(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"arrival_s": 0, "input_len": 8, "output_len": 4}, "",
                                        {"arrival_s": 1.5, "prompt": "Explain itertools.chain", "output_len": 6}])
    assert read_trace(path) == [{"arrival_s": 0.0, "output_len": 4, "input_len": 8},
                                {"arrival_s": 1.5, "output_len": 6, "prompt": "Explain itertools.chain"}]
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write(tmp_path / "empty.jsonl", [""]))


def test_requests_leave_at_the_traces_arrival_times():
    from test_serving_client import guidellm

    from qbuild.serving.client import Workload, replay
    from qbuild.serving.server import ServerLaunch, running

    exe = guidellm()
    if exe is None:
        pytest.skip("guidellm is not installed (scripts/install.sh dev puts it in .venv-guidellm)")
    import asyncio

    import httpx

    from qbuild.serving.client import _replay

    launch = ServerLaunch((exe, "mock-server", "--host", "127.0.0.1", "--port", "{port}", "--model", "mock",
                           "--ttft-ms", "50", "--itl-ms", "10"), engine="guidellm-mock", model_name="mock")
    arrivals = [0.0, 0.05, 0.6, 0.65, 1.3]
    work = Workload(prompts=[f"request {i}" for i in range(5)], output_len=[3, 5, 4, 6, 2], requests=5, warmup=0,
                    timeout_s=30, model="mock")
    import tempfile
    from pathlib import Path

    with running(launch, Path(tempfile.mkdtemp()) / "mock.log", "stand-in", ready_timeout_s=180) as srv:
        async def go():
            async with httpx.AsyncClient(trust_env=False) as client:
                return await _replay(client, srv.url, work, arrivals, 0, lambda: None)

        results = asyncio.run(go())
        point = replay(srv.url, work, arrivals)
    assert all(r.ok for r in results)
    assert [r.start - results[0].start for r in results] == pytest.approx(arrivals, abs=0.05)
    assert [r.output_tokens for r in results] == [3, 5, 4, 6, 2]
    assert point["completed"] == 5 and point["errors"] == 0


def trace_recipe(model, store, trace) -> dict:
    return {"name": "trace", "model": {"source": "local", "path": str(model)},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}],
            "evaluation": {"perplexity": None, "baseline": False,
                           "serving": {"concurrency": [1], "requests": 2, "warmup": 1, "rounds": 1, "input_len": 16,
                                       "output_len": 4, "variants": ["q8_0"], "trace": str(trace)}},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


@pytest.mark.slow
def test_a_trace_is_replayed_on_a_real_server_and_keyed_by_its_contents(tmp_path, tiny_model_dir):
    from serving_helpers import llama_server_bin

    from helpers import qbuild, run_api, write_recipe

    llama_server_bin()
    requests = [{"arrival_s": 0.0, "input_len": 24, "output_len": 5}, {"arrival_s": 0.1, "input_len": 8, "output_len": 3},
                {"arrival_s": 0.8, "prompt": "The os.path module", "output_len": 6},
                {"arrival_s": 1.2, "input_len": 40, "output_len": 4}]
    trace = write(tmp_path / "trace.jsonl", requests)
    recipe = write_recipe(tmp_path / "r.yaml", trace_recipe(tiny_model_dir, tmp_path / "store", "trace.jsonl"))
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    points = next(v for v in summary["variants"] if v["variant"] == "q8_0")["serving"]
    [replayed] = [p for p in points if "trace" in p]
    assert replayed["trace"] == "trace.jsonl" and replayed["completed"] == 4 and replayed["errors"] == 0
    # ignore_eos: each request streamed what the trace asked for, 18 tokens over 4 requests
    assert replayed["output_tok_s"] == pytest.approx((5 + 3 + 6 + 4) / 4 * replayed["requests_s"], rel=1e-3)
    assert any("concurrency" in p for p in points)
    out = qbuild("run", recipe)   # the console's serving table has the trace's row
    assert out.returncode == 0 and "trace trace.jsonl" in out.stdout, out.stdout + out.stderr

    write(trace, [*requests, {"arrival_s": 1.5, "input_len": 8, "output_len": 2}])   # another trace: measured again
    rc, again = run_api(recipe)
    assert rc == 0 and [s["status"] for s in again["steps"] if s["name"].startswith("serving[")] == ["built"]

    write(trace, [*requests, "{bad"])
    out = qbuild("plan", recipe)
    assert out.returncode == 2 and "evaluation.serving.trace" in out.stderr and "trace.jsonl:5: not JSON" in out.stderr
