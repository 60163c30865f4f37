"""GPU suite for the TensorRT-LLM path: build engines, load them, generate, measure PPL and throughput.

Also runs qbuild's own engine evaluation steps (perplexity/KLD through qbuild/trtllm/_shim.py,
throughput through trtllm-bench) with a target built with gather_context_logits.

Needs an NVIDIA GPU and TensorRT-LLM 1.2.x importable in this Python (NVIDIA's release container;
see docs/tensorrt-llm.md for the exact commands). Skipped cleanly anywhere else: tensorrt_llm is
located with importlib.util.find_spec, never imported at collection time.
NOT RUN in the workplace where it was written (no GPU, no tensorrt_llm there). tests/gpu/run.sh sets up the
environments and runs the whole GPU suite; tests/test_gpu_suite.py checks on CPU what can be checked there
(this file's engine settings and context-logits path, through tests/fake_trtllm).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None,
                       reason="tensorrt_llm is not installed (run inside NVIDIA's TensorRT-LLM 1.2.x release container)"),
]

SCHEMES = [("fp16", {"scheme": "none", "dtype": "float16"}), ("fp8", {"scheme": "fp8"})]
# the engine this suite builds: context logits gathered (the perplexity below reads them; trtllm-build adds
# --logits_dtype float32 with them), FP8 context attention explicitly off (qbuild's default)
ENGINE_TARGET = {"type": "tensorrt-llm", "max_batch_size": 8, "max_input_len": 512, "max_seq_len": 1024,
                 "max_num_tokens": 4096, "gather_context_logits": True}


def run_recipe(tmp_path, recipe: dict) -> dict:
    """`qbuild run --json` with this interpreter as the TensorRT-LLM one; the summary."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "QBUILD_TRTLLM_PYTHON": sys.executable}
    out = subprocess.run([sys.executable, "-m", "qbuild", "run", str(path), "--json"], env=env,
                         capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def engine_context_nll(engine: Path, tokenizer: Path, windows: list[list[int]], vocab: int) -> tuple[float, int]:
    """Sum of -log p(token | prefix) over tokens 1..n-1 of each window, from the engine's context logits (sliced to
    the source vocabulary; KV-cache block reuse off, as qbuild's shim does, so no prefix goes uncomputed)."""
    import numpy as np
    from tensorrt_llm import SamplingParams
    from tensorrt_llm._tensorrt_engine import LLM
    from tensorrt_llm.llmapi import KvCacheConfig

    llm = LLM(model=str(engine), tokenizer=str(tokenizer), kv_cache_config=KvCacheConfig(enable_block_reuse=False))
    nll, count = 0.0, 0
    try:
        for w in windows:
            out = llm.generate([w], SamplingParams(max_tokens=1, return_context_logits=True))[0]
            assert out.context_logits is not None, "engine built without gather_context_logits"
            logits = out.context_logits
            logits = logits.detach().float().cpu().numpy() if hasattr(logits, "detach") else np.asarray(logits)
            logits = logits[:, :vocab].astype(np.float64)
            logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            nll -= float(logp[np.arange(len(w) - 1), np.asarray(w[1:])].sum())
            count += len(w) - 1
    finally:
        llm.shutdown()
    return nll, count


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
    from qbuild.trtllm import engine as trt
    from qbuild.trtllm import env as trtllm_env

    manifest, engine = _build(tmp_path, model_dir, name, variant)
    gpu = trtllm_env.gpu()
    info = trt.parse_engine_dir(engine)
    assert info["complete"] and info["gpu_sm"] == gpu.sm and manifest["toolchain"]["gpu.sm"] == gpu.sm
    assert manifest["info"]["gpu"]["driver"] == gpu.driver and manifest["info"]["tensorrt"]

    # load + generate through the LLM API (TensorRT engine backend of 1.2.x)
    from tensorrt_llm import SamplingParams
    from tensorrt_llm._tensorrt_engine import LLM

    llm = LLM(model=str(engine), tokenizer=str(engine))
    text = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].outputs[0].text
    assert text.strip()
    llm.shutdown()

    # perplexity, fixed-window protocol: score tokens 1..n-1 of each window from context logits
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(engine))
    import inspect

    ids = tok("\n\n".join(inspect.getsource(m) for m in (json, os, subprocess)), add_special_tokens=False)["input_ids"]
    windows = [ids[i: i + 512] for i in range(0, len(ids) - 512, 512)][:4]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    nll, count = engine_context_nll(engine, engine, windows, vocab)
    ppl = math.exp(nll / count)
    assert 1.0 < ppl < 200.0, ppl

    # throughput through trtllm-bench
    ds = tmp_path / "bench.jsonl"
    ds.write_text(trt.bench_dataset(32, 128, 32, tok.vocab_size))
    report = tmp_path / "report.json"
    # --model_path must be an HF dir (trtllm-bench reads its config.json with AutoConfig); the engine's is TRT-LLM's
    args = trt.trtllm_bench_args("local-model", model_dir, engine, ds, report, num_requests=32, warmup=2)
    run = subprocess.run([sys.executable, "-c", "import sys; from tensorrt_llm.commands.bench import main; "
                          "sys.argv[0]='trtllm-bench'; main()", *args[1:]], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(report.read_text())


def test_engine_perplexity_and_throughput_steps(tmp_path, model_dir):
    """qbuild's own engine evaluation steps (qbuild/trtllm/runtime.py): PPL/KLD through the shim, trtllm-bench."""
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
