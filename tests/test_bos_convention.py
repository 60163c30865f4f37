"""Issue 47: one model, one number. BOS starts each evaluation window exactly when the model's own tokenizer adds it
(`add_bos_token` in a GGUF or tokenizer_config.json, else what its tokenizer.json post-processor adds), whatever the
source; the recipe can still force it; the plan and the run state which was used and why.

A Qwen2.5 GGUF names a BOS token but sets add_bos_token = false: with BOS (the old default) its perplexity was 27 %
worse than llama.cpp's and than the same weights from their HF directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import model_families as mf
import pytest

from helpers import run_api, write_recipe

PERPLEXITY = {"protocol": "fixed-window", "context_length": 128, "max_windows": 4}


@pytest.fixture(scope="session")
def llama3_dir(models_cache) -> Path:
    return mf.built(mf.BY_NAME["llama3"], models_cache / "families")


def _with_bos_convention(src: Path, out: Path, adds: bool) -> Path:
    """A copy of the tiny Llama-3 model whose tokenizer adds BOS (`adds`) or not, both ways it can say so."""
    shutil.copytree(src, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": adds}))
    if not adds:
        tokenizer = json.loads((out / "tokenizer.json").read_text())
        tokenizer["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                       "use_regex": False}
        (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


def _convert(model: Path, out: Path) -> Path:
    """llama.cpp's converter (QBUILD_LLAMA_CPP_DIR: the copy that knows the tiny vocabulary), as qbuild runs it."""
    from qbuild.models.llamacpp_toolchain import converter_command, converter_env

    subprocess.run(converter_command(model, out, "f32"), check=True, capture_output=True, env=converter_env(),
                   timeout=600)
    return out


def _baseline(root: Path, model: dict, **perplexity) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(root / f"{model['source']}.yaml", {
        "name": "bos", "model": model, "runtime": {"threads": 1},
        "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],   # (a recipe has a variant)
        "evaluation": {"perplexity": PERPLEXITY | perplexity, "kld": False},
        "store": {"path": str(root / "store")}})
    rc, summary = run_api(recipe)
    assert rc == 0, summary
    return summary


@pytest.mark.slow   # ~4 min on a busy 2-core machine (two conversions, three runs); the plan-level test below is not
@pytest.mark.parametrize("adds", [True, False], ids=["adds-bos", "no-bos"])
def test_the_same_weights_from_an_hf_directory_and_from_their_gguf_score_the_same(
        llama3_dir, tmp_path, monkeypatch, adds):
    model = _with_bos_convention(llama3_dir, tmp_path / "hf", adds)
    # llama.cpp's converter, knowing this vocabulary (its hash covers the BOS it adds), for conversion and check
    monkeypatch.setenv("QBUILD_LLAMA_CPP_DIR", str(mf.registered_converter({"llama3": model}, tmp_path)))
    gguf = _convert(model, tmp_path / "model.gguf")
    from qbuild.models.gguf_import import gguf_config

    assert gguf_config(gguf)["add_bos_token"] is adds   # llama.cpp's converter carried the convention over
    hf = _baseline(tmp_path / "hf-run", {"source": "local", "path": str(model)})
    from_gguf = _baseline(tmp_path / "gguf-run", {"source": "gguf", "path": str(gguf)})
    for summary, source in ((hf, "tokenizer_config.json's add_bos_token"),
                            (from_gguf, "the GGUF's tokenizer.ggml.add_bos_token")):
        assert summary["protocol"]["add_bos"] is adds
        assert summary["protocol"]["bos_why"] == f"the model's own convention ({source} is {str(adds).lower()})"
    ppl_hf, ppl_gguf = (s["variants"][0]["ppl"] for s in (hf, from_gguf))
    assert ppl_hf == pytest.approx(ppl_gguf, rel=1e-5), (ppl_hf, ppl_gguf)
    # the recipe still decides where it says so, and the other convention scores differently
    forced = _baseline(tmp_path / "forced", {"source": "gguf", "path": str(gguf)}, add_bos=not adds)
    assert forced["protocol"]["add_bos"] is (not adds)
    assert forced["protocol"]["bos_why"] == "evaluation.perplexity.add_bos in the recipe"
    assert forced["variants"][0]["ppl"] != pytest.approx(ppl_gguf, rel=1e-3)


def test_the_plan_states_whether_bos_is_added_and_why(tmp_path):
    """The demo's SmolLM2 GGUF sets add_bos_token = false (llama.cpp adds no BOS for it, nor does its HF
    tokenizer): its windows have no BOS, and `qbuild plan` says so."""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "qbuild", "plan", str(repo / "recipes" / "demo.yaml"), "--store",
                          str(tmp_path / "store")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert ("perplexity windows have no BOS: the model's own convention (the GGUF's tokenizer.ggml.add_bos_token is "
            "false)") in out.stdout


@pytest.mark.parametrize(("processor", "adds"), [
    (None, False),
    ({"type": "ByteLevel"}, False),
    ({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                               {"Sequence": {"id": "A", "type_id": 0}}]}, True),
    ({"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                               {"SpecialToken": {"id": "</s>", "type_id": 0}}]}, False),
    ({"type": "Sequence", "processors": [{"type": "ByteLevel"}, {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]}]}, True),
    ({"type": "BertProcessing"}, None),
])
def test_what_a_tokenizer_json_post_processor_adds(processor, adds):
    from qbuild.planning.models import post_processor_adds_bos

    assert post_processor_adds_bos(processor, "<s>") is adds


@pytest.mark.parametrize("adds", [True, False])
def test_an_hf_directory_and_a_gguf_with_one_convention_plan_the_same_windows(tmp_path, adds):
    """Plan level, every source: the eval-data step (the windows) gets the model's add_bos from a GGUF's metadata,
    from tokenizer_config.json, and from tokenizer.json's post-processor when tokenizer_config.json does not say."""
    from hostile_models import BOOL, base_metadata, gguf_bytes, kv, write

    from qbuild import api

    from helpers import fake_model

    def windows_add_bos(model: dict) -> bool:
        recipe = {"name": "t", "model": model, "variants": [{"name": "f16", "method": "gguf", "type": "F16"}],
                  "evaluation": {"perplexity": PERPLEXITY}, "store": {"path": str(tmp_path / "store")}}
        return next(p.step for p in api.validate(recipe).steps if p.step.kind == "eval-data").params["add_bos"]

    gguf = write(tmp_path / "m.gguf", gguf_bytes([*base_metadata(), kv("tokenizer.ggml.add_bos_token", BOOL, adds)]))
    hf = fake_model(tmp_path / "config")
    (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": adds}))
    post = fake_model(tmp_path / "post-processor")
    (post / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    single = [{"SpecialToken": {"id": "<s>", "type_id": 0}}] * adds + [{"Sequence": {"id": "A", "type_id": 0}}]
    (post / "tokenizer.json").write_text(json.dumps({"post_processor": {"type": "TemplateProcessing",
                                                                         "single": single}}))
    assert windows_add_bos({"source": "gguf", "path": str(gguf)}) is adds
    assert windows_add_bos({"source": "local", "path": str(hf)}) is adds
    assert windows_add_bos({"source": "local", "path": str(post)}) is adds
