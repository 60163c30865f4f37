"""GPU suite for the vllm runtime: perplexity/KLD from full-vocabulary prompt_logprobs and the load check, against
the transformers numbers on the same windows.

Needs an NVIDIA GPU and a vLLM interpreter: $QBUILD_VLLM_PYTHON (tests/gpu/run.sh points it at qbuild's `vllm`
backend environment) or qbuild's own Python if it has vllm. pytest runs in qbuild's environment; vLLM runs only in
that interpreter, through qbuild/runtimes/_vllm_shim.py. Skipped, with the reason, anywhere else.
NOT RUN in the workplace where it was written (no GPU there); tests/test_vllm_runtime.py runs the same path on CPU
through tests/fake_vllm.
"""

from __future__ import annotations

import json
import math

import pytest

from qbuild.envs import vllm as vllm_env


def unavailable() -> str:
    from qbuild.base.hardware import gpu

    if gpu() is None:   # vLLM's CPU build runs on CPUs: tests/test_vllm_cpu.py
        return "no NVIDIA GPU (nvidia-smi)"
    _, reasons, _ = vllm_env.availability()
    return "; ".join(reasons)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "ready")]


def _ctx(tmp_path, model, data, runtime: str, device: str = "cuda", reference=None):
    """A perplexity step's context, as the executor makes it (fixed windows of 256, 4 of them)."""
    from qbuild.contract.step import StepContext

    facts, _, python = vllm_env.availability()
    out = tmp_path / runtime / "out"
    out.mkdir(parents=True)
    inputs = {"model": model, "data": data} | ({"reference": reference} if reference else {})
    params = {"protocol": "fixed-window", "context_length": 256, "stride": None, "max_windows": 4, "add_bos": True,
              "runtime": runtime}
    return StepContext(params=params, inputs=inputs, input_manifests={}, out=out, threads=4, device=device,
                       step_name=f"perplexity[{runtime}]", runtime_args={"python": python, "expected": facts})


def run_recipe(tmp_path, recipe: dict, timeout: int = 1200) -> dict:
    """`qbuild run --json` of `recipe`; its summary."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = subprocess.run([sys.executable, "-m", "qbuild", "run", str(path), "--json"], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_vllm_matches_transformers_through_qbuild(tmp_path, smollm2_dir):
    """A recipe whose baseline is evaluated by transformers (CUDA) and by vLLM (the load check), and whose ModelOpt
    FP8 HF export only vLLM reads: PPL/KLD of the export come from vLLM's prompt_logprobs."""
    recipe = {"name": "gpu-vllm", "model": {"source": "local", "path": str(smollm2_dir)},
              "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 16, "seq_len": 256},
              "variants": [{"name": "fp8-hf", "method": "modelopt", "scheme": "fp8", "export": "hf"}],
              "evaluation": {"baseline": True, "kld": True,
                             "perplexity": {"protocol": "fixed-window", "context_length": 256, "max_windows": 4},
                             "load_check": {"tokens": 16, "runtimes": ["transformers", "vllm"]}},
              "runtime": {"device": "cuda"}, "store": {"path": str(tmp_path / "store")}}
    summary = run_recipe(tmp_path, recipe)
    steps = {s["name"]: s for s in summary["steps"]}
    for name in ("perplexity[fp8-hf]", "load-check[baseline@vllm]", "load-check[fp8-hf]"):
        assert steps[name]["status"] == "built", steps[name]
    rows = {r["variant"]: r for r in summary["variants"]}
    fp8, base = rows["fp8-hf"], rows["baseline"]
    print(f"[gpu-report] vllm fp8-hf smollm2: ppl {fp8['ppl']:.4f} (baseline {base['ppl']:.4f}), kld {fp8['kld']:.5f}, "
          f"top1 {fp8['top1']:.4f}")
    # FP8 of a 135M model against the FP32 baseline: a few percent, not more (expectations, not measurements)
    assert abs(fp8["ppl"] - base["ppl"]) / base["ppl"] < 0.05 and fp8["kld"] < 0.05 and fp8["top1"] > 0.9


def test_vllm_bf16_baseline_logprobs_equal_transformers(tmp_path, smollm2_dir):
    """The unquantized model through both runtimes, the same windows: vLLM's full-vocabulary prompt_logprobs give the
    transformers perplexity (bf16/fp16 kernels against fp32: within 1 %) and a small KLD."""
    import shutil

    # tokenized evaluation data from qbuild itself (plan + run of a recipe with only the baseline's reference)
    recipe = {"name": "gpu-vllm-ref", "model": {"source": "local", "path": str(smollm2_dir)},
              "evaluation": {"baseline": True, "kld": True,
                             "perplexity": {"protocol": "fixed-window", "context_length": 256, "max_windows": 4}},
              "runtime": {"device": "cuda"}, "store": {"path": str(tmp_path / "store")}}
    steps = {s["name"]: s for s in run_recipe(tmp_path, recipe)["steps"]}
    from qbuild.artifacts.store import Store
    from qbuild.evaluate import quality

    store = Store(tmp_path / "store")
    data = store.object_dir(steps["eval-data"]["digest"])
    reference = store.object_dir(steps["reference[baseline]"]["digest"])
    ctx = _ctx(tmp_path, smollm2_dir, data, "vllm", reference=reference)
    res = quality.perplexity(ctx)
    base_ppl = json.loads((reference / "perplexity.json").read_text())["ppl"]
    print(f"[gpu-report] vllm baseline smollm2: ppl {res['metrics']['ppl']:.4f} vs transformers {base_ppl:.4f}, "
          f"kld {res['metrics']['kld']:.6f}, top1 {res['metrics']['top1']:.4f}")
    assert math.isfinite(res["metrics"]["ppl"])
    assert abs(res["metrics"]["ppl"] - base_ppl) / base_ppl < 0.01 and res["metrics"]["kld"] < 0.01
    shutil.rmtree(tmp_path / "vllm", ignore_errors=True)
