"""Layer-streamed evaluation (qbuild.runtimes.layer_stream) gives the whole model's logits, to the last bit on CPU.

Each family's tiny random-weight model (tests/model_families.py: RoPE variants, sliding-window layers, Gemma's
softcapping and scaled embeddings, Phi-3's fused projections, tied and untied heads) is evaluated on the same
windows both ways; so are compressed-tensors checkpoints of it and the demo's SmolLM2-135M, through the runtime
session a perplexity step opens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qbuild.contract.protocol import Window
from qbuild.runtimes import layer_stream
from qbuild.runtimes.transformers import TransformersSession
from tests.model_families import BY_NAME, SEED

DENSE = ("llama3", "qwen2.5", "qwen3", "gemma2", "gemma3", "phi3", "mistral")


def _save(family: str, out, shard: str | None = None):
    model_class, cfg = BY_NAME[family].make()
    torch.manual_seed(SEED)
    model_class(cfg).to(torch.bfloat16).save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return out


def _windows(vocab: int, n: int, length: int) -> list[Window]:
    rng = np.random.default_rng(1)
    return [Window(tokens=rng.integers(0, vocab, length).tolist(), first_scored=1) for _ in range(n)]


def _both(path, windows):
    streamed = TransformersSession(path, 1, "cpu")
    got = list(streamed.window_logits(windows))
    assert streamed._model is None and streamed._streamed, "the windows were not layer-streamed"
    whole = TransformersSession(path, 1, "cpu")
    assert whole.model is not None   # loaded: windows now go through the whole model
    want = list(whole.window_logits(windows))
    return got, want


@pytest.mark.parametrize("family", DENSE)
def test_streamed_logits_equal_the_whole_model_bit_for_bit(tmp_path, family):
    path = _save(family, tmp_path / family)
    got, want = _both(path, _windows(1024, 3, 128))   # 128 tokens: past Gemma's 64-token sliding window
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32 and g.shape == w.shape
        assert np.array_equal(g, w), f"{family}: max |diff| {np.abs(g - w).max()}"


def test_sharded_checkpoint_and_small_groups_stream_the_same(tmp_path, monkeypatch):
    """Weights spread over several safetensors files, and groups of one window (each reads every layer again)."""
    path = _save("llama3", tmp_path / "sharded", shard="1MB")
    assert len(list(path.glob("*.safetensors"))) > 2
    monkeypatch.setattr(layer_stream, "GROUP_HIDDEN_BYTES", 1)
    got, want = _both(path, _windows(1024, 3, 64))
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_moe_experts_fall_back_to_the_whole_model(tmp_path):
    """transformers fuses Qwen3-MoE's per-expert weights while loading: not streamable by name, so the session
    loads the whole model, and says why."""
    path = _save("qwen3-moe", tmp_path / "moe")
    with pytest.raises(layer_stream.NotStreamable, match="not stored under their own names"):
        layer_stream.LayerStreamedModel(path, "cpu", torch.float32)
    session = TransformersSession(path, 1, "cpu")
    assert len(list(session.window_logits(_windows(1024, 2, 32)))) == 2
    assert session._model is not None and session._streamed is False


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "W8A8"])
def test_compressed_tensors_checkpoints_stream_to_the_same_logits(tmp_path, scheme):
    """llm-compressor's output, each weight scheme (packed int4, with packed zero points when asymmetric, int8,
    fp8; W8A8 also quantizes activations as they pass): decompressed layer by layer by compressed-tensors, the
    same logits as transformers' whole model."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    src = _save("llama3", tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])])
    out = tmp_path / scheme
    model.save_pretrained(out, save_compressed=True)
    got, want = _both(out, _windows(1024, 2, 64))
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    streamed = TransformersSession(out, 1, "cpu")
    list(streamed.window_logits(_windows(1024, 1, 16)))
    info = streamed.info()   # recorded with every result: naming the Linear class must not load the whole model
    assert info["quant_method"] == "compressed-tensors" and info["linear_class"].endswith("Linear")
    assert streamed._model is None


def test_demo_model_streams_to_the_same_logits(smollm2_dir):
    got, want = _both(smollm2_dir, _windows(49152, 2, 256))
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
