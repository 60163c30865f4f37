"""llm-compressor steps load what fits in memory and offload the rest to disk (compressed-tensors' offloading):
with a memory budget far below the model (QBUILD_MEMORY_GB), GPTQ still quantizes, to the same bytes. RTN (data-free)
reads one shard at a time whatever the budget (tests/test_quantize_model_free.py): the same bytes too."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_api, write_recipe

VARIANTS = [{"name": "rtn", "method": "rtn", "bits": 4, "group_size": 64},
            {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 64}]


def _quantize(tmp_path, model_dir, name: str) -> dict:
    recipe = write_recipe(tmp_path / f"{name}.yaml", {
        "name": f"offload-{name}", "model": {"source": "local", "path": str(model_dir)},
        "store": {"path": str(tmp_path / f"store-{name}")},
        "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 8, "seq_len": 64},
        "variants": VARIANTS, "evaluation": {"baseline": False, "perplexity": None}})
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    found = {}
    for manifest in (tmp_path / f"store-{name}" / "objects").glob("*/*/manifest.json"):
        m = json.loads(manifest.read_text())
        if m["kind"] == "quantize":
            found[m["variant"]] = {"files": {f["path"]: f["sha256"] for f in m["files"]}, "info": m["info"]}
    return found


@pytest.mark.slow
def test_offloaded_quantization_writes_the_same_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    in_memory = _quantize(tmp_path, tiny_model_dir, "memory")
    monkeypatch.setenv("QBUILD_MEMORY_GB", "1.75")   # 50 MB for the model: most of it goes to disk
    on_disk = _quantize(tmp_path, tiny_model_dir, "disk")
    assert on_disk["gptq"]["info"].get("offloaded_to_disk") is True
    assert "offloaded_to_disk" not in in_memory["gptq"]["info"]
    assert on_disk["rtn"]["info"]["shard_by_shard"] is True
    for variant in ("rtn", "gptq"):
        assert on_disk[variant]["files"] == in_memory[variant]["files"], variant


def _random_llama(tmp_path, tiny_model_dir):
    """An 8-layer random Llama with the tiny model's tokenizer: enough layers that some stay in memory and the rest
    go to disk under a small budget (the 2-layer model is mostly its embeddings)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    src = tmp_path / "llama-8layer"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_model_dir / f, src / f)
    return src


def _modelopt_export(tmp_path, model_dir, name: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    recipe = write_recipe(tmp_path / f"mo-{name}.yaml", {
        "name": f"mo-{name}", "model": {"source": "local", "path": str(model_dir)},
        "store": {"path": str(tmp_path / f"mo-store-{name}")},
        "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
        "variants": [{"name": "fp8", "method": "modelopt", "scheme": "fp8", "export": "hf", "dtype": "bfloat16"}],
        "evaluation": {"baseline": False, "perplexity": None}})
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    [(obj, manifest)] = [(p.parent, m) for p in (tmp_path / f"mo-store-{name}" / "objects").glob("*/*/manifest.json")
                         if (m := json.loads(p.read_text()))["kind"] == "quantize"]
    tensors = {}
    for f in sorted(obj.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors, {"info": manifest["info"], "config": json.loads((obj / "config.json").read_text())}


@pytest.mark.slow
def test_modelopt_fp8_offloaded_to_disk_writes_the_same_checkpoint_within_one_fp8_step(
        tmp_path, tiny_model_dir, monkeypatch):
    """ModelOpt FP8 with the HF export: in memory, and with a memory budget that leaves most layers on disk
    (accelerate's offload, ModelOpt's streaming export). The offloaded run calibrates in the export dtype (bf16), so
    its activation scales differ in the last bits; the weight scales are equal and an FP8 weight is at most one FP8
    step apart."""
    pytest.importorskip("modelopt")
    import torch

    src = _random_llama(tmp_path, tiny_model_dir)
    in_memory, a = _modelopt_export(tmp_path, src, "memory")
    monkeypatch.setenv("QBUILD_MEMORY_GB", "1.72")   # 20 MB over the quantizer's own: the floor, 2 of 8 layers
    on_disk, b = _modelopt_export(tmp_path, src, "disk")
    assert b["info"].get("offloaded_to_disk") is True and "offloaded_to_disk" not in a["info"]
    assert a["config"]["quantization_config"] == b["config"]["quantization_config"]
    assert a["config"]["dtype"] == b["config"]["dtype"] == "bfloat16"
    assert set(in_memory) == set(on_disk)
    fp8_values = fp8_apart = 0
    for name, x in in_memory.items():
        y = on_disk[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        if name.endswith("weight_scale") or x.dtype == torch.bfloat16:
            assert torch.equal(x, y), name
        elif name.endswith("input_scale"):
            assert torch.allclose(x, y, rtol=0.02), name
        elif x.dtype == torch.float8_e4m3fn:
            steps = (x.view(torch.int8).int() - y.view(torch.int8).int()).abs()
            assert int(steps.max()) <= 1, name
            fp8_values += x.numel()
            fp8_apart += int((steps > 0).sum())
    assert fp8_values and fp8_apart / fp8_values < 0.1
