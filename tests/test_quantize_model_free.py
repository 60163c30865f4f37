"""Data-free schemes (RTN, FP8 dynamic) quantize shard by shard through llm-compressor's model_free_ptq: the same
quantized tensors as its oneshot (which loads the whole model), one shard in memory at a time, and a checkpoint
transformers and qbuild's evaluation read back."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from qbuild.pipeline.memory_fit import GB, SHARD_QUANTIZER_OVERHEAD, ModelSize, step_memory
from qbuild.quantize.llmcompressor import model_free_fits
from tests.helpers import run_api, write_recipe

VARIANTS = [{"name": "rtn", "method": "rtn", "bits": 4, "group_size": 64},
            {"name": "fp8", "method": "fp8", "scheme": "dynamic"}]


def sharded(src: Path, out: Path) -> Path:
    """`src` re-saved in shards of about 2 MB (the tiny model's files are one): a checkpoint of many shards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (out / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        model.save_pretrained(str(out), max_shard_size="2MB")
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    return out


def oneshot_tensors(src: Path, method: str, tmp: Path) -> dict:
    """What llm-compressor's oneshot (the whole model loaded) writes for the variant: name → tensor."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from qbuild.contract.plugin import methods

    variant = next(v for v in VARIANTS if v["name"] == method)
    plugin = methods.get(variant["method"])
    params = plugin.options(**variant).quant_params()
    run_side = importlib.import_module(f"qbuild.quantize.llmcompressor.{variant['method']}.run")   # its modifiers
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
    with torch.no_grad():
        oneshot(model=model, recipe=run_side.modifiers(params))
    model.save_pretrained(str(tmp), save_compressed=True)
    return tensors_of(tmp)


def tensors_of(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# the other two cases (45 s each) are slow-marked: the same shard-by-shard writer, another scheme or shard layout
@pytest.mark.parametrize(("method", "shards"), [("rtn", "bf16-shards"),
                                                pytest.param("fp8", "bf16-shards", marks=pytest.mark.slow),
                                                pytest.param("rtn", "as-is", marks=pytest.mark.slow)])
def test_shard_by_shard_writes_the_tensors_oneshot_writes(tmp_path, tiny_model_dir, method, shards):
    """On a checkpoint of many bf16 shards, and on the tiny model's own single file (fp32)."""
    import torch

    model = sharded(tiny_model_dir, tmp_path / "sharded") if shards == "bf16-shards" else tiny_model_dir
    assert len(list(model.glob("*.safetensors"))) > (3 if shards == "bf16-shards" else 0)
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "model-free", "model": {"source": "local", "path": str(model)}, "store": {"path": str(tmp_path / "s")},
        "variants": [v for v in VARIANTS if v["name"] == method],
        "evaluation": {"perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "test"}]},
                                      "protocol": "fixed-window", "context_length": 64, "max_windows": 2}}})
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    manifests = {p.parent: json.loads(p.read_text()) for p in (tmp_path / "s" / "objects").glob("*/*/manifest.json")}
    obj, manifest = next((d, m) for d, m in manifests.items() if m["kind"] == "quantize")
    assert manifest["info"]["shard_by_shard"] is True
    files = list(obj.rglob("*.safetensors"))
    assert len(files) == len(list(model.glob("*.safetensors")))     # the source's shards, each quantized in turn
    ours, theirs = tensors_of(files[0].parent), oneshot_tensors(model, method, tmp_path / "oneshot")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert "model.embed_tokens.weight" in ours   # not quantized: oneshot's targets are Linear layers, not embeddings
    config = json.loads((files[0].parent / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and list(qc["config_groups"]) == ["group_0"]   # as oneshot
    # qbuild's evaluation reads it back: a finite perplexity, close to the unquantized model's
    ppl = {r["variant"]: r["ppl"] for r in summary["variants"]}
    assert 1 < ppl[method] < 1.5 * ppl["baseline"] and ppl[method] != ppl["baseline"], ppl


def test_the_plan_streams_shards_only_where_the_files_are_the_model(tiny_model_dir):
    assert model_free_fits({"model_type": "llama", "hidden_size": 64})
    assert not model_free_fits({"model_type": "qwen3_moe", "num_experts": 8})
    assert not model_free_fits({"model_type": "gemma3", "text_config": {}, "vision_config": {}})


def test_a_shard_streamed_step_needs_its_largest_shard_not_the_model():
    class Step:
        memory, kind = "shard-streamed", "quantize"

    size_8b = ModelSize(total=16 * GB, outside=1 * GB, layer=GB // 2, parameters=8 * 10**9, largest_shard=GB)
    need, how = step_memory(Step, size_8b, loaded_whole=False)
    assert need == int(2 * GB + SHARD_QUANTIZER_OVERHEAD) and "shard" in how
    # a hub model's files are not at hand at plan time: its shards are at most transformers' 5 GB
    need, _ = step_memory(Step, ModelSize(140 * GB, GB, GB, 70 * 10**9), loaded_whole=False)
    assert need == int(10 * GB + SHARD_QUANTIZER_OVERHEAD)
