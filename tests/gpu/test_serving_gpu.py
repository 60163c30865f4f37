"""GPU suite for the serving servers: vLLM, SGLang and trtllm-serve each serve the 2-layer SmolLM2 checkpoint through
qbuild's lifecycle (127.0.0.1, free port, readiness, stop and reap) and are swept by qbuild's streaming client, under
the default config and an fp8 KV cache.

Needs an NVIDIA GPU and the server's package importable in this Python; each server is skipped cleanly where its
package is missing (found with importlib.util.find_spec, never imported at collection time).
NOT RUN in the workplace where it was written (no GPU and none of these packages there).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.gpu

SERVERS = [("vllm", "vllm"), ("sglang", "sglang"), ("trtllm-serve", "tensorrt_llm")]


@pytest.mark.parametrize("server, module", SERVERS)
@pytest.mark.parametrize("kv", [None, "fp8"])
def test_gpu_server_serves_and_stops(server, module, kv, tiny_model_dir, tmp_path):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    from qbuild.planning.recipe import ServingConfig
    from qbuild.plugins import servers
    from qbuild.serving.client import Workload, sweep
    from qbuild.serving.server import running

    s = servers.get(server)
    if s.unavailable():
        pytest.skip(s.unavailable())
    launch = s.launch(tiny_model_dir, ServingConfig(name="t", kv_cache_dtype=kv), threads=4, slots=4, context=256,
                      workdir=tmp_path)
    work = Workload(prompts=[list(range(100, 164))] * 12, output_len=16, requests=8, warmup=2, model=launch.model_name)
    with running(launch, tmp_path / "server.log", "tiny", ready_timeout_s=900) as srv:
        pid = srv.pid
        points = sweep(srv.url, work, [1, 4], between=srv.check_alive)
    assert not os.path.exists(f"/proc/{pid}")
    for p in points:
        assert p["errors"] == 0, p.get("first_error")
        assert p["output_tok_s"] == pytest.approx(16 * p["requests_s"], rel=1e-3)   # ignore_eos honoured
