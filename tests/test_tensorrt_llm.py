"""TensorRT-LLM path on CPU: ModelOpt quantize + checkpoint export (real), checkpoint validation
(incl. the RoPE-base trap), trtllm-build / BuildConfig / trtllm-bench goldens, engine keys, engine-dir
parsing, pull selection by SM, no-GPU behaviour and unsupported pairs. No GPU, no tensorrt_llm needed.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from qbuild.base import hardware
from qbuild.contract.step import Step
from qbuild.envs import tensorrt_llm as trtllm_env
from qbuild.errors import RecipeError, UserError
from qbuild.models.checkpoint import CheckpointError, validate_hf_export, validate_trtllm_checkpoint
from qbuild.targets import tensorrt_llm as trt
from qbuild.targets import trtllm_pytorch as trtpt
from qbuild.targets.trtllm_select import engine_manifests, select_engine

H100 = "NVIDIA H100 80GB HBM3:9.0:550.54.15"
L4 = "NVIDIA L4:8.9:550.54.15"
TRT_121 = "1.2.1:10.13.3.9:13.0"

SRC_CONFIG = {  # SmolLM2-135M in transformers-5 layout: the RoPE base lives only in rope_parameters
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in (trtllm_env.FAKE_GPU, trtllm_env.FAKE_TRTLLM, trtllm_env.ENV_PYTHON):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, "none")
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, "none")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _recipe(tmp_path: Path, model_dir: Path, variants: list, targets: list, calibration=True) -> Path:
    data = {"name": "trt", "model": {"source": "local", "path": str(model_dir)}, "variants": variants,
            "targets": targets, "evaluation": {"baseline": False, "perplexity": None},
            "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}}
    if calibration:
        data["calibration"] = {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plan(path: Path):
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.plan import make_plan
    from qbuild.planning.recipe import load_recipe

    r = load_recipe(path)
    return make_plan(r, path.parent, Store(Path(r.store.path))).steps


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = 1
        for d in shape:
            n *= d
        size = n * {"F16": 2, "F32": 4, "I8": 1, "F8_E4M3": 1}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def _fake_checkpoint(d: Path, **overrides) -> Path:
    """A TensorRT-LLM checkpoint as ModelOpt 0.47 writes it (no rotary_base), tiny tensors."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architecture": "LlamaForCausalLM", "dtype": "float16", "num_hidden_layers": 2, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576, "norm_epsilon": 1e-5, "vocab_size": 49152,
           "max_position_embeddings": 8192, "hidden_act": "silu", "head_size": 64, "intermediate_size": 1536,
           "position_embedding_type": "rope_gpt_neox", "use_parallel_embedding": True, "embedding_sharding_dim": 0,
           "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
           "quantization": {"quant_algo": "W4A16_AWQ", "group_size": 64, "exclude_modules": ["lm_head"]}}
    cfg.update(overrides)
    (d / "config.json").write_text(json.dumps(cfg))
    _write_safetensors(d / "rank0.safetensors", {
        "transformer.vocab_embedding.weight": ("F16", [49152, 576]),
        "lm_head.weight": ("F16", [49152, 576]),
        "transformer.layers.0.mlp.proj.weight": ("I8", [288, 1536]),
        "transformer.layers.0.mlp.proj.weights_scaling_factor": ("F32", [576, 1536 // 64]),
    })
    return d


# --- checkpoint validation: the RoPE-base trap and friends ----------------------------------------------
def test_rope_base_trap_is_fixed_and_recorded(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ckpt")
    assert "rotary_base" not in json.loads((ckpt / "config.json").read_text())  # TRT-LLM would assume 10000
    fixes = validate_trtllm_checkpoint(ckpt, SRC_CONFIG, quant_algo="W4A16_AWQ", group_size=64)
    assert [(f["field"], f["was"], f["now"]) for f in fixes] == [("rotary_base", None, 100000.0)]
    assert json.loads((ckpt / "config.json").read_text())["rotary_base"] == 100000.0
    assert validate_trtllm_checkpoint(ckpt, SRC_CONFIG) == []  # idempotent


def test_rope_base_read_from_transformers4_layout_and_wrong_value_fixed(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ckpt", rotary_base=10000.0)
    src = {k: v for k, v in SRC_CONFIG.items() if k != "rope_parameters"} | {"rope_theta": 500000.0}
    fixes = validate_trtllm_checkpoint(ckpt, src)
    assert fixes[0]["field"] == "rotary_base" and fixes[0]["was"] == 10000.0 and fixes[0]["now"] == 500000.0


def test_rope_trap_refused_when_fixing_is_off(tmp_path):
    with pytest.raises(CheckpointError, match="rotary_base is None, the source model needs 100000"):
        validate_trtllm_checkpoint(_fake_checkpoint(tmp_path / "c"), SRC_CONFIG, fix=False)


def test_rope_scaling_missing_is_refused(tmp_path):
    src = {**SRC_CONFIG, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(CheckpointError, match="RoPE scaling 'llama3'"):
        validate_trtllm_checkpoint(_fake_checkpoint(tmp_path / "c"), src)


@pytest.mark.parametrize("override, message", [
    ({"hidden_size": 512}, "hidden_size is 512 in the checkpoint but 576"),
    ({"vocab_size": 32000}, "vocab_size is 32000"),
    ({"num_key_value_heads": 9}, "num_key_value_heads is 9"),
    ({"quantization": {"quant_algo": "W4A16_AWQ", "group_size": 128}}, "group_size is 128, expected 64"),
    ({"mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}}, "1 rank*.safetensors file(s) for world_size 2"),
])
def test_unfixable_mismatches_are_refused(tmp_path, override, message):
    ckpt = _fake_checkpoint(tmp_path / "c", **override)
    with pytest.raises(CheckpointError) as exc:
        validate_trtllm_checkpoint(ckpt, SRC_CONFIG, quant_algo="W4A16_AWQ", group_size=64)
    assert message in str(exc.value)
    assert "rotary_base" not in json.loads((ckpt / "config.json").read_text())  # nothing written when refusing


def test_group_size_checked_against_tensor_shapes(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "c")
    _write_safetensors(ckpt / "rank0.safetensors", {
        "transformer.vocab_embedding.weight": ("F16", [49152, 576]),
        "transformer.layers.0.mlp.proj.weight": ("I8", [288, 1536]),
        "transformer.layers.0.mlp.proj.weights_scaling_factor": ("F32", [576, 12]),  # really g128
    })
    with pytest.raises(CheckpointError, match="12 groups over 1536 inputs is not group_size 64"):
        validate_trtllm_checkpoint(ckpt, SRC_CONFIG)


def test_hf_export_gets_rope_theta_for_transformers4(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in SRC_CONFIG.items()}))
    fixes = validate_hf_export(d, SRC_CONFIG)
    assert fixes[0]["field"] == "rope_theta" and json.loads((d / "config.json").read_text())["rope_theta"] == 100000.0


# --- real ModelOpt quantize + TensorRT-LLM checkpoint export of the tiny model --------------------------
def test_modelopt_fp8_export_real_and_engine_skipped_without_gpu(tmp_path, tiny_model_dir):
    pytest.importorskip("modelopt")
    from qbuild.cli import cli

    path = _recipe(tmp_path, tiny_model_dir,
                   [{"name": "fp8", "method": "modelopt", "scheme": "fp8"}],
                   [{"type": "tensorrt-llm", "on_missing_gpu": "skip"}])
    res = CliRunner().invoke(cli, ["run", str(path), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    status = {s["name"]: s for s in summary["steps"]}
    assert status["quantize[fp8]"]["status"] == "built", status["quantize[fp8]"]
    assert status["engine[fp8.trtllm]"]["status"] == "skipped"
    assert "needs GPU" in status["engine[fp8.trtllm]"]["error"]
    assert summary["counts"]["skipped"] == 1

    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    m = store.manifest(status["quantize[fp8]"]["digest"])
    obj = store.object_dir(m["digest"])
    cfg = json.loads((obj / "config.json").read_text())
    assert m["format"] == "trtllm-checkpoint"
    assert cfg["quantization"]["quant_algo"] == "FP8" and cfg["rotary_base"] == 100000.0
    assert [f["field"] for f in m["info"]["checkpoint_fixes"]] == ["rotary_base"]  # the trap, recorded
    assert (obj / "rank0.safetensors").is_file() and (obj / "tokenizer.json").is_file()
    assert "nvidia-modelopt" in m["toolchain"] and "tensorrt_llm" not in m["toolchain"]
    assert validate_trtllm_checkpoint(obj, json.loads((tiny_model_dir / "config.json").read_text()),
                                      quant_algo="FP8", fix=False) == []


# --- plan-time checks ------------------------------------------------------------------------------------
def test_awq_block_size_128_rejected_for_576(tmp_path, tiny_model_dir):
    path = _recipe(tmp_path, tiny_model_dir, [{"name": "w4", "method": "modelopt", "scheme": "int4-awq"}], [])
    with pytest.raises(RecipeError) as exc:
        _plan(path)
    msg = str(exc.value)
    assert "variants[0].block_size" in msg and "128 does not divide" in msg and "576" in msg
    assert "block sizes that fit this model: 64" in msg


def test_gguf_variant_to_tensorrt_llm_rejected(tmp_path, tiny_model_dir):
    pytest.importorskip("llama_cpp")
    path = _recipe(tmp_path, tiny_model_dir, [{"name": "q8", "method": "gguf", "type": "Q8_0"}],
                   [{"type": "tensorrt-llm"}], calibration=False)
    with pytest.raises(RecipeError, match=r"targets\[0\].*'q8'.*cannot be built into a TensorRT-LLM engine"):
        _plan(path)


def _vstep(fmt: str, capability: str, **params) -> Step:
    return Step("quantize", "quantize[v]", params, None, variant="v", format=fmt, scheme=capability)


@pytest.mark.parametrize("fmt, scheme, params, reason", [
    ("compressed-tensors", "w4a16", {"method": "gptq", "bits": 4, "group_size": 64}, "INT4/INT8 weight-only"),
    ("compressed-tensors", "w4a16", {"method": "awq", "bits": 4}, "scheme fp8-dynamic, fp8-block, nvfp4, mxfp4, not w4a16"),
    ("compressed-tensors", "fp8-static", {"method": "fp8", "scheme": "static"}, "static per-tensor FP8"),
    ("trtllm-checkpoint", "fp8", {"method": "modelopt", "scheme": "fp8"}, "set export: hf"),
    ("gguf", "Q4_K_M", {"method": "gguf", "type": "Q4_K_M"}, "GGUF is llama.cpp's format"),
    ("hf-modelopt", "int8-sq", {"method": "modelopt", "scheme": "int8-sq"}, "use the tensorrt-llm target"),
])
def test_unsupported_pairs_for_trtllm_pytorch(fmt, scheme, params, reason):
    with pytest.raises(RecipeError, match=reason) as exc:
        trtpt.TensorRTLLMPyTorch().check_input(_vstep(fmt, scheme, **params), "targets[0]")
    assert "targets[0]: variant 'v'" in str(exc.value) and "PyTorch backend" in str(exc.value)


@pytest.mark.parametrize("fmt, scheme", [
    ("compressed-tensors", "fp8-dynamic"), ("hf-modelopt", "fp8"), ("hf-modelopt", "int4-awq"), ("compressed-tensors", "nvfp4"),
])
def test_supported_pairs_for_trtllm_pytorch(fmt, scheme):
    """Capability, not method name: any method whose output is this format + scheme is taken."""
    assert trtpt.TensorRTLLMPyTorch().refusal(_vstep(fmt, scheme, method="some-future-method")) is None


def test_tp_mismatch_rejected():
    target = trt.EngineTarget(type="tensorrt-llm", tp_size=2)
    with pytest.raises(RecipeError, match=r"targets\[0\].tp_size: 2 does not match"):
        trt.TensorRTLLMEngine().check_parallelism(
            target, _vstep("trtllm-checkpoint", "fp8", method="modelopt", scheme="fp8", tp_size=1, pp_size=1), "targets[0]")


def test_target_settings_validated():
    with pytest.raises(ValueError, match="max_input_len"):
        trt.EngineTarget(type="tensorrt-llm", max_input_len=4096, max_seq_len=2048)
    with pytest.raises(ValueError, match="needs kv_cache_type: paged"):
        trt.EngineTarget(type="tensorrt-llm", kv_cache_type="continuous")


# --- goldens: trtllm-build, BuildConfig, trtllm-bench, extra_llm_api_options ------------------------------
def test_trtllm_build_command_golden():
    t = trt.EngineTarget(type="tensorrt-llm", max_batch_size=16, max_input_len=1024, max_seq_len=4096,
                   max_num_tokens=8192, plugins={"gemm": "auto", "gpt_attention": "float16"})
    assert trt.trtllm_build_args(trt.build_settings(t), "/ckpt", "/engine") == [
        "trtllm-build", "--checkpoint_dir", "/ckpt", "--output_dir", "/engine",
        "--max_batch_size", "16", "--max_input_len", "1024", "--max_seq_len", "4096", "--max_num_tokens", "8192",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "float16",
        "--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "disable"]
    assert trt.build_config(trt.build_settings(t)) == {
        "max_batch_size": 16, "max_input_len": 1024, "max_seq_len": 4096, "max_num_tokens": 8192,
        "kv_cache_type": "paged",
        "plugin_config": {"gemm_plugin": "auto", "gpt_attention_plugin": "float16", "use_paged_context_fmha": True,
                          "use_fp8_context_fmha": False}}


def test_trtllm_build_command_continuous_kv():
    t = trt.EngineTarget(type="tensorrt-llm", kv_cache_type="continuous", use_paged_context_fmha=False,
                   plugins={"gemm": "disable"})
    args = trt.trtllm_build_args(trt.build_settings(t), "c", "e")
    assert args[args.index("--kv_cache_type") + 1] == "continuous"
    assert args[args.index("--use_paged_context_fmha") + 1] == "disable"
    assert args[args.index("--gemm_plugin") + 1] == "disable"


def test_trtllm_bench_command_golden():
    from qbuild.runtimes import tensorrt_llm as engine_runtime  # trtllm-bench is the runtime's

    assert engine_runtime.trtllm_bench_args("SmolLM2-135M", "/tok", "/engine", "/data.jsonl", "/report.json",
                                            num_requests=64, warmup=4, concurrency=8) == [
        "trtllm-bench", "--model", "SmolLM2-135M", "--model_path", "/tok", "throughput", "--backend", "tensorrt",
        "--engine_dir", "/engine", "--dataset", "/data.jsonl", "--num_requests", "64", "--warmup", "4",
        "--report_json", "/report.json", "--concurrency", "8"]
    rows = [json.loads(line) for line in engine_runtime.bench_dataset(3, 5, 7, 49152).splitlines()]
    assert [sorted(r) for r in rows] == [["input_ids", "output_tokens", "task_id"]] * 3
    assert len(rows[0]["input_ids"]) == 5 and rows[0]["output_tokens"] == 7


def test_extra_llm_api_options_golden():
    t = trtpt.PyTorchBackendTarget(type="trtllm-pytorch", tp_size=2, llm_api_options={
        "max_batch_size": 32, "kv_cache_config": {"free_gpu_memory_fraction": 0.8}, "cuda_graph_config": {}})
    assert trtpt.llm_api_options(t.canonical()) == {
        "kv_cache_config": {"free_gpu_memory_fraction": 0.8}, "max_batch_size": 32,
        "pipeline_parallel_size": 1, "tensor_parallel_size": 2}
    with pytest.raises(ValueError):
        trtpt.PyTorchBackendTarget(type="trtllm-pytorch", llm_api_options={"kv_cache_config": {"free_gpu_memory_fraction": 1.5}})
    with pytest.raises(ValueError):
        trtpt.PyTorchBackendTarget(type="trtllm-pytorch", llm_api_options={"max_batch_sise": 8})


# --- engine keys ------------------------------------------------------------------------------------------
def _engine_key(monkeypatch, gpu=H100, env=TRT_121, **target) -> Step:
    monkeypatch.setenv(trtllm_env.FAKE_GPU, gpu)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, env)

    class Ctx:
        threads = 1

        def add(self, s):
            return s

    return trt.TensorRTLLMEngine().plan(trt.EngineTarget(type="tensorrt-llm", **target),
                                        _vstep("trtllm-checkpoint", "fp8", method="modelopt", scheme="fp8", tp_size=1,
                                               pp_size=1), Ctx(), "t")


def test_engine_key_sensitivity(monkeypatch):
    monkeypatch.setenv(trtllm_env.FAKE_ARCH, "x86_64")
    base = _engine_key(monkeypatch)
    assert base.unavailable == "" and base.toolchain() == {
        "gpu.sm": "9.0", "gpu.name": "NVIDIA H100 80GB HBM3", "host.arch": "x86_64", "tensorrt_llm": "1.2.1",
        "tensorrt": "10.13.3.9", "cuda": "13.0"}
    same = _engine_key(monkeypatch, gpu="NVIDIA H100 80GB HBM3:9.0:560.00")  # the same GPU model, another driver
    assert same.key == base.key
    assert _engine_key(monkeypatch, gpu=L4).key != base.key                       # SM changed
    assert _engine_key(monkeypatch, env="1.2.0:10.13.3.9:13.0").key != base.key   # TensorRT-LLM changed
    assert _engine_key(monkeypatch, env="1.2.1:10.14.1.48:13.0").key != base.key  # TensorRT changed
    assert _engine_key(monkeypatch, max_batch_size=64).key != base.key            # build setting changed
    assert _engine_key(monkeypatch, on_missing_gpu="skip", name="x").key == base.key  # not build settings


def test_engine_key_ignores_unrelated_packages(monkeypatch):
    from qbuild.base import fingerprint

    base = _engine_key(monkeypatch).key
    real = fingerprint.package_version
    monkeypatch.setattr(fingerprint, "package_version", lambda d: "99.0" if d in ("numpy", "torch", "rich") else real(d))
    assert _engine_key(monkeypatch).key == base


def test_newer_trtllm_has_no_engine_builder(monkeypatch):
    step = _engine_key(monkeypatch, env="1.3.0:10.14.1.48:13.0")
    assert "has no TensorRT engine builder" in step.unavailable and "trtllm-pytorch" in step.unavailable


def test_expect_pins_key_without_gpu(monkeypatch):
    pinned = dict(expect={"sm": "9.0", "gpu_name": "NVIDIA H100 80GB HBM3", "arch": trtllm_env.host_arch(),
                          "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3.9", "cuda": "13.0"})
    on_gpu = _engine_key(monkeypatch, **pinned)
    no_gpu = _engine_key(monkeypatch, gpu="none", env="none", **pinned)
    assert no_gpu.key == on_gpu.key == _engine_key(monkeypatch).key  # plan elsewhere finds the same engine
    assert "needs GPU" in no_gpu.unavailable
    assert "SM 9.0" in _engine_key(monkeypatch, gpu=L4, **pinned).unavailable


# --- no-GPU behaviour through the CLI ----------------------------------------------------------------------
def _store_fake_checkpoint(tmp_path, tiny_model_dir):
    """A recipe whose modelopt variant is already stored (so no quantization runs in these tests)."""
    from qbuild.artifacts.store import Store

    path = _recipe(tmp_path, tiny_model_dir, [{"name": "fp8", "method": "modelopt", "scheme": "fp8"}],
                   [{"type": "tensorrt-llm"}])
    planned = _plan(path)
    q = next(p.step for p in planned if p.step.name == "quantize[fp8]")
    ckpt = _fake_checkpoint(tmp_path / "ck", quantization={"quant_algo": "FP8"})
    store = Store(tmp_path / "store")
    out = store.new_tmp(q.key) / "out"
    shutil.copytree(ckpt, out)
    store.publish(q.key, out, {"kind": "quantize", "name": q.name, "variant": "fp8", "format": q.format,
                               "params": q.params, "toolchain": q.toolchain()})
    return path, store


def test_plan_shows_needs_gpu_and_run_exits_2(tmp_path, tiny_model_dir):
    from qbuild.cli import cli

    path, _ = _store_fake_checkpoint(tmp_path, tiny_model_dir)
    res = CliRunner().invoke(cli, ["plan", str(path), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["step"]: r for r in json.loads(res.output)["steps"]}
    assert rows["quantize[fp8]"]["status"] == "hit"
    assert rows["engine[fp8.trtllm]"]["status"] == "needs-gpu" and "needs GPU" in rows["engine[fp8.trtllm]"]["reason"]
    res = CliRunner().invoke(cli, ["run", str(path)])
    assert res.exit_code == 2
    assert "step engine[fp8.trtllm]" in res.output and "needs GPU" in res.output and "on_missing_gpu: skip" in res.output


def test_engine_hit_on_machine_without_gpu(tmp_path, tiny_model_dir, monkeypatch):
    """An engine already stored for the pinned SM/toolchain plans as a hit, even without a GPU."""
    from qbuild.planning.recipe import load_recipe

    path, store = _store_fake_checkpoint(tmp_path, tiny_model_dir)
    data = yaml.safe_load(path.read_text())
    data["targets"][0]["expect"] = {"sm": "9.0", "gpu_name": "NVIDIA H100 80GB HBM3", "arch": "x86_64",
                                    "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3.9", "cuda": "13.0"}
    path.write_text(yaml.safe_dump(data))
    step = next(p.step for p in _plan(path) if p.step.name == "engine[fp8.trtllm]")
    eng = store.new_tmp(step.key) / "out"
    eng.mkdir()
    (eng / "config.json").write_text("{}")
    store.publish(step.key, eng, {"kind": trt.ENGINE_KIND, "name": step.name, "toolchain": step.toolchain()})
    statuses = {p.step.name: p.status for p in _plan(path)}
    assert statuses["engine[fp8.trtllm]"] == "hit"
    assert load_recipe(path)  # still valid


# --- engine dirs and pull --------------------------------------------------------------------------------
def _engine_dir(d: Path, with_info=True) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "version": "1.2.1",
        "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "float16",
                              "quantization": {"quant_algo": "FP8"}, "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}},
        "build_config": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 8192}}))
    (d / "rank0.engine").write_bytes(b"engine")
    if with_info:
        (d / trt.BUILD_INFO).write_text(json.dumps({"gpu_sm": "9.0", "tensorrt": "10.13.3.9", "tensorrt_llm": "1.2.1",
                                                    "cuda": "13.0", "gpu": {"name": "NVIDIA H100", "sm": "9.0"}}))
    return d


def test_parse_engine_dir(tmp_path):
    info = trt.parse_engine_dir(_engine_dir(tmp_path / "e"))
    assert info["tensorrt_llm"] == "1.2.1" and info["quant_algo"] == "FP8" and info["complete"]
    assert info["gpu_sm"] == "9.0" and info["tensorrt"] == "10.13.3.9" and info["max_seq_len"] == 2048
    bare = trt.parse_engine_dir(_engine_dir(tmp_path / "b", with_info=False))
    assert bare["gpu_sm"] is None and bare["tensorrt"] is None and not bare["recorded_by_qbuild"]
    with pytest.raises(UserError, match="not a TensorRT-LLM engine dir"):
        trt.parse_engine_dir(tmp_path)


def test_parse_nvidia_smi():
    gpu = hardware.parse_nvidia_smi("NVIDIA H100 80GB HBM3, 9.0, 550.54.15\nNVIDIA H100 80GB HBM3, 9.0, 550.54.15\n")
    assert (gpu.name, gpu.sm, gpu.driver, gpu.count) == ("NVIDIA H100 80GB HBM3", "9.0", "550.54.15", 2)
    assert hardware.parse_nvidia_smi("") is None


GPU_NAMES = {"9.0": "NVIDIA H100 80GB HBM3", "8.9": "NVIDIA L4", "10.0": "NVIDIA B200"}


def _publish_engine(store, key: str, sm: str, trtllm="1.2.1", tensorrt="10.13.3.9", created="2026-01-01",
                    gpu_name=None, arch=None):
    out = store.new_tmp(key) / "out"
    _engine_dir(out)
    (out / "sm.txt").write_text(sm)
    (out / "gpu.txt").write_text(gpu_name or GPU_NAMES[sm])
    toolchain = {"gpu.sm": sm, "gpu.name": gpu_name or GPU_NAMES[sm], "host.arch": arch or trtllm_env.host_arch(),
                 "tensorrt_llm": trtllm, "tensorrt": tensorrt, "cuda": "13.0"}
    return store.publish(key, out, {"kind": trt.ENGINE_KIND, "name": "engine[fp8.trtllm]", "variant": "fp8.trtllm",
                                    "toolchain": toolchain,
                                    "info": {"gpu": {"name": toolchain["gpu.name"]}},
                                    "recipe": {"name": "trt", "path": "/r/trt.yaml"}, "created_at": created})


def test_pull_selects_engine_by_sm(tmp_path):
    from qbuild.api import pull
    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    h = _publish_engine(store, "a" * 64, "9.0")
    l4 = _publish_engine(store, "b" * 64, "8.9")
    store.set_ref("trt", "fp8.trtllm", "latest", l4.digest, l4.key)  # the ref points at the last build (L4)
    assert len(engine_manifests(store, "trt", "fp8.trtllm")) == 2
    need = {"gpu.sm": "9.0", "gpu.name": GPU_NAMES["9.0"], "host.arch": trtllm_env.host_arch(), "tensorrt_llm": "1.2.1",
            "tensorrt": "10.13.3.9", "cuda": "13.0"}
    digest, path = pull("trt/fp8.trtllm", store=store, out=tmp_path / "out", need=need)
    assert digest == h.digest and (path / "sm.txt").read_text() == "9.0"
    with pytest.raises(UserError) as exc:
        pull("trt/fp8.trtllm", store=store, need={**need, "gpu.sm": "10.0", "gpu.name": GPU_NAMES["10.0"]})
    msg = str(exc.value)
    assert "needs: SM 10.0" in msg and "SM 9.0" in msg and "SM 8.9" in msg and "qbuild run /r/trt.yaml" in msg
    with pytest.raises(UserError, match="TensorRT 10.14"):
        pull("trt/fp8.trtllm", store=store, need={**need, "tensorrt": "10.14"})


def test_pull_cli_with_fake_gpu(tmp_path, monkeypatch):
    from qbuild.artifacts.store import Store
    from qbuild.cli import cli

    store = Store(tmp_path / "store")
    e = _publish_engine(store, "c" * 64, "8.9")
    store.set_ref("trt", "fp8.trtllm", "latest", e.digest, e.key)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, TRT_121)
    res = CliRunner().invoke(cli, ["pull", "trt/fp8.trtllm", "--store", str(store.root)])
    assert res.exit_code == 2 and "no stored engine fits" in res.output
    monkeypatch.setenv(trtllm_env.FAKE_GPU, L4)
    res = CliRunner().invoke(cli, ["pull", "trt/fp8.trtllm", "--store", str(store.root)])
    assert res.exit_code == 0 and e.digest in res.output


def test_select_engine_refuses_empty():
    with pytest.raises(UserError, match="no TensorRT-LLM engine is stored"):
        select_engine([], {"gpu.sm": "9.0"}, "x/y")


def test_trtllm_probe_never_imports_tensorrt_llm(monkeypatch):
    monkeypatch.delenv(trtllm_env.FAKE_TRTLLM)
    trtllm_env.clear_cache()
    assert trtllm_env.trtllm(None) is None  # not installed here: found via find_spec only
    import sys

    assert "tensorrt_llm" not in sys.modules
    # a configured interpreter without tensorrt_llm: probed in a subprocess, reported absent
    assert trtllm_env.trtllm(sys.executable) is None


def test_pull_engine_family_without_ref(tmp_path):
    from qbuild.api import pull
    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    h = _publish_engine(store, "d" * 64, "9.0")
    _publish_engine(store, "e" * 64, "8.9")
    need = {"gpu.sm": "9.0", "gpu.name": GPU_NAMES["9.0"], "host.arch": trtllm_env.host_arch(), "tensorrt_llm": "1.2.1",
            "tensorrt": "10.13.3.9", "cuda": "13.0"}
    assert pull("trt/fp8.trtllm", store=store, need=need)[0] == h.digest
    with pytest.raises(UserError, match="no ref"):
        pull("trt/other", store=store, need=need)
