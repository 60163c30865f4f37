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
