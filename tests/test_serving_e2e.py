"""Serving end to end with a real llama-server: a 2-layer SmolLM2 quantized to Q8_0 and Q4_0, each served under two
serving configs (f16 and q8_0 KV cache) and swept at concurrency 1 and 2; `qbuild select` from the store; Ctrl-C and
SIGTERM of a run in the middle of a sweep leave no server and no listening port."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time

import pytest
import yaml
from serving_helpers import LOOPBACK, connectable, listening, port_of, processes_with

from helpers import build_module_recipe, qbuild, run_api, write_recipe

pytest.importorskip("llama_cpp")
pytest.importorskip("httpx")

SERVING = {"concurrency": [1, 2], "requests": 4, "warmup": 1, "input_len": 32, "output_len": 8, "rounds": 2,
           "variants": ["q8_0", "q4_0"],   # the HF baseline's servers need a GPU (test_serving_plan.py)
           "configs": [{"name": "default"}, {"name": "kv8", "kv_cache_dtype": "q8_0"}]}


def recipe_data(model, store, serving=None, selection=None) -> dict:
    data = {"name": "srv", "model": {"source": "local", "path": str(model)},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"},
                         {"name": "q4_0", "method": "gguf", "type": "Q4_0"}],
            "evaluation": {"perplexity": {"context_length": 128, "max_windows": 2}, "kld": True,
                           "serving": serving or SERVING},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}
    if selection:
        data["selection"] = selection
    return data


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    from qbuild.models.llamacpp_toolchain import cached_bin_dir

    if cached_bin_dir() is None:
        pytest.skip("llama-server is not built yet (scripts/install.sh builds it)")
    root = tmp_path_factory.mktemp("serving")
    return build_module_recipe(root, recipe_data(tiny_model_dir, root / "store"))


def test_every_variant_served_under_every_config(built):
    for name in ("q8_0", "q4_0"):
        points = built["variants"][name]["serving"]
        assert sorted((p["config"], p["concurrency"]) for p in points) == [
            ("default", 1), ("default", 2), ("kv8", 1), ("kv8", 2)]
        for p in points:
            assert p["status"] == "built" and p["errors"] == 0 and p["completed"] == 2 * 4   # 2 rounds of 4
            for field in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99", "output_tok_s", "requests_s"):
                assert p[field] > 0, field
            assert p["output_tok_s"] == pytest.approx(8 * p["requests_s"], rel=1e-3)   # ignore_eos: 8 tokens each
            assert p["peak_rss_mb"] > 10 and p["command"].startswith("llama-server --model model.gguf --port 8080")
        kv = {p["config"]: p["kv_bytes_per_token"] for p in points}
        # 2 layers × 3 KV heads × 64 dims × (K + V): f16 2 bytes per element, q8_0 34 bytes per 32
        assert kv["default"] == pytest.approx(2 * 3 * 64 * 2 * 2)
        assert kv["kv8"] == pytest.approx(2 * 3 * 64 * 2 * 34 / 32)
    assert built["steps"]["serving[q8_0@kv8]"]["status"] == "built"
    assert "serving" not in built["variants"]["baseline"] or not built["variants"]["baseline"]["serving"]


def _object(built, name: str):
    from qbuild.artifacts.store import Store

    return Store(built["store"]).object_dir(built["steps"][name]["digest"])


def test_each_server_was_checked_against_the_offline_evaluation_before_it_was_measured(built):
    """The served check ran on every server (16 probes) before its sweep, each against the artifact's own offline
    KLD: perplexity[<variant>] for the f16 KV cache, perplexity[<variant>@kv8] for the q8_0 one."""
    for name in ("q8_0", "q4_0"):
        for config, measured in (("default", f"perplexity[{name}]"), ("kv8", f"perplexity[{name}@kv8]")):
            check = json.loads((_object(built, f"serving[{name}@{config}]") / "serving.json").read_text())["served_check"]
            offline = json.loads((_object(built, measured) / "divergence.json").read_text())
            assert check["probes"] == 4 and "refused" not in check   # 2 windows of 128: their middle and last rows
            assert check["offline"]["kld_p99"] == pytest.approx(offline["kld_p99"])
            assert 0 <= check["served_kld_lower_bound"] <= check["kld_bound"]
            assert check["served_top1"] >= check["top1_bound"]


def _halved_output_norm(gguf_dir, out) -> None:
    """A copy of a GGUF whose final norm is scaled by 0.5, as a wrong scale convention would load it: every logit
    halved. The most likely token stays the most likely; the distribution does not."""
    import shutil

    import gguf

    out.mkdir()
    shutil.copy(gguf_dir / "model.gguf", out / "model.gguf")
    reader = gguf.GGUFReader(str(out / "model.gguf"), "r+")
    norm = next(t for t in reader.tensors if t.name == "output_norm.weight")
    norm.data[:] = norm.data * 0.5
    reader.data.flush()


def test_a_server_computing_something_else_is_refused_in_one_line(built, tmp_path):
    """The broken copy builds and loads like any GGUF; llama-server serving it in place of q8_0 fails the served check
    against q8_0's offline evaluation, with the bound it missed."""
    from qbuild.planning.recipe import ServingConfig
    from qbuild.plugins import servers
    from qbuild.serving.served_check import expected, probes, run_check
    from qbuild.serving.server import running

    _halved_output_norm(_object(built, "quantize[q8_0]"), tmp_path / "broken")
    server = servers.get("llama-server")
    found = probes(_object(built, "reference[baseline]"), _object(built, "eval-data"), max_prompt=255)
    offline = expected(_object(built, "perplexity[q8_0]") / "divergence.json")
    launch = server.launch(tmp_path / "broken", ServingConfig(name="default"), threads=1, slots=1, context=256,
                           workdir=tmp_path)
    with running(launch, tmp_path / "server.log", "broken", 120) as srv:
        record = run_check(srv.url, server, launch.model_name, found, offline, 60)
        healthy_launch = server.launch(_object(built, "quantize[q8_0]"), ServingConfig(name="default"), threads=1,
                                       slots=1, context=256, workdir=tmp_path)
    assert record["refused"].startswith("KLD to the baseline at least"), record
    assert record["served_kld_lower_bound"] > 2 * record["kld_bound"]
    with running(healthy_launch, tmp_path / "healthy.log", "q8_0", 120) as srv:
        assert "refused" not in run_check(srv.url, server, healthy_launch.model_name, found, offline, 60)


def test_second_run_builds_nothing_and_keys_ignore_selection(built):
    rc, summary = run_api(built["recipe"])
    assert rc == 0 and summary["counts"]["built"] == 0
    model = yaml.safe_load(built["recipe"].read_text())["model"]["path"]
    with_selection = write_recipe(built["root"] / "sel.yaml", recipe_data(model, built["store"],
                                                                          selection={"ttft_p99_ms": 60000}))
    from qbuild import api

    plan = api.plan(with_selection)
    assert plan.to_build == 0   # a selection reads the measurements; it never changes what is measured


def test_select_picks_per_objective_and_explains_the_rest(built):
    model = yaml.safe_load(built["recipe"].read_text())["model"]["path"]
    for objective, expect in (("min_size", "q4_0"), ("max_throughput", None)):
        path = write_recipe(built["root"] / f"{objective}.yaml", recipe_data(
            model, built["store"], selection={"ttft_p99_ms": {"value": 60000, "concurrency": 2}, "max_kld": 50,
                                              "objective": objective}))
        res = qbuild("select", path, "--json")
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        sel = out["selected"]
        assert sel["config"] in ("default", "kv8") and sel["command"].startswith("llama-server ")
        if expect:
            assert sel["variant"] == expect
        else:   # the most output tok/s at concurrency 2 of all four candidates, or, within noise of it, by KLD
            tok_s = {(v["variant"], p["config"]): p["output_tok_s"] for v in built["summary"]["variants"]
                     for p in v.get("serving", []) if p.get("concurrency") == 2}
            fastest = max(tok_s, key=tok_s.get)
            if out["tie"] is None:
                assert (sel["variant"], sel["config"]) == fastest
            else:
                tied = [(c["variant"], c["config"]) for c in out["tie"]["candidates"]]
                assert fastest in tied and tied[0] == (sel["variant"], sel["config"])
                kld = {(v["variant"], p["config"]): p["kld"] for v in built["summary"]["variants"]
                       for p in v.get("serving", []) if p.get("concurrency") == 2}
                assert out["tie"]["broken_by"] != "kld" or kld[tied[0]] == min(kld[c] for c in tied)
        assert len(out["rejected"]) == 3 and all("objective" in r["why"] for r in out["rejected"])
    human = qbuild("select", path)
    assert human.returncode == 0 and "selected" in human.stdout and "serve it with: llama-server" in human.stdout


def test_select_json_carries_each_points_rounds_and_intervals(built):
    """The rounds each serving step stored and the intervals drawn from them reach `qbuild select --json`, and a
    TTFT bound inside a candidate's interval is judged within noise: rejected by default, passed under accept."""
    model = yaml.safe_load(built["recipe"].read_text())["model"]["path"]
    measured = {(v["variant"], p["config"]): p for v in built["summary"]["variants"] for p in v.get("serving", [])
                if p.get("concurrency") == 2}
    q8 = measured[("q8_0", "default")]
    assert [set(r) >= {"ttft_ms_p99", "output_tok_s", "requests_s", "completed"} for r in q8["rounds"]] == [True] * 2
    assert sum(r["completed"] for r in q8["rounds"]) == q8["completed"] == 8
    lo, hi = q8["ci"]["ttft_ms_p99"]
    assert lo <= q8["ttft_ms_p99"] <= hi and lo < hi
    bound = (lo + hi) / 2   # inside q8_0@default's interval: within noise
    for on_uncertain in ("reject", "accept"):
        path = write_recipe(built["root"] / f"noise-{on_uncertain}.yaml", recipe_data(
            model, built["store"], selection={"ttft_p99_ms": {"value": bound, "concurrency": 2},
                                              "on_uncertain": on_uncertain}))
        res = qbuild("select", path, "--json")
        out = json.loads(res.stdout)
        assert out["on_uncertain"] == on_uncertain and res.returncode in (0, 3), res.stderr
        candidates = {(c["variant"], c["config"]): c for c in [*out["rejected"], out["selected"] or {}] if c}
        judged = candidates[("q8_0", "default")]
        assert judged["slo"]["ttft_p99_ms"] == {"value": q8["ttft_ms_p99"], "ci": [lo, hi], "bound": bound,
                                                "concurrency": 2, "verdict": "uncertain"}
        assert judged["output_tok_s_ci"] == q8["ci"]["output_tok_s"]
        assert [r["output_tok_s"] for r in judged["rounds"]] == [r["output_tok_s"] for r in q8["rounds"]]
        if on_uncertain == "reject":
            assert "within noise (on_uncertain: reject)" in judged["why"]
        else:
            assert judged["uncertain"] and "within noise" not in judged.get("why", "")


def test_impossible_slo_exits_3_naming_each_miss(built):
    model = yaml.safe_load(built["recipe"].read_text())["model"]["path"]
    path = write_recipe(built["root"] / "impossible.yaml", recipe_data(
        model, built["store"], selection={"ttft_p99_ms": 0.001, "min_output_tok_s": 1e6, "max_size_mb": 1}))
    res = qbuild("select", path, "--json")
    assert res.returncode == 3
    out = json.loads(res.stdout)
    assert out["selected"] is None and len(out["rejected"]) == 4
    for r in out["rejected"]:
        assert "ttft_p99_ms" in r["why"] and "> 0.001" in r["why"] and "output_tok_s" in r["why"]
        assert "size" in r["why"] and len(r["misses"]) == 3
    human = qbuild("select", path)
    assert human.returncode == 3 and "nothing meets every selection bound" in human.stdout


def test_plan_refuses_a_config_the_engine_cannot_express(built, tiny_model_dir):
    serving = copy.deepcopy(SERVING)
    serving["configs"].append({"name": "fp8", "kv_cache_dtype": "fp8"})
    path = write_recipe(built["root"] / "fp8.yaml", recipe_data(tiny_model_dir, built["store"], serving=serving))
    res = qbuild("plan", path)
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert "evaluation.serving.configs[2]" in line and "llama.cpp has no fp8 KV cache" in line


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_run_leaves_no_server(built, tiny_model_dir, sig, code):
    """Ctrl-C / SIGTERM while a serving step sweeps: qbuild exits with its code, no llama-server and no port left."""
    serving = {**SERVING, "requests": 5000, "output_len": 64, "configs": [{"name": f"long{sig}"}]}
    store = built["store"]
    path = write_recipe(built["root"] / f"long{sig}.yaml", recipe_data(tiny_model_dir, store, serving=serving))
    proc = subprocess.Popen([sys.executable, "-m", "qbuild", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline, port = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            pids = processes_with(str(store))
            servers = [p for p in pids if port_of(p)]
            if servers and listening(port_of(servers[0])):
                port = port_of(servers[0])
                break
            time.sleep(0.2)
        assert port is not None, f"no server started: {proc.poll()} {proc.stderr.read() if proc.poll() else ''}"
        assert listening(port) == [LOOPBACK]
        time.sleep(1.0)   # in the middle of the sweep
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    time.sleep(0.5)   # the server dies with its worker (PR_SET_PDEATHSIG); give the kernel a moment to reap it
    assert not [p for p in processes_with(str(store)) if port_of(p)]
    assert not listening(port) and not connectable(port)
