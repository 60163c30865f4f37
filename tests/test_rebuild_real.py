"""`qbuild verify --rebuild` against the real libraries: every kind of step the demo and the GGUF methods run
(conversion, quantization, calibration, importance matrix, evaluation data, reference log-probs, perplexity + KLD,
load check, lm-eval task) is re-executed in scratch and gives the same bytes on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import qbuild, write_recipe

TASKS = Path(__file__).parent / "tasks" / "pystdlib_mc"


@pytest.mark.slow
def test_every_step_rebuilds_bit_identical(tmp_path, tiny_model_dir):
    pytest.importorskip("lm_eval")
    data = {"name": "repro", "model": {"source": "local", "path": str(tiny_model_dir)},
            "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"},
                         {"name": "q4im", "method": "gguf", "type": "Q4_K_M", "imatrix": True}],
            "evaluation": {"baseline": True, "perplexity": {"context_length": 64, "max_windows": 4}, "kld": True,
                           "load_check": True, "tasks": [{"task": "pystdlib_mc", "include_path": str(TASKS),
                                                          "limit": 10}]},
            "store": {"path": str(tmp_path / "store")}}
    recipe = write_recipe(tmp_path / "r.yaml", data)
    assert qbuild("run", recipe).returncode == 0
    res = qbuild("verify", "--rebuild", recipe, "--json")
    out = json.loads(res.stdout)
    rows = {r["step"]: r for r in out["steps"]}
    assert res.returncode == 0, {k: (r["status"], r.get("files_differ")) for k, r in rows.items()}
    assert {r["status"] for r in rows.values()} == {"identical"}
    kinds = {r["kind"] for r in rows.values()}
    assert kinds >= {"gguf-convert", "quantize", "calibrate", "imatrix", "eval-data", "reference", "perplexity",
                     "load-check", "task"}
