"""The GPU suite's CPU side: tests/gpu/run.sh (arguments, its plan, skipping with reasons, the report) and what the
TensorRT-LLM GPU test builds and reads (issue 24, point 3: it read context logits from an engine built without
them), run through the test-only TensorRT-LLM stand-in (tests/fake_trtllm)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "tests" / "gpu" / "run.sh"


def run_sh(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def gpu_test_module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", ROOT / "tests" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- run.sh ----------------------------------------------------------------------------------------------------
def test_help_and_bad_arguments():
    res = run_sh("--help")
    assert res.returncode == 0 and "usage: tests/gpu/run.sh" in res.stdout and "--wheels DIR" in res.stdout
    for args, message in ((["--bogus"], "unknown argument '--bogus'"), (["--only", "sglang"], "--only must be"),
                          (["--python", "3.9"], "--python must be 3.11 or newer"), (["--out"], "--out needs"),
                          (["--wheels", "/nonexistent-wheels"], "is not a directory")):
        res = run_sh(*args)
        assert res.returncode == 2 and res.stderr.strip().startswith("run.sh: ") and message in res.stderr, args
        assert len(res.stderr.strip().splitlines()) == 1


def test_dry_run_plan_is_within_limits():
    res = run_sh("--dry-run", "--out", "/tmp/never-written")
    assert res.returncode == 0, res.stderr
    steps = [line for line in res.stdout.splitlines() if line.startswith("[")]
    limits = [int(re.search(r"\] timeout (\d+) ", s).group(1)) for s in steps]
    assert limits and max(limits) <= 600 and sum(limits) <= 60 * 60 * 2   # every command under 10 minutes
    text = "\n".join(steps)
    for env in ("tensorrt-llm-1.2", "tensorrt-llm", "vllm"):
        assert f"qbuild env create {env} --json" in text
    for test in ("test_trtllm_gpu.py", "test_trtllm_pytorch_gpu.py", "test_vllm_gpu.py"):
        assert test in text
    only = run_sh("--dry-run", "--only", "vllm", "--no-install").stdout
    assert "test_vllm_gpu.py" in only and "test_trtllm" not in only and "env create" not in only
    offline = run_sh("--dry-run", "--wheels", ROOT).stdout
    assert f"--offline --find-links {ROOT}" in offline
    assert "test_torch_cuda_gpu.py" in text
    assert not Path("/tmp/never-written").exists()


def test_system_python_runs_qbuild_from_the_checkout_with_carried_wheels(tmp_path):
    """A GPU machine with CUDA torch and no package index (the one lent on 2026-11-27): no venv, no uv, qbuild's
    missing dependencies from a wheel folder into <out>/site, and the machine's python3 runs the tests."""
    res = run_sh("--dry-run", "--system-python", "--wheels", tmp_path, "--only", "torch", "--out", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    steps = [line for line in res.stdout.splitlines() if line.startswith("[")]
    assert len(steps) == 2, steps
    assert f"pip install -q --no-index --no-deps --no-compile --target {tmp_path}/out/site {tmp_path}/*.whl" in steps[0]
    assert "-m pytest -m gpu" in steps[1] and "tests/gpu/test_torch_cuda_gpu.py" in steps[1]
    assert "uv " not in res.stdout and ".venv-gpu" not in res.stdout
    assert f"PYTHONPATH={ROOT}:{tmp_path}/out/site" in res.stdout


def test_without_a_gpu_nothing_runs_and_the_report_says_why(tmp_path):
    res = run_sh("--out", tmp_path / "out", env={"NVIDIA_SMI": "/bin/false"})
    assert res.returncode == 0, res.stderr
    assert "skipped: no NVIDIA GPU" in res.stdout
    report = (tmp_path / "out" / "report.md").read_text()
    assert "skipped" in report and "No NVIDIA GPU here" in report
    assert not (tmp_path / "out" / "envs").exists()


def test_report_of_a_run_where_every_gpu_test_skips(tmp_path):
    """A (fake) nvidia-smi that names a GPU, qbuild's own venv, no backend environments: every section runs its
    pytest and every GPU test skips with its reason; the report lists the sections and the reasons."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 9.0, 550.54.15'\n")
    smi.chmod(0o755)
    venv = Path(sys.executable).parent.parent
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "QBUILD_GPU_VENV": str(venv), "UV_OFFLINE": "1",
           "QBUILD_FAKE_GPU": "none"}   # qbuild's own probe sees no GPU: the GPU tests skip, nothing needs CUDA
    res = run_sh("--no-install", "--out", tmp_path / "out", env=env, timeout=600)
    report = (tmp_path / "out" / "report.md").read_text()
    assert res.returncode == 0, report
    assert "- GPU: NVIDIA H100 80GB HBM3, 9.0, 550.54.15" in report
    for section in ("trtllm engines, 2-layer model", "trtllm engine evaluation steps", "trtllm PyTorch backend package",
                    "vllm runtime"):
        assert re.search(rf"\| {re.escape(section)} \| 0 \| \d+ \| .*skipped", report), section
    assert "SKIPPED (vllm runtime)" in report and "no NVIDIA GPU" in report


# --- point 3: the GPU test reads context logits from an engine built to return them -----------------------------
def test_gpu_test_engine_settings_give_context_logits(tmp_path, tiny_model_dir, monkeypatch):
    from test_trtllm_eval import FAKE_PYTHON, H100, TRT_121, _recipe, _run, _store_checkpoint, stub_fake_logits

    from qbuild.envs import tensorrt_llm as trtllm_env

    monkeypatch.delenv(trtllm_env.ENV_PYTHON, raising=False)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, TRT_121)

    from qbuild.artifacts.store import Store
    from qbuild.targets import tensorrt_llm as trt

    gpu = gpu_test_module("test_trtllm_gpu")
    assert gpu.ENGINE_TARGET["gather_context_logits"] is True
    settings = trt.build_settings(trt.EngineTarget(**gpu.ENGINE_TARGET))
    args = trt.trtllm_build_args(settings, "c", "e")
    assert "--gather_context_logits" in args and args[args.index("--logits_dtype") + 1] == "float32"

    # the GPU test's engine, built by qbuild's engine step through the stub, then read by its engine check script
    target = {k: v for k, v in gpu.ENGINE_TARGET.items() if k != "type"}
    path = _recipe(tmp_path, tiny_model_dir, {"baseline": False, "perplexity": None}, **target)
    _store_checkpoint(path, tiny_model_dir)
    code, summary, out = _run(path)
    assert code == 0, out
    step = next(s for s in summary["steps"] if s["name"] == "engine[fp8.trtllm]")
    engine = Store(tmp_path / "store").object_dir(step["digest"])
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    windows = [[1, 5, 9, 13, 17, 21], [2, 4, 6, 8]]
    checked = gpu.engine_check(engine, tiny_model_dir, vocab, windows, python=FAKE_PYTHON.split())
    fake_logits = stub_fake_logits()
    want = 0.0
    for w in windows:
        logits = fake_logits(w, vocab).astype(np.float64)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        want -= logp[np.arange(len(w) - 1), np.asarray(w[1:])].sum()
    assert checked["count"] == 8 and checked["nll"] == pytest.approx(want, rel=1e-6)



def test_fetch_wheels_names_its_arguments():
    script = ROOT / "tests" / "gpu" / "fetch_wheels.sh"
    res = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--system-python --wheels DIR" in res.stdout
    res = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == "fetch_wheels.sh: unknown argument '--bogus' (see --help)"
