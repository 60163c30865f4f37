"""One forward pass per model: the baseline's reference log-probs are an object of their own, reused by
every variant and by every later recipe with the same baseline and evaluation data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qbuild.artifacts.store import Store
from qbuild.contract.protocol import divergence_from_logprobs, scored_logprobs, window_divergence, windows
from qbuild.evaluate import reference_encoding
from qbuild.evaluate.quality import LOGPROBS, REFERENCE, TOP1, ReferenceReader

from helpers import qbuild, write_recipe


def test_divergence_from_stored_logprobs_equals_the_in_process_one():
    rng = np.random.default_rng(0)
    w = windows(np.arange(10, 74), "fixed-window", 33, True, 1, None)[0]
    base, var = rng.normal(size=(33, 500)).astype(np.float32), rng.normal(size=(33, 500)).astype(np.float32)
    a = window_divergence(base, var, w)
    b = divergence_from_logprobs(scored_logprobs(base, w), var, w)
    assert np.array_equal(a["kld"], b["kld"]) and np.array_equal(a["top1"], b["top1"])


def _recipe(tmp_path, model, name, variants):
    return write_recipe(tmp_path / f"{name}.yaml", {
        "name": name, "model": {"source": "local", "path": str(model)}, "variants": variants,
        "evaluation": {"baseline": True, "kld": True, "perplexity": {"context_length": 64, "max_windows": 2}},
        "runtime": {"threads": 1}})


def test_second_recipe_with_same_baseline_builds_no_baseline_evaluation(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    first = qbuild(_recipe(tmp_path, tiny_model_dir, "a", [{"name": "w8", "method": "rtn", "bits": 8,
                                                            "group_size": 64}]), "--store", store, "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    s1 = json.loads(first.stdout)
    steps = {s["name"]: s for s in s1["steps"]}
    # one pass per model: no kld[...] step re-running the baseline, no separate baseline perplexity
    assert steps["reference[baseline]"]["status"] == "built" and steps["perplexity[w8]"]["status"] == "built"
    assert not any(n.startswith("kld[") for n in steps) and "perplexity[baseline]" not in steps
    rows = {r["variant"]: r for r in s1["variants"]}
    assert rows["baseline"]["ppl"] > 1 and 0 < rows["w8"]["kld"] < 0.05 and rows["w8"]["top1"] > 0.8

    # the reference object: float16 log-probs of the scored positions (2 bytes per position and vocabulary entry,
    # the whole object included), each row's argmax beside them, its format and error bound recorded
    st = Store(store)
    ref_dir = st.object_dir(steps["reference[baseline]"]["digest"])
    info = json.loads((ref_dir / REFERENCE).read_text())
    assert info["format"]["dtype"] == "float16" and "2^-11" in info["format"]["error_bound"]
    assert st.manifest(steps["reference[baseline]"]["digest"])["info"]["logprobs"]["name"] == "qbuild-logprobs-v2"
    entries = info["rows"] * info["vocab"]
    stored = np.load(ref_dir / LOGPROBS, mmap_mode="r")
    assert stored.dtype == np.float16 and stored.shape == (info["rows"], info["vocab"]) == (126, 49152)
    assert (ref_dir / LOGPROBS).stat().st_size <= 2 * entries + 128   # + the .npy header
    object_bytes = sum(f.stat().st_size for f in ref_dir.rglob("*") if f.is_file())
    assert object_bytes <= 2 * entries + 4 * info["rows"] + 16384, (object_bytes, entries)
    assert np.load(ref_dir / TOP1).shape == (126,)
    reader = ReferenceReader(ref_dir)
    lp = reader.window(0)
    assert lp.dtype == np.float32 and lp.shape == (63, reader.vocab)
    assert np.allclose(np.exp(lp.astype(np.float64)).sum(axis=1), 1, atol=1e-6)   # renormalized on read
    assert np.array_equal(reader.top1(1), np.load(ref_dir / TOP1)[63:])
    div = json.loads((st.object_dir(steps["perplexity[w8]"]["digest"]) / "divergence.json").read_text())
    assert div["tokens_scored"] == 126 and div["baseline_runtime"]["name"] == "transformers"

    # another recipe, other variants, same baseline and evaluation data: the baseline is not evaluated again
    second = qbuild(_recipe(tmp_path, tiny_model_dir, "b", [{"name": "w4", "method": "rtn", "bits": 4,
                                                             "group_size": 64}]), "--store", store, "--json")
    assert second.returncode == 0, second.stderr[-3000:]
    s2 = {s["name"]: s for s in json.loads(second.stdout)["steps"]}
    assert s2["reference[baseline]"]["status"] == "cached"
    assert s2["reference[baseline]"]["digest"] == steps["reference[baseline]"]["digest"]
    assert s2["perplexity[w4]"]["status"] == "built"
    built = [n for n, s in s2.items() if s["status"] == "built"]
    assert sorted(built) == ["perplexity[w4]", "quantize[w4]"], built
    w4 = {r["variant"]: r for r in json.loads(second.stdout)["variants"]}["w4"]
    assert w4["kld"] > rows["w8"]["kld"]


@pytest.mark.parametrize("bad", ["missing"])
def test_reader_names_a_missing_object(tmp_path, bad):
    with pytest.raises(OSError):
        ReferenceReader(tmp_path / bad)


def test_score_rows_is_window_nll_and_window_divergence_in_one():
    from qbuild.contract.protocol import score_rows, window_nll

    rng = np.random.default_rng(1)
    for w in windows(np.arange(10, 200), "llama.cpp", 64, True, 1, None) + \
            windows(np.arange(10, 200), "sliding-window", 64, True, 1, None, 16):
        base = rng.normal(size=(len(w.tokens), 300)).astype(np.float32)
        var = base + rng.normal(scale=0.1, size=base.shape).astype(np.float32)
        rows = var[w.first_scored - 1: len(w.tokens) - 1]
        ref = score_rows(base[w.first_scored - 1: len(w.tokens) - 1], w, logprobs=True)["logprobs"]
        got = score_rows(rows, w, ref)
        assert (got["nll"], got["count"]) == window_nll(var, w)
        expected = window_divergence(base, var, w)
        assert np.array_equal(got["kld"], expected["kld"]) and np.array_equal(got["top1"], expected["top1"])


def test_batched_hf_windows_give_the_unbatched_logits(tiny_model_dir, monkeypatch):
    from qbuild.runtimes.transformers import TransformersSession

    s = TransformersSession(tiny_model_dir, 1, "cpu")
    wins = windows(np.arange(100, 400), "sliding-window", 64, True, 1, None, 32)
    one = [s.logits(w.tokens) for w in wins]
    monkeypatch.setenv("QBUILD_EVAL_BATCH_SIZE", "3")
    assert s.batch_size(64) == 3
    batched = list(s.window_logits(wins))
    assert len(batched) == len(one) and len({len(w.tokens) for w in wins}) > 1
    for a, b in zip(one, batched, strict=True):
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-4)


def _fake_quantized(model, bits: int):
    """`model` with every linear layer's weight rounded to `bits`-bit symmetric per-row RTN, in place."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                scale = w.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1)
                w.copy_(torch.round(w / scale) * scale)
    return model


@pytest.mark.parametrize("bits", [8, 4])
def test_float16_reference_moves_kld_within_its_bound_on_real_logits(tiny_model_dir, bits):
    """The stored encoding against the float32 computation, on a real model's logits against its own RTN-quantized
    copy: every position's KLD within kld_error_bound, the mean far inside the 1e-4 the demo's table is read at,
    top-1 the same; a model against itself reads ≈ 0, never below."""
    import torch
    from transformers import AutoModelForCausalLM

    from qbuild.contract.protocol import score_rows

    ids = np.random.default_rng(bits).integers(200, 40000, size=260)
    wins = windows(ids, "fixed-window", 128, True, 1, None)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    quantized = _fake_quantized(AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32),
                                bits).eval()
    errors, bounds, klds = [], [], []
    for w in wins:
        with torch.no_grad():
            x = torch.tensor([w.tokens])
            p_logits, q_logits = base(x).logits[0].numpy(), quantized(x).logits[0].numpy()
        p_rows, q_rows = (a[w.first_scored - 1: len(w.tokens) - 1] for a in (p_logits, q_logits))
        p = score_rows(p_rows, w, logprobs=True)["logprobs"]
        exact = score_rows(q_rows, w, p)
        stored, top1 = reference_encoding.encode(p), reference_encoding.top1(p)
        assert stored.dtype.itemsize == 2
        read = score_rows(q_rows, w, reference_encoding.decode(stored), reference_top1=top1)
        assert np.array_equal(read["top1"], exact["top1"])
        q = score_rows(q_rows, w, logprobs=True)["logprobs"]
        # float32 log-probs sum to 1 within ~1e-6 (a rounded log-sum-exp): the float32 KLD's own error, beside the bound
        unnormalized = np.abs(np.exp(p.astype(np.float64)).sum(axis=1) - 1)
        errors.append(read["kld"] - exact["kld"])
        bounds.append(reference_encoding.kld_error_bound(p, q) + unnormalized * (1 + exact["kld"]) + 1e-7)
        klds.append(exact["kld"])
        itself = score_rows(p_rows, w, reference_encoding.decode(stored), reference_top1=top1)["kld"]
        assert (itself <= reference_encoding.kld_error_bound(p, p) + 2 * unnormalized + 1e-7).all()
        assert itself.mean() < 1e-6
    err, bound, kld = np.concatenate(errors), np.concatenate(bounds), np.concatenate(klds)
    assert kld.mean() > (0.02 if bits == 4 else 1e-4)   # a real divergence to measure, not ≈ 0
    print(f"{bits}-bit: KLD {kld.mean():.6g}, error mean {err.mean():.3g} max {np.abs(err).max():.3g}, "
          f"bound mean {bound.mean():.3g} max {bound.max():.3g}")
    assert (np.abs(err) <= bound).all(), np.max(np.abs(err) - bound)
    assert abs(err.mean()) < 1e-5 and bound.mean() < 2e-3, (err.mean(), bound.mean())
