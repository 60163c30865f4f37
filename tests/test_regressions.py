"""Regressions against earlier runs: gates that compare with the previous successful run of the recipe,
`qbuild diff` between two recorded runs, and the report's history view. The fake method reports the PPL and
decode speed the recipe asks for, so each run's numbers are chosen by the test."""

from __future__ import annotations

import json

import pytest

from qbuild.errors import RecipeError
from qbuild.planning.recipe import load_recipe

from helpers import fake_recipe, qbuild, run_api, write_recipe

GATES = [{"max_regression_ppl_pct": 1.0, "max_regression_decode_pct": 5.0}]


def _recipe(tmp_path, a_ppl, a_speed, b_ppl=20.0, b_speed=50.0, gates=GATES, name="r.yaml"):
    data = fake_recipe(tmp_path, [
        {"name": "a", "method": "fake", "ppl": a_ppl, "decode_tok_s": a_speed},
        {"name": "b", "method": "fake", "level": 2, "ppl": b_ppl, "decode_tok_s": b_speed}])
    # PPL and speed are what the fake steps report: no runtime reads format "fake", so nothing else is evaluated
    data["evaluation"] = {"baseline": False, "throughput": {}, "gates": gates}
    return write_recipe(tmp_path / name, data)


def _checks(summary: dict, check: str) -> dict[str, dict]:
    return {c["variant"]: c for c in summary["gates"]["checks"] if c["check"] == check}


def test_regression_gates_compare_with_the_previous_successful_run(tmp_path, store_dir):
    rc, first = run_api(_recipe(tmp_path, 10.0, 100.0), store_dir)
    assert rc == 0, first["gates"]          # the first night: nothing to regress from
    assert first["gates"]["compared_with"] is None
    assert all("no previous successful run" in c["note"] for c in first["gates"]["checks"])

    # a: PPL +0.5 % and 4 % slower: within bounds; b unchanged
    rc, second = run_api(_recipe(tmp_path, 10.05, 96.0), store_dir)
    assert rc == 0, second["gates"]
    assert second["gates"]["compared_with"] == first["run_id"]
    ppl, speed = _checks(second, "max_regression_ppl_pct"), _checks(second, "max_regression_decode_pct")
    assert ppl["a"]["value"] == pytest.approx(0.5) and speed["a"]["value"] == pytest.approx(4.0)
    assert ppl["b"]["value"] == pytest.approx(0.0) and ppl["a"]["previous"] == 10.0

    # a: PPL +2 % against the second run (not the first): fails, exit 3
    rc, third = run_api(_recipe(tmp_path, 10.05 * 1.02, 96.0), store_dir)
    assert rc == 3
    assert third["gates"]["compared_with"] == second["run_id"]
    bad = _checks(third, "max_regression_ppl_pct")["a"]
    assert not bad["passed"] and bad["value"] == pytest.approx(2.0) and bad["by"] == pytest.approx(1.0)

    # the failed run is no baseline: the next one still compares with the second; b 10 % slower fails
    rc, fourth = run_api(_recipe(tmp_path, 10.05, 96.0, b_speed=45.0), store_dir)
    assert rc == 3 and fourth["gates"]["compared_with"] == second["run_id"]
    slow = _checks(fourth, "max_regression_decode_pct")
    assert slow["a"]["passed"] and not slow["b"]["passed"] and slow["b"]["value"] == pytest.approx(10.0)


def test_regression_gates_on_the_command_line_and_in_junit(tmp_path, store_dir):
    assert qbuild("run", _recipe(tmp_path, 10.0, 100.0), "--store", store_dir).returncode == 0
    xml = tmp_path / "gates.xml"
    res = qbuild("run", _recipe(tmp_path, 11.0, 100.0), "--store", store_dir, "--junit-xml", xml)
    assert res.returncode == 3, res.stderr
    assert "max_regression_ppl_pct" in res.stdout and "FAIL" in res.stdout
    text = xml.read_text()
    assert 'name="gates[a]"' in text and "max_regression_ppl_pct: 10 vs bound 1: FAIL" in text


@pytest.mark.parametrize("gate, needs", [({"max_regression_ppl_pct": 1}, "evaluation.perplexity"),
                                         ({"max_regression_decode_pct": 5}, "evaluation.throughput")])
def test_regression_gate_without_its_measurement_is_one_line(tmp_path, gate, needs):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    data["evaluation"] = {"baseline": False, "perplexity": None, "gates": [gate]}
    path = write_recipe(tmp_path / "bad.yaml", data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert needs in str(info.value) and "bad.yaml" in str(info.value)
    res = qbuild("validate", path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert needs in res.stderr and "Traceback" not in res.stderr


def test_negative_regression_bound_is_refused(tmp_path):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    data["evaluation"] = {"baseline": False, "throughput": {}, "gates": [{"max_regression_decode_pct": -1}]}
    res = qbuild("validate", write_recipe(tmp_path / "neg.yaml", data))
    assert res.returncode == 2 and "max_regression_decode_pct" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr




# --- qbuild diff ----------------------------------------------------------------------------------------------
def test_diff_of_two_recorded_runs(tmp_path, store_dir):
    rc, first = run_api(_recipe(tmp_path, 10.0, 100.0, gates=[]), store_dir)
    assert rc == 0
    rc, second = run_api(_recipe(tmp_path, 10.4, 90.0, gates=[]), store_dir)   # a's params changed, b reused
    assert rc == 0
    res = qbuild("diff", first["run_id"], second["run_id"], "--store", store_dir, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert (data["a"], data["b"], data["recipe"]) == (first["run_id"], second["run_id"], "t")
    rows = {r["variant"]: r for r in data["variants"]}
    assert rows["a"]["delta_ppl"] == pytest.approx(0.4) and rows["a"]["delta_ppl_pct"] == pytest.approx(4.0)
    assert rows["a"]["delta_decode_tok_s"] == pytest.approx(-10.0) and rows["a"]["delta_decode_pct"] == pytest.approx(-10)
    assert rows["a"]["b"]["size_bytes"] > 0 and rows["a"]["delta_size_bytes"] == 0 and not rows["a"]["same_artifact"]
    assert rows["b"]["same_artifact"] and rows["b"]["delta_ppl"] == 0
    rebuilt = {s["step"]: s for s in data["rebuilt"]}
    assert list(rebuilt) == ["quantize[a]"]
    (reason,) = rebuilt["quantize[a]"]["reasons"]
    assert reason["kind"] == "recipe parameter" and "ppl 10.0 → 10.4" in reason["detail"]
    # the run record keeps the planner's reason too (relative to the last build of the step)
    why = {s["name"]: s["why"] for s in second["steps"]}
    assert why["quantize[a]"][0]["kind"] == "recipe parameter" and why["quantize[b]"] == []

    # the source model's files change: every step is rebuilt, and the diff says why
    recipe = _recipe(tmp_path, 10.4, 90.0, gates=[])
    (tmp_path / "fake-model" / "model.safetensors").write_bytes(b"\1" * 64)
    rc, third = run_api(recipe, store_dir)
    assert rc == 0
    res = qbuild("diff", "--last", "t", "--store", store_dir)
    assert res.returncode == 0, res.stderr
    assert "source model digest" in res.stdout and "quantize[b]" in res.stdout
    data = json.loads(qbuild("diff", "--last", tmp_path / "r.yaml", "--store", store_dir, "--json").stdout)
    assert (data["a"], data["b"]) == (second["run_id"], third["run_id"])
    kinds = {s["step"]: {r["kind"] for r in s["reasons"]} for s in data["rebuilt"]}
    assert kinds == {"model": {"source model digest"}, "quantize[a]": {"source model digest"},
                     "quantize[b]": {"source model digest"}}


def test_diff_errors_are_one_line(tmp_path, store_dir):
    res = qbuild("diff", "--last", "nope", "--store", store_dir)
    assert res.returncode == 2 and "has 0 run(s)" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = qbuild("diff", "only-one", "--store", store_dir)
    assert res.returncode == 2 and "two run ids" in res.stderr


# --- the report's history view --------------------------------------------------------------------------------
def test_report_history_has_one_series_per_variant_with_its_points(tmp_path, store_dir):
    import xml.etree.ElementTree as ET

    values = [(10.0, 100.0, 20.0), (10.2, 97.0, 20.0), (9.9, 105.0, 21.5)]
    ids = []
    for a_ppl, a_speed, b_ppl in values:
        rc, summary = run_api(_recipe(tmp_path, a_ppl, a_speed, b_ppl=b_ppl, gates=[]), store_dir)
        assert rc == 0
        ids.append(summary["run_id"])
    out = tmp_path / "report.html"
    res = qbuild("report", "t", "--store", store_dir, "--out", out)
    assert res.returncode == 0, res.stderr
    page = out.read_text()
    start = page.index('<section id="history">')
    section = ET.fromstring(page[start:page.index("</section>", start) + len("</section>")])
    svg = "{http://www.w3.org/2000/svg}"
    plots = {p.get("data-metric"): p for p in section.iter(f"{svg}svg")}
    assert set(plots) == {"ppl", "decode_tok_s", "size_bytes"}   # KLD was never measured: no plot
    for metric, column in (("ppl", 0), ("decode_tok_s", 1)):
        series = {g.get("data-variant"): g for g in plots[metric].iter(f"{svg}g") if g.get("class") == "series"}
        assert sorted(series) == ["a", "b"]
        points = [(c.get("data-run"), float(c.get("data-value"))) for c in series["a"].iter(f"{svg}circle")]
        assert points == [(rid, v[column]) for rid, v in zip(ids, values, strict=True)]
        assert len(series["a"].findall(f"{svg}polyline")) == 1
    b_ppl = [float(c.get("data-value")) for g in plots["ppl"].iter(f"{svg}g") if g.get("data-variant") == "b"
             for c in g.iter(f"{svg}circle")]
    assert b_ppl == [20.0, 20.0, 21.5]
    # the report of an earlier run shows the history up to that run only
    res = qbuild("report", ids[1], "--store", store_dir, "--out", out)
    assert res.returncode == 0 and "History: 2 runs" in out.read_text() and ids[2] not in out.read_text()
