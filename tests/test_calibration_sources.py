"""Calibration and evaluation data: every source kind, mixes, chat templates, seeds; model sources."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qbuild.calibration.build import load_calibration, split_counts
from qbuild.calibration.build import run as run_calibration
from qbuild.calibration.corpus import pydocs_documents
from qbuild.contract.step import StepContext
from qbuild.pipeline.plan import PlanContext
from qbuild.planning.calibration import calibration_step
from qbuild.planning.recipe import parse_recipe

from helpers import fake_recipe, qbuild, write_recipe

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).strip()


def test_pydocs_corpus_is_english_and_splits_are_disjoint():
    train, test = pydocs_documents("train"), pydocs_documents("test")
    assert len(train) > 500 and len(test) > 100
    assert not set(train) & set(test) or len(set(train) & set(test)) < 0.01 * len(test)  # shared boilerplate only
    assert sum(len(d) for d in test) > 200_000
    assert pydocs_documents("test") == test  # deterministic


def test_the_stdlib_docstrings_are_parsed_once_and_a_damaged_cache_is_parsed_again(tmp_path, monkeypatch):
    """The corpus is kept in qbuild's per-user cache (a root of its own, marked): a second read is the same documents
    without parsing the stdlib; a damaged or edited file is parsed again; a cache folder not qbuild's is never
    written, and the documents are still right."""
    from qbuild.calibration import corpus

    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))
    first = pydocs_documents("test")
    [kept] = (tmp_path / "cache" / "corpus").glob("pydocs-*.json")
    parsed = []
    monkeypatch.setattr(corpus, "_extract", lambda split: parsed.append(split) or ["re-parsed " * 30])
    assert pydocs_documents("test") == first and parsed == []
    record = json.loads(kept.read_text())
    record["documents"][0] = "an edited docstring"
    kept.write_text(json.dumps(record))
    assert pydocs_documents("test") == ["re-parsed " * 30] and parsed == ["test"]
    foreign = tmp_path / "foreign"
    (foreign / "corpus").mkdir(parents=True)
    (foreign / "corpus" / "notes.txt").write_text("someone else's")
    monkeypatch.setenv("QBUILD_CACHE", str(foreign))
    assert pydocs_documents("train") == ["re-parsed " * 30]
    assert sorted(p.name for p in (foreign / "corpus").iterdir()) == ["notes.txt"]


def test_split_counts_follow_weights_exactly():
    assert split_counts(10, [1, 1]) == [5, 5]
    assert split_counts(10, [3, 1]) == [8, 2] or split_counts(10, [3, 1]) == [7, 3]
    assert sum(split_counts(7, [1, 1, 1])) == 7


def _files(tmp: Path) -> dict[str, Path]:
    (tmp / "a.txt").write_text(f"{TEXT}\n\n{TEXT.upper()}\n")
    with open(tmp / "b.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"text": f"record {i}: {TEXT}"}) + "\n")
    with open(tmp / "chat.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}? {TEXT}"},
                                             {"role": "assistant", "content": f"answer {i}. {TEXT}"}]}) + "\n")
    pq.write_table(pa.table({"content": [f"parquet row {i}: {TEXT}" for i in range(4)]}), tmp / "c.parquet")
    return {"txt": tmp / "a.txt", "jsonl": tmp / "b.jsonl", "chat": tmp / "chat.jsonl", "parquet": tmp / "c.parquet"}


def _calibrate(tmp: Path, model: Path, calibration: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    recipe = parse_recipe({"name": "c", "model": {"source": "local", "path": str(model)}, "calibration": calibration,
                           "variants": [{"name": "x", "method": "fake", "calibrated": True}]})
    ctx = PlanContext(recipe, tmp)
    step = calibration_step(recipe.calibration, ctx.model(), ctx)
    out = tmp / f"out-{step.key[:8]}"
    out.mkdir(exist_ok=True)
    run_calibration(StepContext(step.params, {"tokenizer": model}, {}, out, 1, "cpu", "calibrate",
                                runtime_args=step.runtime_args))
    ids, mask = load_calibration(out)
    return ids, mask, json.loads((out / "calibration.json").read_text())


def test_every_local_format_and_hf_datasets_mix(tmp_path, smollm2_dir):
    f = _files(tmp_path)
    cal = {"samples": 10, "seq_len": 32, "seed": 3, "sources": [
        {"type": "file", "path": str(f["txt"])},
        {"type": "file", "path": str(f["jsonl"]), "weight": 2},
        {"type": "file", "path": str(f["parquet"]), "column": "content"},
        {"type": "hf", "name": "json", "data_files": str(f["jsonl"]), "split": "train"},
        {"type": "pydocs"},
    ]}
    ids, mask, info = _calibrate(tmp_path, smollm2_dir, cal)
    assert ids.shape == (10, 32) and ids.dtype == np.int32 and mask.all()
    assert [s["samples"] for s in info["per_source"]] == [2, 3, 2, 2, 1]
    assert len(info["sample_ids"]) == 10 and info["tokens"] == 320
    assert info["sources"][1]["sha256"] and info["sources"][4]["python"]
    again, _, _ = _calibrate(tmp_path, smollm2_dir, cal)
    assert (again == ids).all()  # same seed, same samples
    cal["seed"] = 4
    other, _, _ = _calibrate(tmp_path, smollm2_dir, cal)
    assert not (other == ids).all()


def test_chat_template_and_document_sampling(tmp_path, smollm2_dir):
    f = _files(tmp_path)
    ids, mask, info = _calibrate(tmp_path, smollm2_dir, {
        "samples": 3, "seq_len": 2048, "sampling": "document", "sources": [{"type": "file", "path": str(f["chat"])}]})
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(smollm2_dir)).decode(ids[0][mask[0] == 1])
    assert "<|im_start|>user" in text and "<|im_start|>assistant" in text  # rendered by the chat template
    assert (mask.sum(axis=1) < 2048).all()  # short documents are padded, and the mask says so


def test_missing_column_is_a_clear_step_error(tmp_path, smollm2_dir):
    f = _files(tmp_path)
    with pytest.raises(ValueError, match="no column 'body'"):
        _calibrate(tmp_path, smollm2_dir, {"samples": 2, "seq_len": 16,
                                           "sources": [{"type": "file", "path": str(f["jsonl"]), "column": "body"}]})


def test_overlapping_calibration_and_evaluation_text_is_refused(tmp_path):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake", "calibrated": True}])
    data["calibration"] = {"sources": [{"type": "pydocs", "split": "train"}]}
    data["evaluation"] = {"baseline": False, "perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "train"}]}}}
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data), "--store", tmp_path / "s")
    assert res.returncode == 2
    assert "calibration text (pydocs:train) and evaluation text (pydocs:train) overlap 100.0 %" in res.stderr
    # with the check off, the source-level warning still says it
    data["evaluation"]["overlap"] = None
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data), "--store", tmp_path / "s")
    assert res.returncode == 0
    assert "warning: evaluation.perplexity.dataset.sources[0] is also a calibration source" in res.stderr
    data["evaluation"]["perplexity"]["dataset"]["sources"][0]["split"] = "test"
    del data["evaluation"]["overlap"]
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data), "--store", tmp_path / "s")
    assert res.returncode == 0 and "warning" not in res.stderr
    assert "calibration/evaluation overlap: 2.9" in res.stdout   # what the held-out split really shares


def _fake_hub_cache(root: Path, repo: str, sha: str) -> None:
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(sha)
    snap = base / "snapshots" / sha
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))


def test_hub_model_resolves_through_local_cache_and_pins_commit(tmp_path):
    cache = tmp_path / "hub"
    sha = "0123456789abcdef0123456789abcdef01234567"
    _fake_hub_cache(cache, "org/tiny", sha)
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "h", "model": {"source": "hub", "repo": "org/tiny", "revision": "main"},
        "variants": [{"name": "q", "method": "gguf", "type": "Q8_0"}], "evaluation": {"perplexity": None}})
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    res = qbuild("plan", recipe, "--store", tmp_path / "s", "--json", env=env)
    assert res.returncode == 0, res.stderr
    model = json.loads(res.stdout)["steps"][0]
    assert model["status"] == "source"
    missing = qbuild("plan", recipe, "--store", tmp_path / "s", env={"HF_HUB_CACHE": str(tmp_path / "empty"),
                                                                      "HF_HUB_OFFLINE": "1"})
    assert missing.returncode == 2
    assert "r.yaml:4: model.repo" in missing.stderr and "not in the local Hugging Face cache" in missing.stderr
    assert "Traceback" not in missing.stderr
