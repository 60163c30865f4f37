"""Perplexity protocols, divergence math and gates: pure functions, checked against direct computation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from qbuild.contract.protocol import window_divergence, window_nll, windows
from qbuild.evaluate.gates import check_gates
from qbuild.planning.recipe import Gate

from helpers import fake_recipe, qbuild, write_recipe

IDS = np.arange(10, 1010)  # 1000 tokens


def scored_positions(wins, ids, start_of: list[int]) -> list[int]:
    out = []
    for w, start in zip(wins, start_of, strict=True):
        out += [start + i for i in range(w.first_scored, len(w.tokens))]
    return out


def test_fixed_window_scores_every_token_once_after_bos():
    wins = windows(IDS, "fixed-window", 101, True, 1, None)
    assert len(wins) == 10 and all(len(w.tokens) == 101 and w.tokens[0] == 1 for w in wins)
    assert sum(len(w.tokens) - w.first_scored for w in wins) == 1000


def test_fixed_window_without_bos_cannot_score_first_token():
    wins = windows(IDS, "fixed-window", 100, False, None, 3)
    assert len(wins) == 3 and sum(len(w.tokens) - w.first_scored for w in wins) == 3 * 99


def test_llama_cpp_protocol_scores_second_half_with_bos_replacing_first():
    wins = windows(IDS, "llama.cpp", 100, True, 1, None)
    assert len(wins) == 10
    assert wins[1].tokens[0] == 1 and wins[1].tokens[1] == IDS[101]
    assert all(len(w.tokens) - w.first_scored == 100 - 100 // 2 - 1 for w in wins)


@pytest.mark.parametrize("add_bos", [False, True])
def test_sliding_window_scores_each_token_exactly_once(add_bos):
    ctx, stride = 64, 16
    wins = windows(IDS, "sliding-window", ctx, add_bos, 1 if add_bos else None, None, stride)
    body = ctx - 1 if add_bos else ctx
    starts = [i * stride - (1 if add_bos else 0) for i in range(len(wins))]
    positions = scored_positions(wins, IDS, starts)
    assert sorted(positions) == positions and len(set(positions)) == len(positions)
    assert positions == list(range(0 if add_bos else 1, 1000))
    assert all(len(w.tokens) <= body + add_bos for w in wins)


def test_max_windows_caps_and_short_text_gives_none():
    assert len(windows(IDS, "fixed-window", 64, True, 1, 2)) == 2
    assert windows(IDS[:10], "fixed-window", 64, True, 1, None) == []


def test_window_nll_matches_direct_log_softmax():
    rng = np.random.default_rng(0)
    w = windows(IDS[:40], "fixed-window", 21, True, 1, 1)[0]
    logits = rng.normal(size=(len(w.tokens), 1200)).astype(np.float32)
    nll, n = window_nll(logits, w)
    direct = 0.0
    for i in range(w.first_scored, len(w.tokens)):
        row = logits[i - 1].astype(np.float64)
        direct -= row[w.tokens[i]] - math.log(np.exp(row).sum())
    assert n == 20 and nll == pytest.approx(direct, rel=1e-9)
    uniform, _ = window_nll(np.zeros_like(logits), w)
    assert uniform / n == pytest.approx(math.log(1200))


def test_divergence_is_zero_for_same_logits_and_positive_otherwise():
    rng = np.random.default_rng(1)
    w = windows(IDS[:40], "fixed-window", 21, True, 1, 1)[0]
    a = rng.normal(size=(21, 50))
    same = window_divergence(a, a.copy(), w)
    assert np.allclose(same["kld"], 0) and same["top1"].all()
    other = window_divergence(a, a + rng.normal(scale=2.0, size=a.shape), w)
    assert (other["kld"] > 0).all() and other["top1"].mean() < 1


def test_gates_report_what_failed_and_by_how_much():
    summary = {"variants": [
        {"variant": "baseline", "ppl": 10.0},
        {"variant": "a", "delta_ppl": 0.2, "delta_ppl_pct": 2.0, "kld": 0.01, "top1": 0.95, "size_bytes": 50 * 2**20},
        {"variant": "b", "delta_ppl": 1.5, "delta_ppl_pct": 15.0, "kld": 0.2, "top1": 0.7, "size_bytes": 30 * 2**20},
    ]}
    rows = check_gates([Gate(max_delta_ppl=1.0, min_top1=0.9), Gate(variants=["a"], max_size_mb=40)], summary)
    failed = {(r["variant"], r["check"]): r for r in rows if not r["passed"]}
    assert set(failed) == {("b", "max_delta_ppl"), ("b", "min_top1"), ("a", "max_size_mb")}
    assert failed[("b", "max_delta_ppl")]["by"] == pytest.approx(0.5)
    assert failed[("a", "max_size_mb")]["by"] == pytest.approx(10)


def test_unmeasured_metric_fails_its_gate():
    rows = check_gates([Gate(max_kld=0.1)], {"variants": [{"variant": "x", "kld": None}]})
    assert rows == [{"gate": 0, "variant": "x", "check": "max_kld", "metric": "KLD", "value": None, "bound": 0.1,
                     "passed": False, "by": None}]


def test_failed_gate_exits_3_and_tightening_costs_no_rebuild(tmp_path, store_dir):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    data["evaluation"]["gates"] = [{"max_size_mb": 1.0}]
    recipe = write_recipe(tmp_path / "r.yaml", data)
    res = qbuild(recipe, "--store", store_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    data["evaluation"]["gates"] = [{"max_size_mb": 0.01}]
    write_recipe(recipe, data)
    res = qbuild(recipe, "--store", store_dir, "--json")
    assert res.returncode == 3
    summary = json.loads(res.stdout)
    assert summary["counts"]["built"] == 0 and summary["gates"]["passed"] is False
    check = summary["gates"]["checks"][0]
    assert check["variant"] == "a" and check["check"] == "max_size_mb" and check["by"] > 0
    text = qbuild(recipe, "--store", store_dir)
    assert text.returncode == 3 and "FAIL" in text.stdout and "max_size_mb" in text.stdout


def test_gate_on_unknown_variant_is_a_recipe_error(tmp_path):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    data["evaluation"]["gates"] = [{"variants": ["nope"], "max_size_mb": 1}]
    res = qbuild("validate", write_recipe(tmp_path / "r.yaml", data))
    assert res.returncode == 2 and "unknown variant" in res.stderr


def test_gguf_throughput_at_batch_above_one_is_refused_at_plan_time(tmp_path):
    data = fake_recipe(tmp_path, [{"name": "q", "method": "gguf", "type": "Q8_0"}])
    data["evaluation"] = {"perplexity": None, "throughput": {"batch_sizes": [1, 4]}}
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data), "--store", tmp_path / "s")
    assert res.returncode == 2
    assert "evaluation.throughput.batch_sizes" in res.stderr and "batch size 1 only" in res.stderr
