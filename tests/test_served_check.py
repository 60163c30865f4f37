"""The served check (qbuild.serving.served_check): before a server's numbers are measured, its next-token
distributions at a few evaluation positions must agree with what the artifact's offline evaluation measured. The
bound's arithmetic here; a real llama-server on healthy and broken artifacts in tests/test_serving_e2e.py; a real
vLLM in tests/test_vllm_cpu.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qbuild.serving import served_check as sc


def _logprobs(rng, vocab: int, sharp: float) -> np.ndarray:
    z = rng.normal(size=vocab) * sharp
    return (z - np.log(np.exp(z - z.max()).sum()) - z.max()).astype(np.float32)


def _exact_kl(p_lp: np.ndarray, q_lp: np.ndarray) -> float:
    p = np.exp(p_lp.astype(np.float64))
    return float(np.sum(p * (p_lp.astype(np.float64) - q_lp.astype(np.float64))))


@pytest.mark.parametrize("seed", range(20))
def test_the_top_k_divergence_never_exceeds_the_full_one(seed):
    """Merging the tokens outside the served top-k into one outcome can only lower a KL divergence: what the check
    reads off a server is a lower bound of the served model's KLD, so a healthy server is never over-charged."""
    rng = np.random.default_rng(seed)
    ref, served = _logprobs(rng, 500, 3.0), _logprobs(rng, 500, 3.0 + seed % 3)
    top = np.argsort(served)[::-1][:sc.TOP_K]
    bound = sc.divergence_lower_bound(ref, {int(i): float(served[i]) for i in top})
    exact = _exact_kl(ref, served)
    assert 0 <= bound <= exact + 1e-9
    everything = sc.divergence_lower_bound(ref, {i: float(served[i]) for i in range(500)})
    assert everything == pytest.approx(exact, rel=1e-5, abs=1e-7)   # with every token served, it is the KLD


def test_a_distribution_against_itself_reads_zero():
    ref = _logprobs(np.random.default_rng(0), 300, 4.0)
    top = np.argsort(ref)[::-1][:sc.TOP_K]
    assert sc.divergence_lower_bound(ref, {int(i): float(ref[i]) for i in top}) == pytest.approx(0, abs=1e-7)


def test_verdict_keeps_a_server_within_its_offline_numbers_and_refuses_one_beyond():
    offline = {"kld_p99": 0.30, "top1_agreement": 0.88, "of": "its offline evaluation"}
    healthy = sc.verdict([0.04] * 16, [True] * 13 + [False] * 3, offline)
    assert "refused" not in healthy and healthy["kld_bound"] == pytest.approx(0.35)
    assert healthy["top1_bound"] == pytest.approx(0.88 - 0.1 - 3 * math.sqrt(0.88 * 0.12 / 16), abs=1e-4)
    rescaled = sc.verdict([1.39] * 16, [True] * 13 + [False] * 3, offline)   # logits halved: top-1 kept, KLD not
    assert rescaled["refused"].startswith("KLD to the baseline at least 1.390 on 16 probes, above 0.350")
    garbage = sc.verdict([5.0] * 16, [False] * 15 + [True], offline)
    assert "KLD" in garbage["refused"] and "top-1 agreement 0.06 on 16 probes" in garbage["refused"]


def test_the_baseline_is_held_to_itself():
    """A served baseline (vLLM, an HF checkpoint) must match its own stored log-probs: KLD ~0, top-1 near 1."""
    offline = sc.expected(None)
    assert offline == {"kld_p99": 0.0, "top1_agreement": 1.0, "of": "the baseline itself"}
    assert "refused" not in sc.verdict([0.0004] * 16, [True] * 15 + [False], offline)   # one near-tie flipped
    assert "refused" in sc.verdict([0.2] * 16, [True] * 16, offline)


def test_probes_fit_the_servers_context(tmp_path):
    """A server whose context per request is shorter than the evaluation's windows is probed within it: every prompt
    at most max_prompt tokens, each probe's reference the row that predicts the token after its prompt."""
    import json

    from safetensors.numpy import save_file

    from qbuild.evaluate import reference_encoding
    from qbuild.evaluate.data import INFO, TOKENS
    from qbuild.evaluate.quality import LOGPROBS, REFERENCE, TOP1

    vocab, ctx_len = 50, 16
    ids = np.arange(64, dtype=np.int64) % vocab
    data = tmp_path / "data"
    data.mkdir()
    save_file({"input_ids": ids}, str(data / TOKENS))
    (data / INFO).write_text(json.dumps({"join": "\n\n", "sources": [], "bos_token_id": None}))
    rng = np.random.default_rng(0)
    rows = np.stack([_logprobs(rng, vocab, 2.0) for _ in range(4 * (ctx_len - 1))])
    ref = tmp_path / "ref"
    ref.mkdir()
    with open(ref / LOGPROBS, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": reference_encoding.DTYPE, "fortran_order": False,
                                                 "shape": rows.shape})
        reference_encoding.encode(rows).tofile(f)
    np.save(ref / TOP1, reference_encoding.top1(rows))
    protocol = {"protocol": "fixed-window", "context_length": ctx_len, "stride": None, "max_windows": 4,
                "add_bos": False, "bos_token_id": None}
    (ref / REFERENCE).write_text(json.dumps({"protocol": protocol, "windows": [[i * 15, 15] for i in range(4)]}))
    whole = sc.probes(ref, data, max_prompt=100)
    short = sc.probes(ref, data, max_prompt=8)
    assert [len(p.prompt) for p in whole] == [8, 15] * 4   # the middle and last scored rows of each 16-token window
    assert [len(p.prompt) for p in short] == [4, 8] * 4
    for p in short:   # the window's first len(prompt) tokens; the row that predicts the next one
        start = ids.tolist().index(p.prompt[0])
        assert p.prompt == ids[start:start + len(p.prompt)].tolist()
    assert short[1].reference_top1 == int(rows[7].argmax()) and np.allclose(short[1].reference, rows[7], atol=2e-2)
