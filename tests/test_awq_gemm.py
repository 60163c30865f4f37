"""AWQ in AutoAWQ's GEMM layout: the compressed-tensors → AutoAWQ converter is exact, bit for bit.

Three levels:
- synthetic compressed-tensors checkpoints (packed with compressed-tensors' own packer, sym and asym, one file
  and sharded): fast checks of the layout against AutoAWQ's documented nibble order;
- plan time: the convert step and its key, the refusals (one line naming the field), "not evaluated";
- a real llm-compressor AWQ W4A16 g32 asym run on the 2-layer SmolLM2 through qbuild's API, whose
  compressed-tensors output (dequantized by compressed-tensors itself, through transformers) and AutoAWQ
  output (dequantized by the unpacking below) agree on every Linear with torch.equal.

The AutoAWQ side is read here independently of qbuild/quantize/llmcompressor/awq/gemm.py, the way AutoAWQ's reader does it
(awq/utils/packing_utils.py: unpack_awq shifts nibbles out in storage order, reverse_awq_order permutes them
with [0, 4, 1, 5, 2, 6, 3, 7], dequantize_gemm computes (w - z) * s in the scales' float16).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qbuild.errors import RecipeError
from qbuild.pipeline.plan import build_steps
from qbuild.planning.recipe import parse_recipe
from qbuild.plugins import runtimes_for

from helpers import fake_model, qbuild, run_api, write_recipe

needs_ct = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                              reason="needs qbuild[llmcompressor]")
needs_llmcompressor = pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None,
                                         reason="needs qbuild[llmcompressor]")

AUTOAWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]   # awq/utils/packing_utils.py: AWQ_REVERSE_ORDER


# --- AutoAWQ's reader, written from its documented order ------------------------------------------------
def awq_unpack(words):
    """int32 [rows, n] → int32 [rows, 8n] of 0..15 in column order: shift out nibbles 0..7 of each word, then
    put them in column order with AutoAWQ's reverse order."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words[:, :, None] >> shifts) & 15                  # storage order, per word
    return nibbles[:, :, AUTOAWQ_REVERSE_ORDER].reshape(words.shape[0], -1)


def awq_dequantize(qweight, qzeros, scales, group_size: int, dtype):
    """The [out, in] weight AutoAWQ's tensors hold, computed in `dtype` (AutoAWQ itself uses the scales' float16)."""
    weight = awq_unpack(qweight)
    zeros = awq_unpack(qzeros).repeat_interleave(group_size, dim=0)
    return ((weight - zeros).to(dtype) * scales.to(dtype).repeat_interleave(group_size, dim=0)).t()


# --- synthetic compressed-tensors checkpoints -------------------------------------------------------------
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 32,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 64), "self_attn.v_proj": (64, 64),
           "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128)}


def ct_quantization_config(sym: bool, group_size: int, bits: int = 4) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group_size,
               "dynamic": False, "actorder": None, "observer": "memoryless_minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}}


def synthetic_ct_checkpoint(root: Path, *, sym: bool, group_size: int = 32, shards: int = 1, seed: int = 0,
                            scale_dtype=None, unquantized: tuple[str, ...] = ()) -> dict:
    """A 1-layer llama in compressed-tensors pack-quantized W4A16 form with random integers, float16-valued
    scales (stored as float32, as llm-compressor stores them for a float32 model) and real unquantized tensors.
    Returns {module: (signed weight int8 [out, in], signed zero int8 [out, groups], scale)}."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": torch.randn(32, 64, generator=gen),
               "model.norm.weight": torch.rand(64, generator=gen),
               "model.layers.0.input_layernorm.weight": torch.rand(64, generator=gen),
               "model.layers.0.post_attention_layernorm.weight": torch.rand(64, generator=gen),
               "lm_head.weight": torch.randn(32, 64, generator=gen)}
    truth = {}
    for leaf, (out, inp) in LINEARS.items():
        name = f"model.layers.0.{leaf}"
        if leaf in unquantized:   # kept in full precision, as an `ignore` rule does
            tensors[f"{name}.weight"] = torch.randn(out, inp, generator=gen)
            continue
        groups = inp // group_size
        q = torch.randint(-8, 8, (out, inp), generator=gen, dtype=torch.int8)
        z = torch.zeros(out, groups, dtype=torch.int8) if sym else torch.randint(-8, 8, (out, groups), generator=gen,
                                                                                  dtype=torch.int8)
        scale = (torch.rand(out, groups, generator=gen) * 0.05 + 1e-4).to(scale_dtype or torch.float16).float()
        tensors[f"{name}.weight_packed"] = pack_to_int32(q, 4)
        tensors[f"{name}.weight_scale"] = scale
        tensors[f"{name}.weight_shape"] = torch.tensor([out, inp])
        if not sym:
            tensors[f"{name}.weight_zero_point"] = pack_to_int32(z, 4, packed_dim=0).contiguous()
        truth[name] = (q, z, scale)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    else:
        # round-robin, so a module's weight_packed, weight_scale and weight_zero_point land in different shards
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {n: files[i % shards] for i, n in enumerate(names)}
        for f in files:
            save_file({n: tensors[n] for n in names if weight_map[n] == f}, str(root / f), metadata={"format": "pt"})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                       "weight_map": weight_map}))
    config = {**TINY_LLAMA, "quantization_config": ct_quantization_config(sym, group_size)}
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return truth


def read_checkpoint(root: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def ct_decompress(root: Path, module: str):
    """compressed-tensors' own decompression of one module of a checkpoint (its pack-quantized compressor)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((root / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    tensors = read_checkpoint(root)
    local = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
    return PackedQuantizationCompressor.decompress(local, scheme)["weight"]


@needs_ct
def test_nibble_order_is_autoawqs_order_map():
    """Columns 0..7 holding the values 0..7 pack into 0x75316420: nibble i holds column [0,2,4,6,1,3,5,7][i]."""
    import torch

    from qbuild.quantize.llmcompressor.awq.gemm import pack_awq

    values = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 0, 15], [0, 15, 0, 0, 0, 0, 0, 0]])
    words = pack_awq(values)
    assert words.dtype == torch.int32 and words.shape == (3, 1)
    assert words[:, 0].tolist() == [0x75316420, 0xF0000000 - 2**32, 0x000F0000]
    assert torch.equal(awq_unpack(words), values.to(torch.int32))


@needs_ct
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("shards", [1, 3])
def test_synthetic_checkpoint_converts_bit_exactly(tmp_path, sym, shards):
    import torch

    from qbuild.quantize.llmcompressor.awq.gemm import convert_checkpoint

    src, dst = tmp_path / "ct", tmp_path / "awq"
    truth = synthetic_ct_checkpoint(src, sym=sym, shards=shards)
    facts = convert_checkpoint(src, dst, log=lambda _: None)
    assert facts == {"group_size": 32, "linears_converted": 7, "modules_to_not_convert": ["lm_head"], "symmetric": sym}
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32,
                                             "zero_point": True, "modules_to_not_convert": ["lm_head"]}
    assert config["hidden_size"] == 64 and config["model_type"] == "llama"
    assert (dst / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    if shards > 1:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in dst.glob("*.safetensors"))
    src_tensors, out = read_checkpoint(src), read_checkpoint(dst)
    for name, (q, z, scale) in truth.items():
        o, i = q.shape
        qweight, qzeros, scales = out[f"{name}.qweight"], out[f"{name}.qzeros"], out[f"{name}.scales"]
        assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (i, o // 8))
        assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (i // 32, o // 8))
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (i // 32, o))
        # the integers: AutoAWQ's unsigned nibbles are compressed-tensors' signed values + 8
        assert torch.equal(awq_unpack(qweight).t(), q.to(torch.int32) + 8), name
        assert torch.equal(awq_unpack(qzeros).t(), z.to(torch.int32) + 8), name
        if sym:
            assert (qzeros == 0x88888888 - 2**32).all()   # every zero is 8
        assert torch.equal(scales.t().float(), scale), name
        # the weights: compressed-tensors' own decompression vs AutoAWQ's layout, in float32 and in float16
        expected = ct_decompress(src, name)
        assert torch.equal(awq_dequantize(qweight, qzeros, scales, 32, torch.float32), expected), name
        assert torch.equal(awq_dequantize(qweight, qzeros, scales, 32, torch.float16), expected.half()), name
        assert not any(k.startswith(name + ".weight") for k in out), name
    for name, tensor in src_tensors.items():
        if ".weight_" not in name:   # embeddings, norms, lm_head: unchanged, dtype included
            assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


@needs_ct
def test_linears_left_in_full_precision_are_named_and_copied(tmp_path):
    import torch

    from qbuild.quantize.llmcompressor.awq.gemm import convert_checkpoint

    truth = synthetic_ct_checkpoint(tmp_path / "ct", sym=False, unquantized=("mlp.down_proj", "self_attn.k_proj"))
    facts = convert_checkpoint(tmp_path / "ct", tmp_path / "awq", log=lambda _: None)
    kept = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.k_proj"]
    assert facts["modules_to_not_convert"] == kept and facts["linears_converted"] == len(truth) == 5
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == kept
    src, out = read_checkpoint(tmp_path / "ct"), read_checkpoint(tmp_path / "awq")
    for name in kept[1:]:
        assert torch.equal(out[f"{name}.weight"], src[f"{name}.weight"]) and f"{name}.qweight" not in out


@needs_ct
def test_scales_that_are_not_float16_numbers_are_refused(tmp_path):
    import torch

    from qbuild.quantize.llmcompressor.awq.gemm import ConversionError, convert_checkpoint

    synthetic_ct_checkpoint(tmp_path / "ct", sym=False, scale_dtype=torch.float32)
    with pytest.raises(ConversionError, match="not float16 numbers.*not be exact"):
        convert_checkpoint(tmp_path / "ct", tmp_path / "awq", log=lambda _: None)


@needs_ct
@pytest.mark.parametrize("change, problem", [
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8), "weights are int8, not int4"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None),
     "strategy is channel, not group"),
    (lambda qc: qc["config_groups"]["group_0"].update(format="naive-quantized"), "not pack-quantized"),
    (lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
     "activations are quantized"),
])
def test_other_schemes_are_refused(tmp_path, change, problem):
    from qbuild.quantize.llmcompressor.awq.gemm import ConversionError, convert_checkpoint

    synthetic_ct_checkpoint(tmp_path / "ct", sym=False)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    change(config["quantization_config"])
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=problem):
        convert_checkpoint(tmp_path / "ct", tmp_path / "awq", log=lambda _: None)


# --- plan time ---------------------------------------------------------------------------------------------
def recipe_for(model: Path, store: Path, variants: list[dict], evaluation=None) -> dict:
    return {"name": "awqgemm", "model": {"source": "local", "path": str(model)},
            "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64, "seed": 0},
            "variants": variants, "evaluation": evaluation or {"perplexity": None, "baseline": False},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


def plan_steps(data: dict, base: Path):
    ctx = build_steps(parse_recipe(data), base)
    return {s.name: s for s in ctx.steps}, ctx.artifact_steps()


@needs_llmcompressor
def test_autoawq_adds_a_convert_step_whose_output_is_the_variant(tmp_path):
    model = fake_model(tmp_path)
    plain = {"name": "ct", "method": "awq", "bits": 4, "group_size": 64, "sym": False}
    gemm = {**plain, "name": "gemm", "checkpoint_format": "autoawq"}
    steps, artifacts = plan_steps(recipe_for(model, tmp_path / "s", [plain, gemm]), tmp_path)
    convert = steps["convert[gemm]"]
    assert artifacts["gemm"] is convert and artifacts["ct"] is steps["quantize[ct]"]
    assert (convert.kind, convert.format, convert.scheme, convert.variant) == ("convert", "awq", "w4a16", "gemm")
    assert convert.inputs == {"quantized": steps["quantize[gemm]"]}
    assert convert.runner == "qbuild.quantize.llmcompressor.awq.run:run_convert"
    assert "convert[ct]" not in steps
    # the quantize step computes float16 scales for the exact conversion; the format itself is not a quantize param
    assert steps["quantize[gemm]"].params["scale_dtype"] == "float16"
    assert "checkpoint_format" not in steps["quantize[gemm]"].params
    assert steps["quantize[ct]"].params == {k: v for k, v in steps["quantize[gemm]"].params.items() if k != "scale_dtype"}
    # the default keeps the key the awq method had before the option existed: its params never name the format
    assert "checkpoint_format" not in steps["quantize[ct]"].params and "scale_dtype" not in steps["quantize[ct]"].params


@needs_llmcompressor
@pytest.mark.parametrize("change, field, words", [
    ({"bits": 8}, "variants[0].bits", "4-bit weights only, got bits 8"),
    ({"group_size": None}, "variants[0].group_size", "group-quantized weights only"),
    ({"group_size": -1}, "variants[0].group_size", "group-quantized weights only"),
])
def test_autoawq_refuses_what_its_layout_cannot_hold(tmp_path, change, field, words):
    variant = {"name": "g", "method": "awq", "bits": 4, "group_size": 64, "checkpoint_format": "autoawq", **change}
    with pytest.raises(RecipeError) as exc:
        plan_steps(recipe_for(fake_model(tmp_path), tmp_path / "s", [variant]), tmp_path)
    assert exc.value.field == field and words in str(exc.value)


@needs_llmcompressor
def test_autoawq_refuses_output_channels_it_cannot_pack(tmp_path):
    model = fake_model(tmp_path)   # hidden 256; 64 heads of 4 with one KV head: k/v_proj have 4 output channels
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 64, "num_key_value_heads": 1}))
    variant = {"name": "g", "method": "awq", "group_size": 64, "checkpoint_format": "autoawq"}
    with pytest.raises(RecipeError) as exc:
        plan_steps(recipe_for(model, tmp_path / "s", [variant]), tmp_path)
    assert exc.value.field == "variants[0].checkpoint_format"
    assert "num_key_value_heads*head_dim=4 is not a multiple of 8" in str(exc.value)


@needs_llmcompressor
def test_refusal_through_the_cli_is_one_line_and_exit_2(tmp_path):
    variant = {"name": "g", "method": "awq", "bits": 8, "group_size": 64, "checkpoint_format": "autoawq"}
    recipe = write_recipe(tmp_path / "r.yaml", recipe_for(fake_model(tmp_path), tmp_path / "s", [variant]))
    res = qbuild("plan", recipe, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert "r.yaml:" in res.stderr and "variants[0].bits" in res.stderr and "autoawq" in res.stderr


@needs_llmcompressor
def test_plan_says_how_an_awq_artifact_is_evaluated(tmp_path):
    variant = {"name": "g", "method": "awq", "group_size": 64, "checkpoint_format": "autoawq"}
    data = recipe_for(fake_model(tmp_path), tmp_path / "s", [variant],
                      {"perplexity": {"context_length": 64, "max_windows": 2}, "baseline": False})
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    if runtimes_for("awq"):   # a runtime that reads AutoAWQ checkpoints is installed: the variant is evaluated
        assert "perplexity[g]" in res.stdout
    else:
        assert "not evaluated: g: no runtime for awq" in " ".join(res.stdout.split())
        assert "perplexity[g]" not in res.stdout


@needs_llmcompressor
def test_planning_an_autoawq_variant_never_imports_torch(tmp_path):
    variant = {"name": "g", "method": "awq", "group_size": 64, "checkpoint_format": "autoawq"}
    data = json.dumps(recipe_for(fake_model(tmp_path), tmp_path / "s", [variant]))
    code = ("import json, sys; from pathlib import Path; from qbuild.pipeline.plan import build_steps; "
            "from qbuild.planning.recipe import parse_recipe; "
            f"ctx = build_steps(parse_recipe(json.loads({data!r})), Path('.')); "
            "assert 'convert[g]' in [s.name for s in ctx.steps]; "
            "bad = [m for m in ('torch', 'transformers', 'safetensors', 'compressed_tensors') if m in sys.modules]; "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# --- a real AWQ run: compressed-tensors output vs its AutoAWQ conversion, every Linear ---------------------------
@pytest.fixture(scope="module")
def awq_run(tiny_model_dir, tmp_path_factory):
    """llm-compressor AWQ W4A16 g32 asym on the 2-layer SmolLM2 (4 samples × 64 tokens), then the conversion."""
    root = tmp_path_factory.mktemp("awq-gemm")
    variant = {"name": "awq-gemm", "method": "awq", "bits": 4, "group_size": 32, "sym": False,
               "checkpoint_format": "autoawq"}
    recipe = write_recipe(root / "recipe.yaml", recipe_for(tiny_model_dir, root / "store", [variant]))
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    from qbuild.artifacts.store import Store

    store = Store(root / "store")
    steps = {s["name"]: s for s in summary["steps"]}
    return {"recipe": recipe, "summary": summary, "store": store, "model": tiny_model_dir,
            "ct": store.object_dir(steps["quantize[awq-gemm]"]["digest"]),
            "awq": store.object_dir(steps["convert[awq-gemm]"]["digest"])}


@needs_llmcompressor
def test_real_awq_run_yields_an_autoawq_artifact(awq_run):
    row = next(v for v in awq_run["summary"]["variants"] if v["variant"] == "awq-gemm")
    assert (row["status"], row["format"]) == ("built", "awq"), row
    steps = {s["name"]: s for s in awq_run["summary"]["steps"]}
    assert row["digest"] == steps["convert[awq-gemm]"]["digest"]
    assert awq_run["awq"] == awq_run["store"].object_dir(row["digest"])   # the ref and the row are the converted one
    manifest = json.loads((awq_run["awq"] / "manifest.json").read_text())
    assert manifest["format"] == "awq" and manifest["kind"] == "convert"
    assert {"vllm", "sglang", "tgi", "lmdeploy", "transformers"} <= set(manifest["info"]["loads_in"])
    assert manifest["info"]["modules_to_not_convert"] == ["lm_head"] and manifest["info"]["linears_converted"] == 14
    assert {"compressed-tensors", "torch", "safetensors"} <= set(manifest["toolchain"])
    ct_config = json.loads((awq_run["ct"] / "config.json").read_text())["quantization_config"]
    assert ct_config["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.float16"
    config = json.loads((awq_run["awq"] / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32,
                                             "zero_point": True, "modules_to_not_convert": ["lm_head"]}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (awq_run["awq"] / name).read_bytes() == (awq_run["ct"] / name).read_bytes(), name
    rc, again = run_api(awq_run["recipe"])
    assert rc == 0 and again["counts"]["built"] == 0


@needs_llmcompressor
def test_real_awq_conversion_is_bit_exact_on_every_linear(awq_run):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    # compressed-tensors' own decompression, as transformers loads the checkpoint
    model = AutoModelForCausalLM.from_pretrained(str(awq_run["ct"]), quantization_config=CompressedTensorsConfig(dequantize=True))
    awq = read_checkpoint(awq_run["awq"])
    compared = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        expected = module.weight.data
        assert expected.dtype == torch.float32
        args = (awq[f"{name}.qweight"], awq[f"{name}.qzeros"], awq[f"{name}.scales"], 32)
        assert torch.equal(awq_dequantize(*args, torch.float32), expected), name
        assert torch.equal(awq_dequantize(*args, torch.float16), expected.half()), name   # AutoAWQ's own arithmetic
        compared.append(name)
    assert len(compared) == 14   # 2 layers × q, k, v, o, gate, up, down
    # the quantization is real: asymmetric zero points vary, and weights moved off the original ones
    zeros = torch.cat([awq_unpack(awq[f"{n}.qzeros"]).flatten() for n in compared])
    assert len(zeros.unique()) > 4
    original = AutoModelForCausalLM.from_pretrained(str(awq_run["model"]), dtype=torch.float32)
    w0 = original.model.layers[0].self_attn.q_proj.weight.data
    assert not torch.equal(w0, model.model.layers[0].self_attn.q_proj.weight.data)
    # unquantized tensors are copied unchanged
    ct_tensors = read_checkpoint(awq_run["ct"])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(awq[name], ct_tensors[name]) and awq[name].dtype == ct_tensors[name].dtype, name
