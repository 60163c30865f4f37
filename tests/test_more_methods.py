"""SmoothQuant W8A8, bitsandbytes NF4 / LLM.int8, AutoRound and ModelOpt NVFP4 / W4A8-MXFP4.

The first four run for real through qbuild's API on the 2-layer SmolLM2 (real weights, tiny settings:
4 calibration samples of 64 tokens, AutoRound 2 iterations) and are evaluated by the transformers
runtime on CPU against the unquantized model. The 2-layer cut's perplexity is astronomical (28 layers
are gone), so quality is judged by KL divergence and top-1 agreement with the baseline, and perplexity
only has to stay finite and within a bound, as in test_quantize_methods.py.

ModelOpt's FP4 schemes fake-quantize on CUDA only: without a GPU they are planned as needs-gpu and
skipped with on_missing_gpu: skip; the real export runs in the `gpu`-marked test.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest
import yaml

from qbuild.artifacts.store import Store
from qbuild.errors import RecipeError, UserError

from helpers import fake_model, run_api, write_recipe

needs = {m: importlib.util.find_spec(m) is not None for m in ("llmcompressor", "bitsandbytes", "auto_round", "modelopt")}

VARIANTS = [
    {"name": "sq", "method": "smoothquant"},                                   # SmoothQuant α 0.8 + GPTQ W8A8
    {"name": "nf4", "method": "bitsandbytes", "scheme": "nf4"},
    {"name": "int8", "method": "bitsandbytes", "scheme": "int8"},
    {"name": "ar", "method": "autoround", "bits": 4, "group_size": 64, "iters": 2, "batch_size": 4},
]
CALIBRATION = {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64, "seed": 0}


def recipe(model: Path, store: Path, variants, **extra) -> dict:
    return {"name": "more", "model": {"source": "local", "path": str(model)}, "calibration": CALIBRATION,
            "variants": variants, "runtime": {"threads": 1}, "store": {"path": str(store)}, **extra}


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """All four CPU methods and their evaluations, built once (about 1.5 minutes on one core)."""
    missing = [m for m in ("llmcompressor", "bitsandbytes", "auto_round") if not needs[m]]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (pip install 'qbuild[dev]')")
    root = tmp_path_factory.mktemp("more")
    store = root / "store"
    path = write_recipe(root / "recipe.yaml", recipe(tiny_model_dir, store, VARIANTS, evaluation={
        "perplexity": {"context_length": 256, "max_windows": 2}, "kld": True}))
    rc, summary = run_api(path)
    assert rc == 0, summary["steps"]
    st = Store(store)

    def obj(digest: str) -> Path:
        return st.object_dir(digest)

    return {"summary": summary, "model": tiny_model_dir, "obj": obj, "store": st,
            "variants": {v["variant"]: v for v in summary["variants"]},
            "steps": {s["name"]: s for s in summary["steps"]}}


def artifact(built, name: str) -> tuple[Path, dict, dict]:
    """(object dir, config.json's quantization_config, manifest) of a variant."""
    row = built["variants"][name]
    assert row["status"] == "built", row
    out = built["obj"](row["digest"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    return out, qc, built["store"].manifest(row["digest"])


def test_smoothquant_w8a8_int8_checkpoint(built):
    out, qc, m = artifact(built, "sq")
    assert built["variants"]["sq"]["format"] == "compressed-tensors" and built["variants"]["sq"]["scheme"] == "w8a8-int8"
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized" and "lm_head" in qc["ignore"]
    group = qc["config_groups"]["group_0"]
    w, a = group["weights"], group["input_activations"]
    assert (w["type"], w["num_bits"], w["strategy"], w["symmetric"]) == ("int", 8, "channel", True)
    assert (a["type"], a["num_bits"], a["strategy"], a["dynamic"]) == ("int", 8, "token", True)
    header = safetensors_header(out / "model.safetensors")
    assert header["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "I8"
    # SmoothQuant folds its per-channel scales into the norm before q/k/v: those weights must have moved
    from safetensors.numpy import load_file

    src = load_file(str(built["model"] / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    smoothed = load_file(str(out / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    assert abs(smoothed.astype("float64") - src).max() > 1e-3
    # measured on the saved checkpoint: transformers + compressed-tensors fake-quantize the int8 activations
    assert "fake-quantized" in m["info"]["activations"] and m["info"]["device"] in m["info"]["activations"]
    assert "calibration" in m["inputs"] and {"llmcompressor", "compressed-tensors"} <= set(m["toolchain"])


@pytest.mark.parametrize("name, want", [
    ("nf4", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
             "bnb_4bit_compute_dtype": "bfloat16"}),
    ("int8", {"load_in_8bit": True, "llm_int8_threshold": 6.0}),
])
def test_bitsandbytes_serialized_checkpoint(built, name, want):
    out, qc, m = artifact(built, name)
    assert built["variants"][name]["format"] == "bitsandbytes" and built["variants"][name]["scheme"] == name
    assert qc["quant_method"] == "bitsandbytes" and qc["llm_int8_skip_modules"] == ["lm_head"]
    assert {k: qc[k] for k in want} == want
    header = safetensors_header(out / "model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    if name == "nf4":   # packed 4-bit data plus its serialized quant state (what vLLM's bnb loader reads)
        assert header[q_proj]["dtype"] == "U8" and f"{q_proj}.quant_state.bitsandbytes__nf4" in header
    else:               # int8 rows plus their per-row scales (SCB)
        assert header[q_proj]["dtype"] == "I8" and "model.layers.0.self_attn.q_proj.SCB" in header
    assert m["info"]["quantized_linear_layers"] == 14   # 2 layers × (q, k, v, o, gate, up, down)
    assert "calibration" not in m["inputs"] and "bitsandbytes" in m["toolchain"]
    assert (out / "tokenizer.json").is_file()


def test_autoround_checkpoint(built):
    out, qc, m = artifact(built, "ar")
    assert built["variants"]["ar"]["format"] == "auto-round"
    assert qc["quant_method"] == "auto-round" and qc["packing_format"] == "auto_round:auto_gptq"
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["iters"]) == (4, 64, True, 2)
    header = safetensors_header(out / "model.safetensors")
    assert {"model.layers.1.mlp.down_proj.qweight", "model.layers.1.mlp.down_proj.scales"} <= set(header)
    assert "lm_head.qweight" not in header and m["info"]["unquantized"] == ["lm_head"]
    assert m["info"]["calibration_samples"] == 4 and m["info"]["seq_len"] == 64
    assert not list(out.rglob("_export")) and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("name, max_kld", [("sq", 0.02), ("int8", 0.02), ("nf4", 0.1), ("ar", 0.15)])
def test_cpu_evaluation_close_to_baseline(built, name, max_kld):
    base, row = built["variants"]["baseline"], built["variants"][name]
    assert math.isfinite(row["ppl"]) and 0.5 * base["ppl"] < row["ppl"] < 1.5 * base["ppl"], (row["ppl"], base["ppl"])
    assert 0 < row["kld"] < max_kld and row["top1"] > 0.8, row
    ppl_step = built["steps"][f"perplexity[{name}]"]
    toolchain = built["store"].manifest(ppl_step["digest"])["toolchain"]
    loader = {"sq": "compressed-tensors", "int8": "bitsandbytes", "nf4": "bitsandbytes", "ar": "auto-round"}[name]
    assert loader in toolchain   # the library that reads the format enters the evaluation's key


def test_int8_schemes_closer_than_4bit(built):
    """Real data, real ordering: the 8-bit schemes lose less than the 4-bit ones on the same text."""
    kld = {n: built["variants"][n]["kld"] for n in ("sq", "int8", "nf4", "ar")}
    assert max(kld["sq"], kld["int8"]) < min(kld["nf4"], kld["ar"]), kld


# --- plan-time behaviour (no model runs) -----------------------------------------------------------------
def plan_of(tmp_path, variants, **extra):
    from qbuild import api

    extra.setdefault("evaluation", {"baseline": False, "perplexity": None})
    path = write_recipe(tmp_path / "recipe.yaml", recipe(fake_model(tmp_path), tmp_path / "store", variants, **extra))
    return api.plan(path)


@pytest.mark.parametrize("variant, field, message", [
    ({"method": "bitsandbytes", "scheme": "int8", "double_quant": True}, "variants[0]", "double_quant applies to nf4/fp4"),
    ({"method": "bitsandbytes", "scheme": "nf4", "threshold": 4.0}, "variants[0]", "threshold applies to int8"),
    ({"method": "autoround", "bits": 8, "group_size": 64, "format": "auto_awq"}, "variants[0]", "auto_awq packs 4-bit"),
    ({"method": "autoround", "bits": 4, "group_size": 64, "format": "auto_awq"}, "variants[0]", "set sym: false"),
    ({"method": "smoothquant", "smoothing_strength": 1.5}, "variants[0].smoothing_strength", "less than or equal to 1"),
    ({"method": "modelopt", "scheme": "nvfp4", "export": "trtllm-checkpoint"}, "variants[0]", "use export: hf"),
])
def test_option_errors_name_the_field(tmp_path, variant, field, message):
    with pytest.raises(RecipeError) as exc:
        plan_of(tmp_path, [{"name": "v", **variant}])
    assert field in str(exc.value) and message in str(exc.value)


def test_bnb_options_of_the_scheme_enter_the_key_others_do_not(tmp_path):
    from qbuild.quantize.bitsandbytes import BitsAndBytesVariant as V

    nf4 = V(name="a", method="bitsandbytes").quant_params()
    assert nf4 == {"method": "bitsandbytes", "scheme": "nf4", "double_quant": True, "compute_dtype": "bfloat16",
                   "dtype": "auto", "skip_modules": ["lm_head"]}
    assert V(name="b", method="bitsandbytes", scheme="int8").quant_params()["threshold"] == 6.0
    assert "threshold" not in nf4


@pytest.mark.parametrize("fmt, produced", [("auto_round", "auto-round"), ("llm_compressor", "compressed-tensors"),
                                            ("auto_gptq", "gptq"), ("auto_awq", "awq")])
def test_autoround_export_formats(tmp_path, fmt, produced):
    if not needs["auto_round"]:
        pytest.skip("needs auto-round")
    v = {"name": "v", "method": "autoround", "bits": 4, "group_size": 64, "format": fmt, "sym": fmt != "auto_awq"}
    p = plan_of(tmp_path, [v])
    art = next(a for a in p.artifacts if a.label == "v")
    assert art.step.format == produced and art.step.scheme == "w4a16"
    assert "calibration" in art.step.inputs and art.step.params["format"] == fmt


@pytest.mark.parametrize("fmt", ["auto_round", "llm_compressor"])
def test_autoround_exports_evaluated_by_transformers_here(tmp_path, fmt):
    if not needs["auto_round"]:
        pytest.skip("needs auto-round")
    p = plan_of(tmp_path, [{"name": "v", "method": "autoround", "bits": 4, "group_size": 64, "format": fmt}],
                evaluation={"baseline": False, "perplexity": {"context_length": 64, "max_windows": 1}})
    assert "v" not in p.not_evaluated
    ppl = next(s for s in p.steps if s.step.name == "perplexity[v]").step
    assert ppl.params["runtime"] == "transformers" and ppl.backend_env is None   # qbuild's own environment


def test_autoround_group_size_checked_at_plan_time(tmp_path, tiny_model_dir):
    if not needs["auto_round"]:
        pytest.skip("needs auto-round")
    from qbuild import api

    path = write_recipe(tmp_path / "r.yaml", recipe(tiny_model_dir, tmp_path / "store",
                                                    [{"name": "v", "method": "autoround", "group_size": 128}]))
    with pytest.raises(RecipeError, match=r"variants\[0\]\.group_size: group_size 128 does not divide hidden_size=576"):
        api.plan(path)


# --- ModelOpt NVFP4 / W4A8-MXFP4 ---------------------------------------------------------------------
FP4 = [("nvfp4", "NVFP4"), ("w4a8-mxfp4-fp8", "W4A8-MXFP4")]


@pytest.mark.parametrize("scheme, label", FP4)
def test_fp4_planned_needs_gpu_without_one(tmp_path, monkeypatch, scheme, label):
    if not needs["modelopt"]:
        pytest.skip("needs nvidia-modelopt")
    monkeypatch.setenv("QBUILD_FAKE_GPU", "none")
    p = plan_of(tmp_path, [{"name": "fp4", "method": "modelopt", "scheme": scheme}],
                targets=[{"type": "trtllm-pytorch"}])
    rows = {r["step"]: r for r in p.as_dict()["steps"]}
    assert rows["quantize[fp4]"]["status"] == "needs-gpu" and "needs a CUDA GPU" in rows["quantize[fp4]"]["reason"]
    art = next(a for a in p.artifacts if a.label == "fp4")
    assert art.step.format == "hf-modelopt" and art.step.params["export"] == "hf" and art.detail == label
    assert "package[fp4.trtllm-pytorch]" in rows   # the PyTorch-backend target takes the FP4 export
    # the same step with a GPU present is an ordinary miss, with the same key
    monkeypatch.setenv("QBUILD_FAKE_GPU", "NVIDIA H100 80GB HBM3:9.0:550.54.15")
    again = {r["step"]: r for r in plan_of(tmp_path, [{"name": "fp4", "method": "modelopt", "scheme": scheme}])
             .as_dict()["steps"]}
    assert again["quantize[fp4]"]["status"] == "miss" and again["quantize[fp4]"]["key"] == rows["quantize[fp4]"]["key"]


def test_fp4_on_missing_gpu_skip_builds_the_rest_and_fail_stops_first(tmp_path, monkeypatch, tiny_model_dir):
    if not needs["modelopt"]:
        pytest.skip("needs nvidia-modelopt")
    monkeypatch.setenv("QBUILD_FAKE_GPU", "none")
    variants = [{"name": "fp4", "method": "modelopt", "scheme": "nvfp4", "on_missing_gpu": "skip"}]
    path = write_recipe(tmp_path / "skip.yaml", recipe(tiny_model_dir, tmp_path / "store", variants,
                                                       evaluation={"baseline": False, "perplexity": None}))
    rc, summary = run_api(path)
    steps = {s["name"]: s for s in summary["steps"]}
    assert rc == 0 and steps["quantize[fp4]"]["status"] == "skipped" and "CUDA" in steps["quantize[fp4]"]["error"]
    assert steps["calibrate"]["status"] == "built"   # everything that needs no GPU was built
    variants[0]["on_missing_gpu"] = "fail"
    path = write_recipe(tmp_path / "fail.yaml", recipe(tiny_model_dir, tmp_path / "store2", variants,
                                                       evaluation={"baseline": False, "perplexity": None}))
    with pytest.raises(UserError, match=r"cannot run on this machine: step quantize\[fp4\]: needs a CUDA GPU"):
        run_api(path)
    assert not (tmp_path / "store2" / "objects").exists() or not any((tmp_path / "store2" / "objects").rglob("manifest.json"))


def test_existing_modelopt_keys_unchanged():
    """New fields (on_missing_gpu, a resolved export) must not move the keys of variants built before them."""
    from qbuild.quantize.modelopt import ModelOptVariant as V

    assert V(name="x", method="modelopt", scheme="fp8").quant_params() == {
        "method": "modelopt", "scheme": "fp8", "block_size": None, "dtype": "float16", "export": "trtllm-checkpoint",
        "tp_size": 1, "pp_size": 1}
    assert V(name="x", method="modelopt", scheme="int4-awq", block_size=64, export="hf",
             on_missing_gpu="skip").quant_params()["export"] == "hf"


@pytest.mark.parametrize("scheme, quant, ok", [
    ("nvfp4", {"quant_algo": "NVFP4", "group_size": 16}, True),
    ("nvfp4", {"quant_algo": "NVFP4", "group_size": 32}, False),
    ("w4a8-mxfp4-fp8", {"quant_algo": "W4A8_MXFP4_FP8", "group_size": 32}, True),
    ("w4a8-mxfp4-fp8", {"quant_algo": "MXFP4", "group_size": 32}, False),   # W4A4 MXFP4: no TRT-LLM Linear kernel
])
def test_fp4_export_check(tmp_path, scheme, quant, ok):
    from qbuild.quantize.modelopt.run import check_fp4_export

    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    if ok:
        assert check_fp4_export(tmp_path, scheme) == quant
    else:
        with pytest.raises(ValueError, match="TensorRT-LLM expects"):
            check_fp4_export(tmp_path, scheme)


def _has_cuda() -> bool:
    from qbuild.envs import tensorrt_llm as env

    return env.gpu() is not None and importlib.util.find_spec("modelopt") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU and nvidia-modelopt")
@pytest.mark.parametrize("scheme, algo, group", [("nvfp4", "NVFP4", 16), ("w4a8-mxfp4-fp8", "W4A8_MXFP4_FP8", 32)])
def test_fp4_export_on_gpu(tiny_model_dir, tmp_path, scheme, algo, group):
    """NOT RUN where it was written (no GPU there): ModelOpt FP4 quantization and HF export, then the
    trtllm-pytorch package around it."""
    variants = [{"name": "fp4", "method": "modelopt", "scheme": scheme, "dtype": "bfloat16"}]
    path = write_recipe(tmp_path / "r.yaml", recipe(tiny_model_dir, tmp_path / "store", variants,
                                                    targets=[{"type": "trtllm-pytorch"}],
                                                    evaluation={"baseline": False, "perplexity": None}))
    rc, summary = run_api(path)
    assert rc == 0, summary["steps"]
    rows = {v["variant"]: v for v in summary["variants"]}
    st = Store(tmp_path / "store")
    out = st.object_dir(rows["fp4"]["digest"])
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert (quant["quant_algo"], quant["group_size"]) == (algo, group)
    assert st.manifest(rows["fp4"]["digest"])["info"]["device"] == "cuda"
    package = st.object_dir(rows["fp4.trtllm-pytorch"]["digest"])
    info = json.loads((package / "qbuild-trtllm.json").read_text())
    assert info["quantization"] == f"modelopt:{algo}"
    assert yaml.safe_load((package / "extra_llm_api_options.yaml").read_text())["tensor_parallel_size"] == 1


def test_autoround_can_run_in_a_backend_environment_bitsandbytes_cannot(tmp_path):
    """auto-round pins its own torch in newer releases, so its step honours `env:`; bitsandbytes runs in qbuild's."""
    import sys

    if not needs["auto_round"]:
        pytest.skip("needs auto-round")
    p = plan_of(tmp_path, [{"name": "v", "method": "autoround", "group_size": 64, "env": {"python": sys.executable}}])
    step = next(a for a in p.artifacts if a.label == "v").step
    assert step.backend_env is not None and step.backend_env.python == sys.executable
    with pytest.raises(RecipeError, match=r"variants\[0\]\.env.*own environment only"):
        plan_of(tmp_path, [{"name": "b", "method": "bitsandbytes", "env": {"python": sys.executable}}])
