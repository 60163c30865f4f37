"""GPU suite for the TensorRT-LLM path: build engines, load them, generate, measure PPL and throughput.

Also runs qbuild's own engine evaluation steps (perplexity/KLD through qbuild/runtimes/_trtllm_shim.py,
throughput through trtllm-bench) with a target built with gather_context_logits.

Needs an NVIDIA GPU and a TensorRT-LLM 1.2.x interpreter: $QBUILD_TRTLLM_PYTHON (tests/gpu/run.sh points it at
qbuild's `tensorrt-llm-1.2` backend environment) or qbuild's own Python if it has tensorrt_llm. pytest itself runs
in qbuild's environment; everything TensorRT-LLM runs in that interpreter (the engine build and evaluation steps,
trtllm_engine_check.py, trtllm-bench), as in real use. Skipped, with the reason, anywhere else; tensorrt_llm is
never imported here.
NOT RUN in the workplace where it was written (no GPU, no tensorrt_llm there). tests/gpu/run.sh sets up the
environments and runs the whole GPU suite; tests/test_gpu_suite.py checks on CPU what can be checked there
(this file's engine settings and context-logits path, through tests/fake_trtllm).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qbuild.envs import tensorrt_llm as trtllm_env

ENGINE_CHECK = Path(__file__).with_name("trtllm_engine_check.py")


def unavailable() -> str:
    """Why this machine cannot run the suite ("" = it can)."""
    if trtllm_env.gpu() is None:
        return "no NVIDIA GPU (nvidia-smi)"
    env = trtllm_env.trtllm(trtllm_env.configured_python())
    if env is None or not (env.tensorrt_llm or "").startswith("1.2."):
        found = f"TensorRT-LLM {env.tensorrt_llm}" if env else "no tensorrt_llm"
        return (f"needs TensorRT-LLM 1.2.x in ${trtllm_env.ENV_PYTHON} or this Python ({found}); "
                "tests/gpu/run.sh creates it")
    return ""


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "ready")]


def trtllm_python() -> list[str]:
    env = trtllm_env.trtllm(trtllm_env.configured_python())
    return env.python.split() if env and env.python else [sys.executable]


def engine_check(engine: Path, tokenizer: Path, vocab: int, windows: list[list[int]], prompt: str = "",
                 python: list[str] | None = None) -> dict:
    """trtllm_engine_check.py in the TensorRT-LLM interpreter: generated text and context-logit NLL."""
    work = engine.parent / f"{engine.name}-check"
    work.mkdir(exist_ok=True)
    (work / "request.json").write_text(json.dumps({"engine": str(engine), "tokenizer": str(tokenizer),
                                                   "vocab_size": vocab, "prompt": prompt, "windows": windows}))
    run = subprocess.run([*(python or trtllm_python()), str(ENGINE_CHECK), str(work / "request.json"),
                          str(work / "result.json")], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((work / "result.json").read_text())


SCHEMES = [("fp16", {"scheme": "none", "dtype": "float16"}), ("fp8", {"scheme": "fp8"})]
# the engine this suite builds: context logits gathered (the perplexity below reads them; trtllm-build adds
# --logits_dtype float32 with them), FP8 context attention explicitly off (qbuild's default)
ENGINE_TARGET = {"type": "tensorrt-llm", "max_batch_size": 8, "max_input_len": 512, "max_seq_len": 1024,
                 "max_num_tokens": 4096, "gather_context_logits": True}


def run_recipe(tmp_path, recipe: dict) -> dict:
    """`qbuild run --json` (qbuild's Python; TensorRT-LLM steps in the configured interpreter); the summary."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = subprocess.run([sys.executable, "-m", "qbuild", "run", str(path), "--json"], env=dict(os.environ),
                         capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module", params=["tiny_model_dir", "smollm2_dir"])

def model_dir(request):
    return request.getfixturevalue(request.param)


def _build(tmp_path: Path, model_dir: Path, name: str, variant: dict) -> tuple[dict, Path]:
    from qbuild.artifacts.store import Store

    recipe = {"name": "gpu", "model": {"source": "local", "path": str(model_dir)},
              "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 16, "seq_len": 256},
              "variants": [{"name": name, "method": "modelopt", **variant}],
              "targets": [dict(ENGINE_TARGET)],
              "evaluation": {"baseline": False, "perplexity": None}, "store": {"path": str(tmp_path / "store")}}
    summary = run_recipe(tmp_path, recipe)
    step = next(s for s in summary["steps"] if s["name"] == f"engine[{name}.trtllm]")
    store = Store(tmp_path / "store")
    return store.manifest(step["digest"]), store.object_dir(step["digest"])


@pytest.mark.parametrize("name, variant", SCHEMES, ids=[s[0] for s in SCHEMES])
def test_build_load_generate_ppl_throughput(tmp_path, model_dir, name, variant):
    from qbuild.envs import tensorrt_llm as trtllm_env
    from qbuild.runtimes import tensorrt_llm as engine_runtime
    from qbuild.targets import tensorrt_llm as trt

    manifest, engine = _build(tmp_path, model_dir, name, variant)
    gpu = trtllm_env.gpu()
    info = trt.parse_engine_dir(engine)
    assert info["complete"] and info["gpu_sm"] == gpu.sm and manifest["toolchain"]["gpu.sm"] == gpu.sm
    assert manifest["info"]["gpu"]["driver"] == gpu.driver and manifest["info"]["tensorrt"]

    # load + generate, and perplexity from context logits (fixed windows: tokens 1..n-1 of each scored)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    import inspect

    ids = tok("\n\n".join(inspect.getsource(m) for m in (json, os, subprocess)), add_special_tokens=False)["input_ids"]
    windows = [ids[i: i + 512] for i in range(0, len(ids) - 512, 512)][:4]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    checked = engine_check(engine, engine, vocab, windows, prompt="The capital of France is")
    assert checked["text"].strip()
    ppl = math.exp(checked["nll"] / checked["count"])
    print(f"[gpu-report] engine {name} {model_dir.name}: ppl {ppl:.4f} over {checked['count']} tokens")
    assert 1.0 < ppl < 200.0, ppl

    # throughput through trtllm-bench
    ds = tmp_path / "bench.jsonl"
    ds.write_text(engine_runtime.bench_dataset(32, 128, 32, tok.vocab_size))
    report = tmp_path / "report.json"
    # --model_path must be an HF dir (trtllm-bench reads its config.json with AutoConfig); the engine's is TRT-LLM's
    args = engine_runtime.trtllm_bench_args("local-model", model_dir, engine, ds, report, num_requests=32, warmup=2)
    run = subprocess.run([*trtllm_python(), "-c", engine_runtime.BENCH_SHIM, *args[1:]], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(report.read_text())


def test_engine_perplexity_and_throughput_steps(tmp_path, model_dir):
    """qbuild's own engine evaluation steps (qbuild/runtimes/tensorrt_llm.py): PPL/KLD through the shim, trtllm-bench."""
    from qbuild.artifacts.store import Store

    ev = {"baseline": True, "kld": True,
          "perplexity": {"protocol": "fixed-window", "context_length": 256, "max_windows": 4},
          "throughput": {"batch_sizes": [1, 4], "input_len": 128, "output_len": 32, "warmup": 1, "repetitions": 2}}
    recipe = {"name": "gpu-eval", "model": {"source": "local", "path": str(model_dir)},
              "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 16, "seq_len": 256},
              "variants": [{"name": "fp16", "method": "modelopt", "scheme": "none", "dtype": "float16"}],
              "targets": [dict(ENGINE_TARGET)],
              "evaluation": ev, "store": {"path": str(tmp_path / "store")}}
    summary = run_recipe(tmp_path, recipe)
    steps = {s["name"]: s for s in summary["steps"]}
    for name in ("perplexity[fp16.trtllm]", "reference[baseline]", "throughput[fp16.trtllm]"):  # KLD: same pass
        assert steps[name]["status"] == "built", steps[name]
    rows = {r["variant"]: r for r in summary["variants"]}
    engine, base = rows["fp16.trtllm"], rows["baseline"]
    print(f"[gpu-report] engine eval {model_dir.name}: engine ppl {engine['ppl']:.4f}, baseline ppl {base['ppl']:.4f}, "
          f"kld {engine['kld']:.5f}, top1 {engine['top1']:.4f}, decode {engine['decode_tok_s']:.1f} tok/s, "
          f"ttft {engine['ttft_ms']:.1f} ms")
    # an FP16 engine against the FP32 transformers baseline, same windows: close, not identical
    assert abs(engine["ppl"] - base["ppl"]) / base["ppl"] < 0.02, (engine["ppl"], base["ppl"])
    assert engine["kld"] < 0.01 and engine["top1"] > 0.95
    assert engine["decode_tok_s"] > 0 and engine["ttft_ms"] > 0
    store = Store(tmp_path / "store")
    ppl = json.loads((store.object_dir(steps["perplexity[fp16.trtllm]"]["digest"]) / "perplexity.json").read_text())
    assert ppl["protocol"]["protocol"] == "fixed-window" and ppl["windows"] == 4
    assert ppl["runtime"]["name"] == "tensorrt-llm" and ppl["runtime"]["gpu"]["sm"]


def test_second_run_rebuilds_no_engine(tmp_path, tiny_model_dir):
    m1, _ = _build(tmp_path, tiny_model_dir, "fp16", {"scheme": "none"})
    m2, _ = _build(tmp_path, tiny_model_dir, "fp16", {"scheme": "none"})
    assert m1["key"] == m2["key"] and m1["created"] == m2["created"]
