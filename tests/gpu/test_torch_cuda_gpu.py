"""GPU suite for qbuild's own torch paths, with the machine's CUDA torch (no backend environment needed):

- layer-streamed evaluation on the GPU gives the logits of the whole model on the GPU, for each dense family;
- a recipe (RTN and GPTQ W4A16 through llm-compressor; reference, perplexity and KLD through transformers) is planned
  and run on CUDA, its numbers against the same recipe run on the CPU (runtime.device: cpu, which keeps every step
  off the GPU), and a re-run builds nothing;
- a layer-streamed reference of a 1B-shaped model holds one layer on the GPU, not the whole model.

Each prints `[gpu-report]` lines that tests/gpu/run.sh copies into its report. Skipped without a CUDA GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from qbuild.contract.protocol import Window
from qbuild.runtimes.transformers import TransformersSession
from tests.helpers import write_recipe
from tests.model_families import BY_NAME, built

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

DENSE = ("llama3", "qwen2.5", "qwen3", "gemma2", "gemma3", "phi3", "mistral")


def report(line: str) -> None:
    print(f"[gpu-report] {line}", flush=True)


def _windows(vocab: int, n: int, length: int) -> list[Window]:
    rng = np.random.default_rng(1)
    return [Window(tokens=rng.integers(0, vocab, length).tolist(), first_scored=1) for _ in range(n)]


def _log_probs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _nll(logits: list[np.ndarray], windows: list[Window]) -> float:
    """Mean negative log-likelihood of each window's next tokens."""
    total, n = 0.0, 0
    for lg, w in zip(logits, windows, strict=True):
        lp = _log_probs(lg[:-1])
        total -= float(lp[np.arange(len(w.tokens) - 1), w.tokens[1:]].sum())
        n += len(w.tokens) - 1
    return total / n


@pytest.mark.parametrize("family", DENSE)
def test_streamed_logits_on_the_gpu_match_the_whole_model(models_cache, family):
    """In the checkpoint's dtype (these tiny models are stored in fp32): the whole model takes the windows in one
    batch, the streamed one a window at a time, so the kernels differ (cuBLAS picks by shape) and the logits agree
    to rounding, not to the bit. (The 1.2B test below runs in bf16.)"""
    path = built(BY_NAME[family], models_cache / "families")
    windows = _windows(1024, 4, 128)
    whole = TransformersSession(path, 1, "cuda")
    want = list(whole.window_logits(windows))   # fits the GPU: the whole model, windows batched
    assert whole._model is not None and whole._model.device.type == "cuda"
    streamed = TransformersSession(path, 1, "cuda").streamed()
    assert streamed is not None, f"{family} is not streamable"
    got = list(streamed.window_logits([w.tokens for w in windows]))
    diff = max(float(np.abs(_log_probs(g) - _log_probs(w)).max()) for g, w in zip(got, want, strict=True))
    nll_whole, nll_streamed = _nll(want, windows), _nll(got, windows)
    report(f"{family}: streamed vs whole model on {torch.cuda.get_device_name()}, {whole._model.dtype}: "
           f"max |d log p| {diff:.2e}, "
           f"mean NLL {nll_streamed:.5f} vs {nll_whole:.5f}")
    assert abs(nll_streamed - nll_whole) <= 1e-3 * nll_whole
    assert diff < 0.25


def _recipe(tmp_path, model, device: str):
    return write_recipe(tmp_path / f"gpu-{device}.yaml", {
        "name": f"gpu-{device}", "model": {"source": "local", "path": str(model)},
        "store": {"path": str(tmp_path / f"store-{device}")},
        "runtime": {"device": device},
        "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 8, "seq_len": 128},
        "variants": [{"name": "rtn", "method": "rtn", "bits": 4, "group_size": 64},
                     {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 64}],
        "evaluation": {"baseline": True, "kld": True,
                       "perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "test"}]},
                                      "protocol": "fixed-window", "context_length": 256, "max_windows": 8}}})


def _qbuild(*args) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "qbuild", *args, "--json"], capture_output=True, text=True, timeout=900)
    try:
        return p.returncode, json.loads(p.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"qbuild {' '.join(args)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}") from None


def _metrics(store) -> dict:
    """step name -> {metric: value, "_device": where it ran, "_seconds": its wall time}, from the stored steps."""
    found: dict = {}
    for manifest in (store / "objects").glob("*/*/manifest.json"):
        m = json.loads(manifest.read_text())
        if m["kind"] not in ("perplexity", "reference", "quantize"):
            continue
        entry = {k: v for k, v in (m.get("metrics") or {}).items() if isinstance(v, (int, float))}
        entry["_seconds"] = (m.get("timings") or {}).get("seconds")
        entry["_device"] = (m.get("info") or {}).get("device")   # a quantize step's
        entry["_gpu_peak_mb"] = (m.get("info") or {}).get("gpu_peak_mb")
        entry["_files"] = {f["path"]: f["sha256"] for f in m.get("files", []) if f["path"].endswith(".safetensors")}
        result = manifest.parent / "perplexity.json"
        if result.is_file():   # an evaluation step's runtime, as recorded with its numbers
            entry["_device"] = json.loads(result.read_text()).get("runtime", {}).get("device")
        found[m["name"]] = entry
    return found


def test_a_recipe_plans_and_runs_on_cuda_with_the_cpu_numbers(tmp_path, models_cache):
    model = built(BY_NAME["llama3"], models_cache / "families")
    rc, plan = _qbuild("plan", str(_recipe(tmp_path, model, "auto")))
    assert rc == 0
    where = {s["step"]: s["device"] for s in plan["steps"]}
    report("plan on a GPU machine (device auto): " + ", ".join(f"{n}={d}" for n, d in where.items()))
    assert where["quantize[rtn]"] == where["quantize[gptq]"] == where["perplexity[rtn]"] == "cuda"
    assert where["reference[baseline]"] == "cuda"

    runs = {}
    for device in ("auto", "cpu"):
        rc, summary = _qbuild("run", str(_recipe(tmp_path, model, device)))
        assert rc == 0, summary.get("steps")
        runs[device] = _metrics(tmp_path / f"store-{device}")
    rc, again = _qbuild("run", str(_recipe(tmp_path, model, "auto")))
    assert rc == 0 and again["counts"]["built"] == 0
    for name, gpu in sorted(runs["auto"].items()):
        cpu = runs["cpu"].get(name, {})
        shared = sorted(k for k in gpu if k in cpu and not k.startswith("_"))
        if gpu.get("_files"):
            report(f"{name}: checkpoint on the GPU {'==' if gpu['_files'] == cpu.get('_files') else '!='} on the CPU")
        report(f"{name}: on {gpu.get('_device')} {gpu.get('_seconds')} s, cpu run on {cpu.get('_device')} "
               f"{cpu.get('_seconds')} s; " + ", ".join(f"{k} {gpu[k]:.5g} vs cpu {cpu[k]:.5g}" for k in shared))
    for variant in ("rtn", "gptq"):
        assert runs["auto"][f"quantize[{variant}]"]["_device"] == "cuda"
        assert runs["auto"][f"quantize[{variant}]"]["_gpu_peak_mb"] > 0   # its layers were onloaded to the GPU
        report(f"quantize[{variant}]: peak GPU memory {runs['auto'][f'quantize[{variant}]']['_gpu_peak_mb']} MB")
        assert runs["cpu"][f"quantize[{variant}]"]["_device"] == "cpu"
        assert runs["auto"][f"perplexity[{variant}]"]["ppl"] == pytest.approx(runs["cpu"][f"perplexity[{variant}]"]["ppl"],
                                                                              rel=0.02)


def test_streamed_reference_of_a_1b_model_holds_one_layer_on_the_gpu(tmp_path):
    """A 1.2B Llama-shaped random model (bf16, 2.5 GB): the peak GPU memory of layer-streamed windows against the
    whole model's, and their mean NLL."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = tmp_path / "llama-1b"
    model.save_pretrained(path)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    windows = _windows(32000, 8, 512)

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    streamed = TransformersSession(path, 1, "cuda").streamed()
    got = list(streamed.window_logits([w.tokens for w in windows]))
    streamed_peak = torch.cuda.max_memory_allocated() - base
    del streamed
    torch.cuda.empty_cache()

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    whole = TransformersSession(path, 1, "cuda")
    want = list(whole.window_logits(windows))
    whole_peak = torch.cuda.max_memory_allocated() - base
    nll_s, nll_w = _nll(got, windows), _nll(want, windows)
    report(f"1.2B bf16 ({size / 1e9:.2f} GB), 8 windows of 512: peak GPU memory streamed {streamed_peak / 2**30:.2f} GiB "
           f"vs whole model {whole_peak / 2**30:.2f} GiB; mean NLL {nll_s:.5f} vs {nll_w:.5f}")
    assert streamed_peak < 0.5 * size
    assert abs(nll_s - nll_w) <= 1e-3 * nll_w
