"""Calibration/evaluation text overlap: 13-gram decontamination at plan time, recorded in both data manifests."""

from __future__ import annotations

import json
import time

from qbuild.calibration.overlap import ngram_overlap, words

from helpers import fake_recipe, qbuild, run_api, write_recipe

SENTENCES = [f"sentence number {i} says that the quick brown fox number {i} jumps over the lazy dog {i} times "
             f"before breakfast on day {i}." for i in range(60)]


def test_ngram_overlap_counts_shared_13_grams():
    assert words("Hello, World_2!") == ["hello", "world", "2"]   # lowercase, punctuation and _ split words
    cal, ev = SENTENCES[:40], SENTENCES[40:]
    assert ngram_overlap(cal, ev)["overlap_pct"] == 0.0          # shorter shared phrases do not count
    same = ngram_overlap(cal, cal)
    assert same["overlap_pct"] == 100.0 and same["documents_flagged"] == 40
    half = ngram_overlap(cal, SENTENCES[20:60])
    assert half["documents_flagged"] == 20 and 45 < half["overlap_pct"] < 55
    # a 13-gram spanning a document boundary is not shared text: each document is its own word list
    assert ngram_overlap(["a b c d e f g"], ["h i j k l m n"])["evaluation_ngrams"] == 0


TWELVE = [f"line {i} of the calibration file has twelve words in it {i}" for i in range(400)]


def test_documents_shorter_than_the_ngram_are_compared_whole():
    """A document under 13 words has no 13-gram: it counted for nothing, and a copy of short documents read 0 %."""
    assert all(len(words(t)) == 12 for t in TWELVE)
    copied = ngram_overlap(TWELVE, TWELVE[:200])
    assert copied["overlap_pct"] == 100.0 and copied["documents_flagged"] == 200
    assert (copied["short_documents"], copied["short_documents_shared"], copied["evaluation_ngrams"]) == (200, 200, 0)
    fresh = [t.replace("calibration", "evaluation") for t in TWELVE[:200]]
    assert ngram_overlap(TWELVE, fresh)["overlap_pct"] == 0.0
    # half copied, half new: the short documents weigh one unit each beside the long ones' 13-grams
    half = ngram_overlap(TWELVE, TWELVE[:100] + fresh[100:])
    assert half["overlap_pct"] == 50.0 and half["documents_flagged"] == 100
    # 8 to 12 words: found anywhere in the calibration text (a sentence quoted from a longer document)
    quoted = " ".join(words(SENTENCES[3])[2:12])
    assert ngram_overlap(SENTENCES, [quoted])["overlap_pct"] == 100.0
    # under 8 words: only a whole calibration document counts; a common short phrase inside one does not
    assert ngram_overlap(SENTENCES, ["the quick brown fox"])["overlap_pct"] == 0.0
    assert ngram_overlap(SENTENCES + ["Return repr(self)."], ["return REPR self"])["overlap_pct"] == 100.0
    # a mix: 13-grams of long documents and whole short ones, both counted
    mix = ngram_overlap(SENTENCES[:40] + TWELVE, SENTENCES[30:50] + TWELVE[:10])
    assert mix["shared_ngrams"] == mix["evaluation_ngrams"] // 2 and mix["short_documents_shared"] == 10


def test_a_copy_of_short_calibration_lines_fails_the_plan(tmp_path):
    """The reviewer's case: 200 evaluation lines copied from 400 twelve-word calibration lines read "overlap 0.00 %"
    and exit 0."""
    cal = tmp_path / "calib.txt"
    cal.write_text("\n\n".join(TWELVE))
    copy = tmp_path / "heldout.txt"
    copy.write_text("\n\n".join(TWELVE[:200]))
    res = qbuild("plan", _recipe(tmp_path, cal, copy), "--store", tmp_path / "s")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "overlap 100.0 % (0 of 0 evaluation 13-grams, 200 of 200 documents under 13 words compared whole, " \
           "200 of 200 documents), above evaluation.overlap.max_pct 5 %" in res.stderr


def _recipe(tmp_path, cal_file, eval_file, **evaluation):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake", "calibrated": True}])
    data["calibration"] = {"sources": [{"type": "file", "path": str(cal_file)}], "samples": 2, "seq_len": 16}
    data["evaluation"] = {"baseline": False, "perplexity": {"dataset": {"sources": [{"type": "file",
                                                                                     "path": str(eval_file)}]}},
                          **evaluation}
    return write_recipe(tmp_path / "r.yaml", data)


def test_same_text_for_calibration_and_evaluation_fails_the_plan_in_one_line(tmp_path):
    cal = tmp_path / "calib.txt"
    cal.write_text("\n\n".join(SENTENCES[:40]))
    copy = tmp_path / "heldout.txt"
    copy.write_text("\n\n".join(SENTENCES[:40]))   # another file, the same text: identities differ, text does not
    res = qbuild("plan", _recipe(tmp_path, cal, copy), "--store", tmp_path / "s")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1, res.stderr
    assert "file:calib.txt" in res.stderr and "file:heldout.txt" in res.stderr and "overlap 100.0 %" in res.stderr
    assert "evaluation.perplexity.dataset" in res.stderr and "max_pct 5 %" in res.stderr
    # the threshold is the recipe's
    res = qbuild("plan", _recipe(tmp_path, cal, copy, overlap={"max_pct": 100}), "--store", tmp_path / "s", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["overlap"]["overlap_pct"] == 100.0


def test_overlap_is_cached_and_recorded_when_it_passes(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("QBUILD_CACHE", str(tmp_path / "cache"))
    cal = tmp_path / "calib.txt"
    cal.write_text("\n\n".join(SENTENCES[:40]))
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("\n\n".join(SENTENCES[35:60] * 8))   # 5 of 25 documents are calibration text
    recipe = _recipe(tmp_path, cal, heldout, overlap={"max_pct": 30})
    res = qbuild("plan", recipe, "--store", tmp_path / "s", "--json")
    assert res.returncode == 0, res.stderr
    overlap = json.loads(res.stdout)["overlap"]
    assert overlap["documents_flagged"] == 5 * 8 and abs(overlap["overlap_pct"] - 20) < 1
    assert len(list((tmp_path / "cache" / "overlap").glob("*.json"))) == 1   # cached by both texts' identities
    heldout.write_text("\n\n".join(SENTENCES[40:60]))   # new content: a new identity, measured again
    res = qbuild("plan", recipe, "--store", tmp_path / "s", "--json")
    assert json.loads(res.stdout)["overlap"]["overlap_pct"] == 0.0
    assert len(list((tmp_path / "cache" / "overlap").glob("*.json"))) == 2

    # built: both data steps' manifests record the measure (the real tokenizer of a real model tokenizes)
    import yaml

    data = yaml.safe_load(recipe.read_text())
    data["model"] = {"source": "local", "path": str(tiny_model_dir)}
    data["variants"] = [{"name": "a", "method": "fake", "calibrated": True}]
    data["evaluation"]["perplexity"] |= {"context_length": 16, "max_windows": 2}
    data["evaluation"]["baseline"] = True
    data["store"] = {"path": str(tmp_path / "s")}
    rc, summary = run_api(write_recipe(tmp_path / "r2.yaml", data))
    assert rc == 0, summary["steps"]
    assert summary["overlap"]["overlap_pct"] == 0.0
    from qbuild.artifacts.store import Store

    st = Store(tmp_path / "s")
    steps = {s["name"]: s for s in summary["steps"]}
    for name in ("calibrate", "eval-data"):
        manifest = st.manifest(steps[name]["digest"])
        assert manifest["info"]["overlap"]["overlap_pct"] == 0.0
        assert manifest["info"]["overlap"]["evaluation"] == "file:heldout.txt"


def test_a_cached_overlap_costs_no_text_reading(tmp_path):
    """The demo's texts (pydocs train/test): measured once, then a re-plan reads one JSON file."""
    from qbuild.planning.calibration import check_overlap
    from qbuild.planning.recipe import parse_recipe

    r = parse_recipe({"name": "d", "model": {"source": "local", "path": "x"}, "variants": [{"name": "a", "method": "fake"}],
                      "calibration": {"sources": [{"type": "pydocs", "split": "train"}]}})
    first = check_overlap(r, tmp_path)
    t0 = time.perf_counter()
    again = check_overlap(r, tmp_path)
    assert time.perf_counter() - t0 < 0.05
    assert again == first and 0 < first["overlap_pct"] < 5   # docstrings copied between stdlib modules: a few %
    assert first["calibration"] == "pydocs:train" and first["evaluation"] == "pydocs:test"
