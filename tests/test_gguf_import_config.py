"""What a GGUF import must restore in the HF config that transformers' GGUF loader leaves out (issue 31; found by the
architecture matrix's round trips, whose import-check refused them): Llama 3's RoPE scaling, kept by llama.cpp only
as per-frequency divisors in `rope_freqs.weight`; Gemma's query scaling; and a Mixtral-style GGUF, which the loader
cannot import, refused at plan time."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from qbuild.models.gguf_import import gemma_attention_scalar, llama3_rope, unimportable


def llamacpp_rope_divisors(head_dim, theta, factor, low, high, original):
    """llama.cpp's converter (LlamaModel.generate_extra_tensors): one divisor per frequency."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * np.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_gguf(path, divisors):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("rope_freqs.weight", divisors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("head_dim", "theta", "factor", "high", "original", "context"), [
    (128, 500000.0, 8.0, 4.0, 8192, 131072),    # Llama 3.1 8B / 70B
    (64, 500000.0, 32.0, 4.0, 8192, 131072),    # Llama 3.2 1B
    (64, 500000.0, 8.0, 4.0, 1024, 2048),       # the matrix's tiny Llama 3
])
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, head_dim, theta, factor, high, original, context):
    divisors = llamacpp_rope_divisors(head_dim, theta, factor, 1.0, high, original)
    path = write_gguf(tmp_path / "llama.gguf", divisors)
    config = SimpleNamespace(model_type="llama", rope_parameters={"rope_theta": theta, "rope_type": "default"},
                             max_position_embeddings=context)
    rope = llama3_rope(path, config)
    assert rope == {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    # transformers computes the same frequencies from it as llama.cpp from the divisors
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope,
                     max_position_embeddings=context)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(inv_freq.numpy(), base / divisors, rtol=1e-5)


def test_no_rope_scaling_without_rope_freqs_or_outside_llama(tmp_path):
    plain = write_gguf(tmp_path / "plain.gguf", np.ones(32, dtype=np.float32))
    config = SimpleNamespace(model_type="llama", rope_parameters={"rope_theta": 1e4}, max_position_embeddings=2048)
    assert llama3_rope(plain, config) is None
    scaled = write_gguf(tmp_path / "scaled.gguf", llamacpp_rope_divisors(64, 5e5, 8.0, 1.0, 4.0, 1024))
    assert llama3_rope(scaled, SimpleNamespace(model_type="qwen2")) is None


def test_gemma_query_scaling_follows_llamacpp():
    def gemma(model_type, layers, hidden, heads, head_dim):
        return SimpleNamespace(model_type=model_type, num_hidden_layers=layers, hidden_size=hidden,
                               num_attention_heads=heads, head_dim=head_dim)

    assert gemma_attention_scalar(gemma("gemma3_text", 18, 640, 4, 256)) == 256   # Gemma 3 270M
    assert gemma_attention_scalar(gemma("gemma2", 2, 256, 4, 64)) == 64           # the matrix's tiny Gemma 2
    assert gemma_attention_scalar(gemma("gemma2", 46, 4608, 32, 128)) == 144      # Gemma 2 27B: hidden / heads
    assert gemma_attention_scalar(SimpleNamespace(model_type="llama")) is None


def test_a_mixtral_style_gguf_is_refused():
    assert "Mixtral-style GGUF" in unimportable({"model_type": "llama", "num_local_experts": 8})
    assert unimportable({"model_type": "llama"}) is None
    assert unimportable({"model_type": "qwen3moe", "num_local_experts": 8}) is None
