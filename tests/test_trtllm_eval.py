"""TensorRT-LLM engines as evaluated artifacts, on CPU: plan-time keys and availability of engine
evaluation steps, and the runner → shim → summarize → manifest path end to end through a FAKE
TensorRT-LLM interpreter (tests/fake_trtllm: a stub `tensorrt_llm` package on PYTHONPATH, test-only).

Nothing here runs TensorRT-LLM; the real thing is tests/gpu/test_trtllm_gpu.py (not run here).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from qbuild.envs import tensorrt_llm as trtllm_env
from qbuild.errors import RecipeError

H100 = "NVIDIA H100 80GB HBM3:9.0:550.54.15"
H100_PCIE = "NVIDIA H100 PCIe:9.0:560.35.03"
L4 = "NVIDIA L4:8.9:550.54.15"
TRT_121 = "1.2.1:10.13.3.9:13.0"
FAKE_DIR = Path(__file__).parent / "fake_trtllm"
FAKE_PYTHON = f"env PYTHONPATH={FAKE_DIR} {sys.executable}"   # a wrapper command, as a container wrapper would be
EVAL = {"baseline": False, "perplexity": {"context_length": 64, "max_windows": 2}}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv(trtllm_env.ENV_PYTHON, raising=False)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, TRT_121)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _recipe(tmp_path: Path, model_dir: Path, evaluation: dict, **target) -> Path:
    data = {"name": "trteval", "model": {"source": "local", "path": str(model_dir)},
            "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
            "variants": [{"name": "fp8", "method": "modelopt", "scheme": "fp8"}],
            "targets": [{"type": "tensorrt-llm", "max_batch_size": 4, "max_input_len": 128, "max_seq_len": 256,
                         "max_num_tokens": 512, "gather_context_logits": True, "python": FAKE_PYTHON, **target}],
            "evaluation": evaluation, "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plan(path: Path) -> dict:
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.plan import make_plan
    from qbuild.planning.recipe import load_recipe

    r = load_recipe(path)
    return {p.step.name: p for p in make_plan(r, path.parent, Store(Path(r.store.path))).steps}


def with_fake_trtllm(fn):
    """Call fn() with the stub tensorrt_llm importable; never leave it importable in this process afterwards."""
    sys.path.insert(0, str(FAKE_DIR))
    try:
        return fn()
    finally:
        sys.path.remove(str(FAKE_DIR))
        for m in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
            del sys.modules[m]


def stub_fake_logits():
    def load():
        from tensorrt_llm._tensorrt_engine import fake_logits

        return fake_logits

    return with_fake_trtllm(load)


@pytest.fixture
def fake_model(tmp_path):
    from helpers import fake_model

    return fake_model(tmp_path / "m")


# --- plan: steps, keys, availability -----------------------------------------------------------------------
def test_engine_eval_steps_planned_with_engine_facts_in_key(tmp_path, fake_model):
    ev = {**EVAL, "throughput": {"batch_sizes": [1, 2], "input_len": 32, "output_len": 8}}
    plan = _plan(_recipe(tmp_path, fake_model, ev))
    engine = plan["engine[fp8.trtllm]"].step
    ppl, speed = plan["perplexity[fp8.trtllm]"], plan["throughput[fp8.trtllm]"]
    assert ppl.status == speed.status == "miss"
    assert ppl.step.inputs["model"] is engine and speed.step.inputs["model"] is engine
    assert ppl.step.params["runtime"] == "tensorrt-llm" and ppl.step.requires_gpu
    assert ppl.step.runner == "qbuild.evaluate.quality:perplexity"
    facts = {"gpu.sm": "9.0", "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3.9", "cuda": "13.0"}
    assert facts.items() <= ppl.step.toolchain().items()
    assert (facts | {"gpu.name": "NVIDIA H100 80GB HBM3"}).items() <= speed.step.toolchain().items()
    assert "hw.cpu" in speed.step.toolchain()  # timings: the machine enters the key
    assert ppl.step.runtime_args["python"] == FAKE_PYTHON  # runs in the configured TensorRT-LLM interpreter
    assert "perplexity[fp8]" not in plan  # a TensorRT-LLM checkpoint has no runtime of its own
    assert "kld[fp8.trtllm]" not in plan  # kld: false


def test_engine_eval_key_sensitivity(tmp_path, fake_model, monkeypatch):
    from qbuild.base import fingerprint

    ev = {**EVAL, "throughput": {"batch_sizes": [1], "input_len": 32, "output_len": 8}}
    path = _recipe(tmp_path, fake_model, ev)
    base = {n: p.step.key for n, p in _plan(path).items()}

    monkeypatch.setenv(trtllm_env.FAKE_GPU, L4)                        # SM changed → engine and evaluations miss
    l4 = {n: p.step.key for n, p in _plan(path).items()}
    for name in ("engine[fp8.trtllm]", "perplexity[fp8.trtllm]", "throughput[fp8.trtllm]"):
        assert l4[name] != base[name], name

    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100_PCIE)                 # same SM, another GPU model: another engine
    pcie = {n: p.step.key for n, p in _plan(path).items()}
    for name in ("engine[fp8.trtllm]", "perplexity[fp8.trtllm]", "throughput[fp8.trtllm]"):
        assert pcie[name] != base[name], name
    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100.replace("550.54.15", "560.35.03"))   # the same GPU, another driver
    assert _plan(path)["engine[fp8.trtllm]"].step.key == base["engine[fp8.trtllm]"]

    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, "1.2.0:10.13.3.9:13.0")  # TensorRT-LLM changed
    assert _plan(path)["perplexity[fp8.trtllm]"].step.key != base["perplexity[fp8.trtllm]"]

    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, TRT_121)
    real = fingerprint.package_version
    monkeypatch.setattr(fingerprint, "package_version", lambda d: "99.0" if d in ("rich", "click", "filelock") else real(d))
    assert _plan(path)["perplexity[fp8.trtllm]"].step.key == base["perplexity[fp8.trtllm]"]  # unrelated upgrade
    monkeypatch.setattr(fingerprint, "package_version", real)

    path = _recipe(tmp_path, fake_model, {**ev, "perplexity": {"context_length": 64, "max_windows": 3}})
    changed = {n: p.step.key for n, p in _plan(path).items()}
    assert changed["perplexity[fp8.trtllm]"] != base["perplexity[fp8.trtllm]"]
    assert changed["engine[fp8.trtllm]"] == base["engine[fp8.trtllm]"]  # an evaluation setting never rebuilds engines


def test_engine_eval_needs_gpu_without_one(tmp_path, fake_model, monkeypatch):
    monkeypatch.setenv(trtllm_env.FAKE_GPU, "none")
    ev = {**EVAL, "throughput": {"batch_sizes": [1], "input_len": 32, "output_len": 8}}
    plan = _plan(_recipe(tmp_path, fake_model, ev, on_missing_gpu="skip"))
    for name in ("engine[fp8.trtllm]", "perplexity[fp8.trtllm]", "throughput[fp8.trtllm]"):
        assert plan[name].status == "needs-gpu" and "needs GPU" in plan[name].reason, name
        assert plan[name].step.on_unavailable == "skip"
    pinned = _plan(_recipe(tmp_path, fake_model, EVAL, expect={
        "sm": "9.0", "gpu_name": "NVIDIA H100 80GB HBM3", "arch": trtllm_env.host_arch(), "tensorrt_llm": "1.2.1",
        "tensorrt": "10.13.3.9", "cuda": "13.0"}))
    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100)
    on_gpu = _plan(_recipe(tmp_path, fake_model, EVAL))
    # pinned: a machine without a GPU computes the same evaluation key (a stored result would be a hit)
    assert pinned["perplexity[fp8.trtllm]"].step.key == on_gpu["perplexity[fp8.trtllm]"].step.key
    assert pinned["perplexity[fp8.trtllm]"].step.on_unavailable == "fail"


def test_engine_without_context_logits_gets_no_perplexity(tmp_path, fake_model, caplog):
    plan = _plan(_recipe(tmp_path, fake_model, EVAL, gather_context_logits=False))
    assert "engine[fp8.trtllm]" in plan and "perplexity[fp8.trtllm]" not in plan
    assert "gather_context_logits" in caplog.text


@pytest.mark.parametrize("ev, field", [
    ({**EVAL, "perplexity": {"context_length": 200}}, "evaluation.perplexity.context_length"),
    ({**EVAL, "throughput": {"batch_sizes": [8], "input_len": 32}}, "evaluation.throughput.batch_sizes"),
    ({**EVAL, "throughput": {"input_len": 250, "output_len": 8}}, "evaluation.throughput.input_len"),
])
def test_engine_eval_settings_must_fit_the_engine(tmp_path, fake_model, ev, field):
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        _plan(_recipe(tmp_path, fake_model, ev))


# --- end to end through the fake TensorRT-LLM interpreter ----------------------------------------------------
def _store_checkpoint(path: Path, tiny_model_dir: Path) -> None:
    """Store the modelopt variant (a tiny fake TensorRT-LLM checkpoint): no quantization runs here."""
    from test_tensorrt_llm import _fake_checkpoint

    from qbuild.artifacts.store import Store

    q = _plan(path)["quantize[fp8]"].step
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    ckpt = _fake_checkpoint(path.parent / "ck", quantization={"quant_algo": "FP8"}, vocab_size=vocab)
    store = Store(path.parent / "store")
    out = store.new_tmp(q.key) / "out"
    shutil.copytree(ckpt, out)
    store.publish(q.key, out, {"kind": "quantize", "name": q.name, "variant": "fp8", "format": q.format,
                               "params": q.params, "toolchain": q.toolchain()})


def _run(path: Path) -> tuple[int, dict, str]:
    from qbuild.cli import cli

    res = CliRunner().invoke(cli, ["run", str(path), "--json"], catch_exceptions=False)
    out = res.output
    return res.exit_code, (json.loads(out[out.index("{"):]) if "{" in out else {}), out


def test_engine_ppl_kld_throughput_end_to_end_with_fake_interpreter(tmp_path, tiny_model_dir):
    from qbuild.artifacts.store import Store
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.evaluate.data import load_tokens

    fake_logits = stub_fake_logits()   # the stub's deterministic logits, to check against

    ev = {"baseline": True, "kld": True, "perplexity": {"context_length": 64, "max_windows": 2},
          "throughput": {"batch_sizes": [1, 2], "input_len": 16, "output_len": 4, "warmup": 1, "repetitions": 2}}
    path = _recipe(tmp_path, tiny_model_dir, ev)
    _store_checkpoint(path, tiny_model_dir)
    code, summary, out = _run(path)
    assert code == 0, out
    steps = {s["name"]: s for s in summary["steps"]}
    for name in ("engine[fp8.trtllm]", "perplexity[fp8.trtllm]", "reference[baseline]", "throughput[fp8.trtllm]"):
        assert steps[name]["status"] == "built", steps[name]

    # the engine row, next to the variants, with what was measured through the engine
    rows = {r["variant"]: r for r in summary["variants"]}
    assert set(rows) == {"baseline", "fp8", "fp8.trtllm"}
    row = rows["fp8.trtllm"]
    assert row["target"] == "tensorrt-llm" and row["format"] == "trtllm-engine" and row["status"] == "built"

    # PPL equals the protocol applied to the stub's logits: same windows, same scoring, same summarize()
    store = Store(tmp_path / "store")
    data_path = store.object_dir(steps[next(n for n in steps if n.startswith("eval-data"))]["digest"])
    ids, info = load_tokens(data_path)
    # SmolLM2's tokenizer adds no BOS, so by the model's own convention its windows start without one
    wins = windows(ids, "fixed-window", 64, False, info["bos_token_id"], 2)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    expected = summarize([window_nll(fake_logits(w.tokens, vocab), w) for w in wins])
    assert row["ppl"] == pytest.approx(expected["ppl"], rel=1e-9)
    assert row["delta_ppl"] == pytest.approx(row["ppl"] - rows["baseline"]["ppl"])
    assert row["kld"] > 0 and 0 <= row["top1"] <= 1
    assert row["decode_tok_s"] == pytest.approx(100.0)      # batch 1 × the stub's 100 tok/s per user
    assert row["ttft_ms"] == pytest.approx(10.0)

    # recorded like every other result: protocol, runtime, hardware, toolchain
    ppl_m = store.manifest(steps["perplexity[fp8.trtllm]"]["digest"])
    ppl_dir = store.object_dir(ppl_m["digest"])
    result = json.loads((ppl_dir / "perplexity.json").read_text())
    assert result["protocol"] == {"protocol": "fixed-window", "context_length": 64, "stride": None, "max_windows": 2,
                                       "add_bos": False, "join": info["join"], "sources": info["sources"],
                                       "bos_token_id": info["bos_token_id"]}
    assert result["tokens_scored"] == expected["tokens_scored"] and result["windows"] == 2
    assert result["runtime"]["name"] == "tensorrt-llm" and result["runtime"]["gpu"]["sm"] == "9.0"
    assert ppl_m["toolchain"]["gpu.sm"] == "9.0" and ppl_m["toolchain"]["tensorrt_llm"] == "1.2.1"
    # PPL and KLD from the one pass; no work files
    assert sorted(p.name for p in ppl_dir.iterdir() if p.name != "manifest.json") == ["divergence.json",
                                                                                        "perplexity.json"]
    speed = json.loads((store.object_dir(steps["throughput[fp8.trtllm]"]["digest"]) / "throughput.json").read_text())
    assert [r["batch_size"] for r in speed["results"]] == [1, 2]
    assert speed["results"][1]["decode_tok_s"] == pytest.approx(200.0)
    assert speed["results"][0]["token_latency_ms_p95"] == pytest.approx(12.5)
    assert speed["hardware"]["gpu"]["name"] == "NVIDIA H100 80GB HBM3" and speed["hardware"]["gpu_bench"]
    assert speed["settings"]["trtllm_bench"][0][:4] == ["trtllm-bench", "--model", "qbuild-model", "--model_path"]
    assert "--streaming" in speed["settings"]["trtllm_bench"][0]
    kld = json.loads((ppl_dir / "divergence.json").read_text())
    assert kld["tokens_scored"] == expected["tokens_scored"] and kld["runtime"]["name"] == "tensorrt-llm"

    # a second run builds nothing: engine and its evaluations are cached
    code, again, out = _run(path)
    assert code == 0, out
    assert {s["name"]: s["status"] for s in again["steps"]}["perplexity[fp8.trtllm]"] == "cached"
    assert again["counts"]["built"] == 0


def test_engine_evals_skipped_without_gpu(tmp_path, tiny_model_dir, monkeypatch):
    path = _recipe(tmp_path, tiny_model_dir, EVAL, on_missing_gpu="skip")
    _store_checkpoint(path, tiny_model_dir)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, "none")
    code, summary, out = _run(path)
    assert code == 0, out
    status = {s["name"]: s for s in summary["steps"]}
    assert status["engine[fp8.trtllm]"]["status"] == "skipped"
    assert status["perplexity[fp8.trtllm]"]["status"] == "skipped"  # its engine is skipped first: "input failed"
    assert summary["counts"]["failed"] == 0
    row = next(r for r in summary["variants"] if r["variant"] == "fp8.trtllm")
    assert row["status"] == "skipped" and row["ppl"] is None


# --- the runner directly (no CLI): failures are clear ---------------------------------------------------------
def _runner_ctx(tmp_path: Path, gather: bool, sm: str = "9.0", engine_vocab: int = 50):
    import numpy as np
    from safetensors.numpy import save_file

    from qbuild.contract.step import StepContext

    engine, tok, data = tmp_path / "engine", tmp_path / "tok", tmp_path / "data"
    for d in (engine, tok, data):
        d.mkdir(parents=True)
    (engine / "config.json").write_text(json.dumps({
        "pretrained_config": {"vocab_size": engine_vocab, "logits_dtype": "float32"},
        "build_config": {"max_input_len": 128, "max_seq_len": 256, "gather_context_logits": gather}}))
    (engine / "rank0.engine").write_bytes(b"x")
    (tok / "tokenizer.json").write_text("{}")
    (tok / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 50, "hidden_size": 64,
                                                 "num_hidden_layers": 2, "num_attention_heads": 4}))
    save_file({"input_ids": (np.arange(300) * 7 % 50).astype(np.int32)}, str(data / "tokens.safetensors"))
    (data / "tokens.json").write_text(json.dumps({"bos_token_id": 1, "join": "\n\n", "sources": [{"type": "x"}]}))
    (tmp_path / "obj" / "out").mkdir(parents=True)
    params = {"protocol": "sliding-window", "context_length": 64, "stride": 16, "max_windows": 5, "add_bos": True,
              "runtime": "tensorrt-llm"}
    import platform

    expected = {"gpu.sm": sm, "gpu.name": H100.rsplit(":", 2)[0], "host.arch": platform.machine(),
                "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3.9", "cuda": "13.0"}
    return StepContext(params=params, inputs={"model": engine, "tokenizer": tok, "data": data}, input_manifests={},
                       out=tmp_path / "obj" / "out", threads=1, device="auto", step_name="perplexity[x.trtllm]",
                       runtime_args={"python": FAKE_PYTHON, "expected": expected})


def test_runner_sliding_window_through_shim(tmp_path):
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.evaluate import quality
    from qbuild.evaluate.data import load_tokens

    fake_logits = stub_fake_logits()
    ctx = _runner_ctx(tmp_path, gather=True)
    res = quality.perplexity(ctx)
    ids, _ = load_tokens(ctx.inputs["data"])
    wins = windows(ids, "sliding-window", 64, True, 1, 5, 16)
    assert res["metrics"]["ppl"] == pytest.approx(summarize([window_nll(fake_logits(w.tokens, 50), w) for w in wins])["ppl"])
    assert json.loads((ctx.out / "perplexity.json").read_text())["protocol"]["stride"] == 16
    assert [p.name for p in ctx.out.parent.iterdir()] == ["out"]  # the request/work dir is cleaned up


def test_runner_slices_padded_engine_logits_to_source_vocab(tmp_path):
    """Issue 24, point 6: an AWQ engine's vocabulary is ModelOpt's padded one (a multiple of 64); its extra columns
    (zero-weight rows: logit 0) are cut before scoring, so PPL is the source vocabulary's."""
    from qbuild.contract.protocol import summarize, window_nll, windows
    from qbuild.evaluate import quality
    from qbuild.evaluate.data import load_tokens

    fake_logits = stub_fake_logits()
    ctx = _runner_ctx(tmp_path, gather=True, engine_vocab=64)   # source vocab 50, padded to 64
    res = quality.perplexity(ctx)
    ids, _ = load_tokens(ctx.inputs["data"])
    wins = windows(ids, "sliding-window", 64, True, 1, 5, 16)
    sliced = summarize([window_nll(fake_logits(w.tokens, 64)[:, :50], w) for w in wins])["ppl"]
    padded = summarize([window_nll(fake_logits(w.tokens, 64), w) for w in wins])["ppl"]
    assert res["metrics"]["ppl"] == pytest.approx(sliced, rel=1e-9) and sliced != pytest.approx(padded, rel=1e-3)


def test_runner_fails_clearly(tmp_path):
    from qbuild.evaluate import quality

    with pytest.raises(RuntimeError, match="exited with code"):   # engine without context logits: the shim says so
        quality.perplexity(_runner_ctx(tmp_path / "a", gather=False))
    with pytest.raises(RuntimeError, match="not the one the key was computed for.*gpu.sm: planned 8.9, found 9.0"):
        quality.perplexity(_runner_ctx(tmp_path / "b", gather=True, sm="8.9"))
    assert "tensorrt_llm" not in sys.modules


def test_parse_bench_report_without_streaming():
    from qbuild.runtimes.tensorrt_llm import parse_bench_report

    row = parse_bench_report({"performance": {"system_output_throughput_tok_s": 300.0}}, 4, 128)
    assert row["decode_tok_s"] == 300.0 and row["ttft_ms"] is None and row["prefill_tok_s"] is None
    assert row["decode_tok_s_source"] == "performance.system_output_throughput_tok_s"


def test_build_and_bench_args_for_evaluation():
    from qbuild.runtimes import tensorrt_llm as engine_runtime
    from qbuild.targets import tensorrt_llm as trt

    t = trt.EngineTarget(type="tensorrt-llm", gather_context_logits=True)
    args = trt.trtllm_build_args(trt.build_settings(t), "/c", "/e")
    assert args[-3:] == ["--gather_context_logits", "--logits_dtype", "float32"]
    assert trt.build_config(trt.build_settings(t))["gather_context_logits"] is True
    assert "--gather_context_logits" not in trt.trtllm_build_args(trt.build_settings(trt.EngineTarget(type="tensorrt-llm")), "c", "e")
    bench = engine_runtime.trtllm_bench_args("m", "/hf", "/e", "/d", "/r", concurrency=2, max_batch_size=2, streaming=True)
    assert bench[-5:] == ["--concurrency", "2", "--max_batch_size", "2", "--streaming"]


def test_gates_apply_to_engines_only_when_named():
    from qbuild.evaluate.gates import check_gates
    from qbuild.planning.recipe import Gate

    summary = {"variants": [{"variant": "fp8", "kld": 0.05, "target": None},
                            {"variant": "fp8.trtllm", "kld": None, "target": "tensorrt-llm"}]}
    assert [r["variant"] for r in check_gates([Gate(max_kld=0.1)], summary)] == ["fp8"]
    named = check_gates([Gate(variants=["fp8.trtllm"], max_kld=0.1)], summary)
    assert [(r["variant"], r["passed"]) for r in named] == [("fp8.trtllm", False)]  # unmeasured fails when named
