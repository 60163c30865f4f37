"""An HF source's GGUF conversion is held to the checkpoint before any GGUF variant is built on it (issue 31): step
`convert-check[f16]` compares llama.cpp on the converted file with transformers on the checkpoint (tokens, KLD,
top-1, perplexity), once, and a conversion that does not reproduce the checkpoint fails in one line.

The refused case is one llama.cpp really gets wrong: a Llama checkpoint whose config asks for another activation
(`hidden_act: gelu`). transformers honours it; llama.cpp's converter ignores it and its llama graph always uses SiLU,
so the GGUF computes another function than the checkpoint."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from helpers import qbuild, write_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _recipe(tmp_path, model_dir, variants=None):
    return write_recipe(tmp_path / "recipe.yaml", {
        "name": "convert-check", "model": {"source": "local", "path": str(model_dir)},
        "variants": variants or [{"name": "q8", "method": "gguf", "type": "Q8_0"}],
        "evaluation": {"perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "test"}]},
                                      "protocol": "fixed-window", "context_length": 128, "max_windows": 2},
                       "kld": True}})


def test_every_gguf_step_waits_for_the_conversion_check(tiny_model_dir, tmp_path):
    """Planning: one convert-check per conversion, reading the checkpoint, the evaluation text and the converted file;
    the quantize steps (and the imatrix) wait for it, and waiting leaves their keys as they were."""
    from qbuild.pipeline.plan import build_steps
    from qbuild.planning.recipe import load_recipe

    recipe = _recipe(tmp_path, tiny_model_dir, [{"name": "q8", "method": "gguf", "type": "Q8_0"},
                                                {"name": "q4", "method": "gguf", "type": "Q4_0"}])
    ctx = build_steps(load_recipe(recipe), tmp_path)
    by_name = {s.name: s for s in ctx.steps}
    checks = [s for s in ctx.steps if s.kind == "convert-check"]
    assert [c.name for c in checks] == ["convert-check[f16]"]
    check = checks[0]
    assert check.inputs == {"model": by_name["model"], "data": by_name["eval-data"], "gguf": by_name["gguf-convert[f16]"]}
    readers = [s for s in ctx.steps if by_name["gguf-convert[f16]"] in s.inputs.values() and s is not check]
    assert {s.name for s in readers} == {"quantize[q8]", "quantize[q4]"}
    assert all(check in s.after for s in readers)
    assert all(replace(s, after=()).key == s.key for s in readers)
    assert "import-check" not in by_name    # an HF source has no file of its own to be held to


def test_a_faithful_conversion_passes_once_and_is_reported(tiny_model_dir, tmp_path):
    recipe = _recipe(tmp_path, tiny_model_dir)
    first = qbuild("run", recipe, "--store", tmp_path / "store", "--json", "--threads", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["convert-check[f16]"]["status"] == "built" and steps["quantize[q8]"]["status"] == "built"
    [check] = summary["fidelity_checks"]
    assert check["step"] == "convert-check[f16]" and check["source_file_type"] == "MOSTLY_F16"
    assert check["tokens_compared"] > 200
    assert check["kld"] < 1e-3 and check["top1"] > 0.9 and abs(check["ppl_delta_pct"]) < 0.5, check
    again = qbuild("plan", recipe, "--store", tmp_path / "store", "--json")
    planned = {s["step"]: s for s in json.loads(again.stdout)["steps"]}
    assert planned["convert-check[f16]"]["status"] == "hit" and json.loads(again.stdout)["to_build"] == 0


def test_a_conversion_that_computes_another_function_is_refused(tiny_model_dir, tmp_path):
    model = tmp_path / "gelu-llama"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (model / "config.json").write_text(json.dumps(config))
    res = qbuild("run", _recipe(tmp_path, model), "--store", tmp_path / "store", "--json", "--threads", "1")
    assert res.returncode == 1, res.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads(res.stdout)["steps"]}
    error = steps["convert-check[f16]"]["error"]
    assert steps["convert-check[f16]"]["status"] == "failed" and "\n" not in error
    assert "the f16 GGUF conversion's next-token distribution through llama.cpp differs from the checkpoint's" \
        in error and "over the bound" in error, error
    assert steps["quantize[q8]"]["status"] == "skipped" and steps["perplexity[q8]"]["status"] == "skipped"
    assert "Traceback" not in res.stderr
