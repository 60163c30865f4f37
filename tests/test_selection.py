"""`selection:` judged on summary rows: each bound where it applies, the objective among those meeting every bound,
and for every other candidate the bound it missed and by how much (the numbers of a serving sweep, as
`qbuild run --json` records them). The selected artifact's model card carries its exact server command."""

from __future__ import annotations

import json

import pytest

from qbuild import api
from qbuild.artifacts.store import Store
from qbuild.planning.recipe import Selection, Serving
from qbuild.results import selection
from qbuild.results.selection import select

from helpers import fake_recipe, qbuild, write_recipe

SERVING = Serving(concurrency=[1, 4])


def point(config, c, tok_s, ttft99, tpot50, errors=0, rss=200.0):
    return {"config": config, "concurrency": c, "output_tok_s": tok_s, "ttft_ms_p99": ttft99, "ttft_ms_p50": ttft99 / 2,
            "tpot_ms_p50": tpot50, "itl_ms_p99": tpot50 * 1.5, "requests_s": tok_s / 32, "errors": errors,
            "requests": 16, "peak_rss_mb": rss,
            "command": f"llama-server --model {config}.gguf"}


def row(variant, size_mb, kld, points):
    return {"variant": variant, "status": "built", "size_bytes": int(size_mb * 2**20), "kld": kld,
            "delta_ppl_pct": None if kld is None else kld * 100, "serving": points, "digest": "d" + variant, "key": "k" + variant}


ROWS = [
    row("baseline", 540, None, []),
    row("q8_0", 144, 0.004, [point("default", 1, 40, 90, 24), point("default", 4, 110, 300, 35),
                             point("kv8", 1, 38, 95, 25), point("kv8", 4, 100, 340, 38)]),
    row("q4km", 105, 0.058, [point("default", 1, 55, 70, 18), point("default", 4, 150, 240, 26),
                             point("kv8", 1, 52, 72, 19), point("kv8", 4, 140, 600, 28)]),
]


def test_max_throughput_picks_the_fastest_that_meets_every_bound():
    out = select(Selection(ttft_p99_ms=500, max_kld=0.1), ROWS, SERVING)
    assert out["selected"]["variant"] == "q4km" and out["selected"]["config"] == "default"
    assert out["selected"]["command"] == "llama-server --model default.gguf" and out["concurrency"] == 4
    why = {(r["variant"], r["config"]): r["why"] for r in out["rejected"]}
    assert set(why) == {("q8_0", "default"), ("q8_0", "kv8"), ("q4km", "kv8")}   # the baseline only when asked
    assert why[("q4km", "kv8")] == "ttft_p99_ms 600 ms at concurrency 4 > 500 (+100 ms, 20 %)"
    assert why[("q8_0", "default")].startswith("meets every bound; objective max_throughput prefers q4km@default "
                                               "(150 tok/s vs 110 tok/s)")


def test_quality_bound_and_other_objectives():
    strict = select(Selection(ttft_p99_ms=500, max_kld=0.01), ROWS, SERVING)
    assert strict["selected"]["variant"] == "q8_0" and strict["selected"]["config"] == "default"
    assert any(r["variant"] == "q4km" and "kld 0.058 under config default > 0.01 (+0.048, 480 %)" in r["why"]
               for r in strict["rejected"])
    assert select(Selection(objective="min_size"), ROWS, SERVING)["selected"]["variant"] == "q4km"
    assert select(Selection(objective="min_kld"), ROWS, SERVING)["selected"]["variant"] == "q8_0"


def test_quality_bounds_and_min_kld_judge_each_config_by_its_own_quality():
    """A config whose points carry their own quality (a quantized KV cache's pass, as the summary puts it there) is
    judged by it; the others by the artifact's own numbers."""
    def kv(points, kld, delta):
        return [dict(p, kld=kld, delta_ppl_pct=delta) if p["config"] == "kv8" else p for p in points]

    rows = [row("q8_0", 144, 0.004, kv(ROWS[1]["serving"], 0.02, 3.0)),
            row("q4km", 105, 0.058, kv(ROWS[2]["serving"], 0.09, 9.0))]
    out = select(Selection(max_kld=0.01, objective="min_size"), rows, SERVING)
    assert (out["selected"]["variant"], out["selected"]["config"]) == ("q8_0", "default")
    why = {(r["variant"], r["config"]): r["why"] for r in out["rejected"]}
    assert why[("q8_0", "kv8")] == "kld 0.02 under config kv8 > 0.01 (+0.01, 100 %)"
    assert why[("q4km", "kv8")] == "kld 0.09 under config kv8 > 0.01 (+0.08, 800 %)"
    assert "under config default" in why[("q4km", "default")]
    ppl = select(Selection(max_delta_ppl_pct=5, objective="min_size"), rows, SERVING)
    assert ppl["selected"]["variant"] == "q8_0"   # both its configs within 5 %; the smallest size is a tie
    assert {(r["variant"], r["config"]) for r in ppl["rejected"] if "delta_ppl_pct" in r["why"]} == {
        ("q4km", "default"), ("q4km", "kv8")}
    best = select(Selection(objective="min_kld"), rows, SERVING)
    assert (best["selected"]["variant"], best["selected"]["config"], best["selected"]["kld"]) == ("q8_0", "default",
                                                                                                 0.004)
    unmeasured = [row("q8_0", 144, 0.004, kv(ROWS[1]["serving"], None, None))]
    why = {r["config"]: r["why"] for r in select(Selection(max_kld=0.01), unmeasured, SERVING)["rejected"]}
    assert why == {"kv8": "kld under config kv8: not measured"}


def test_slo_at_its_own_concurrency_and_throughput_floor():
    out = select(Selection(ttft_p99_ms={"value": 80, "concurrency": 1}, min_output_tok_s={"value": 120,
                                                                                           "concurrency": 4}),
                 ROWS, SERVING)
    assert (out["selected"]["variant"], out["selected"]["config"]) == ("q4km", "default")
    why = {(r["variant"], r["config"]): r["why"] for r in out["rejected"]}
    assert "ttft_p99_ms 90 ms at concurrency 1 > 80" in why[("q8_0", "default")]
    assert "output_tok_s 110 tok/s at concurrency 4 < 120 (-10 tok/s, 8 %)" in why[("q8_0", "default")]


def test_nothing_meets_the_bounds_and_every_miss_is_named():
    out = select(Selection(ttft_p99_ms=1, max_size_mb=50, max_memory_mb=100), ROWS, SERVING)
    assert out["selected"] is None and not out["passed"] and len(out["rejected"]) == 4
    for r in out["rejected"]:
        assert len(r["misses"]) == 3 and "ttft_p99_ms" in r["why"] and "size" in r["why"] and "memory" in r["why"]


def test_failed_requests_and_unmeasured_points_are_misses():
    rows = [row("q4km", 105, 0.05, [point("default", 4, 150, 240, 26, errors=3)]),
            row("q8_0", 144, 0.004, [{"config": "default", "status": "failed", "error": "server died"}])]
    out = select(Selection(ttft_p99_ms=500), rows, SERVING)
    assert out["selected"] is None
    why = {r["variant"]: r["why"] for r in out["rejected"]}
    assert "3 of 16 requests failed at concurrency 4" in why["q4km"]
    assert "not built" not in why["q8_0"] and "ttft_p99_ms: not measured at concurrency 4" in why["q8_0"]


def test_selected_model_card_carries_the_server_command():
    from qbuild.artifacts.modelcard import render_model_card

    chosen = {"config": "default", "command": "llama-server --model model.gguf --port 8080 --parallel 4",
              "objective": "max_throughput", "bounds": {"ttft_p99_ms": {"value": 500, "concurrency": 4}}}
    serving = [dict(p, kld=0.0712) if p["config"] == "kv8" else p for p in ROWS[2]["serving"]]
    card = render_model_card({"format": "gguf", "files": [{"path": "model.gguf", "size": 10}]},
                             {**ROWS[2], "serving": serving, "selected": chosen})
    assert "## Selected for serving" in card and "    llama-server --model model.gguf --port 8080 --parallel 4" in card
    assert "ttft_p99_ms 500 at concurrency 4" in card and "## Serving under load" in card
    assert "| kv8 | 4 | 300.0 | 600.0 | 28.00 |" in card
    assert "| kv8 | 4 | 300.0 | 600.0 | 28.00 | 42.00 | 140.0 | 4.38 | 0 | 200.0 | 0.0712 |" in card   # its own KLD


def test_bounds_met_but_nothing_measured_for_the_objective_names_why():
    """Variants that were not served (left out by serving.variants, a server that needs a GPU, no server for the
    format) meet size/KLD bounds but have no output tok/s: nothing is selected, and each one says why (it crashed)."""
    serving = Serving(concurrency=[1, 4], variants=["q4km", "q8_0"])
    rows = [row("baseline", 540, None, []),
            row("q8_0", 144, 0.004, [{"config": "default", "status": "skipped", "error": "needs a GPU",
                                      "step": "serving[q8_0@default]"}]),
            row("q4km", 105, 0.058, []),
            row("extra", 100, 0.05, [])]
    out = select(Selection(max_size_mb=600, include_baseline=True), rows, serving)
    assert out["selected"] is None and not out["passed"]
    assert "4 candidate(s) meet every bound" in out["reason"] and "max_throughput" in out["reason"]
    why = {r["variant"]: r["why"] for r in out["rejected"]}
    assert why["q8_0"].endswith("its serving step serving[q8_0@default] was skipped (needs a GPU)")
    assert why["q4km"].endswith("no server loads its format (see the plan's warnings)")
    assert why["extra"].endswith("evaluation.serving.variants leaves it out")
    assert why["baseline"].endswith("evaluation.serving.variants leaves it out")
    assert all(w.startswith("meets every bound, but objective max_throughput cannot rank it") for w in why.values())
    # a measured candidate still wins over the unmeasured ones, which say they could not be ranked
    mixed = select(Selection(max_size_mb=200), [*rows, ROWS[2]], serving)
    assert mixed["selected"]["variant"] == "q4km" and mixed["selected"]["config"] == "default"
    assert "reason" not in mixed
    assert {r["variant"]: r["why"] for r in mixed["rejected"]}["q8_0"].startswith(
        "meets every bound, but objective max_throughput cannot rank it")
    # the other objectives rank the same rows without serving numbers
    assert select(Selection(max_size_mb=200, objective="min_size"), rows, serving)["selected"]["variant"] == "extra"


def test_a_run_whose_variants_were_not_served_exits_3_and_records_the_run(tmp_path):
    """`qbuild run` of a recipe with evaluation.serving and selection: whose variants no server loads: exit 3 with
    the reason (it crashed with a traceback, and wrote neither run record nor refs); `qbuild select` agrees."""
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake", "level": 1},
                                  {"name": "b", "method": "fake", "level": 2}], store={"path": str(tmp_path / "s")})
    data["evaluation"]["serving"] = {"concurrency": [1], "requests": 2}
    data["selection"] = {"max_size_mb": 100}
    recipe = write_recipe(tmp_path / "r.yaml", data)
    res = qbuild("run", recipe)
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr
    assert "nothing selected: 2 candidate(s) meet every bound, but none has what objective max_throughput" in res.stdout
    assert "a @ None: meets every bound, but objective max_throughput cannot rank it: not served" in res.stdout
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "s" / "runs").glob("*.json")]
    assert record["selection"]["selected"] is None and record["counts"]["built"] == 2
    assert (tmp_path / "s" / "refs" / "t" / "a" / "latest").exists()
    sel = qbuild("select", recipe, "--json")
    assert sel.returncode == 3 and "none has what objective max_throughput" in json.loads(sel.stdout)["reason"]
    assert json.loads(sel.stdout)["bounds"]["max_error_pct"] == 0   # applied without being asked for: stated


def test_a_crash_after_the_build_keeps_refs_and_a_run_record(tmp_path, monkeypatch):
    """Whatever fails after the steps ran (here: the selection), what was built keeps its refs and the run is
    recorded with its steps and the error; such a record is never the "last good run" gates compare with."""
    def broken(*args, **kwargs):
        raise RuntimeError("selection broke")

    monkeypatch.setattr(selection, "select", broken)
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}], store={"path": str(tmp_path / "s")},
                       selection={"objective": "min_size"})
    with pytest.raises(RuntimeError, match="selection broke"):
        api.run(write_recipe(tmp_path / "r.yaml", data))
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "s" / "runs").glob("*.json")]
    assert record["error"] == "RuntimeError: selection broke" and record["counts"]["built"] == 1
    steps = {s["name"]: s for s in record["steps"]}
    assert steps["quantize[a]"]["status"] == "built" and record["recipe"] == "t"
    assert Store(tmp_path / "s").get_ref("t", "a", "latest")["digest"] == steps["quantize[a]"]["digest"]
    assert Store(tmp_path / "s").last_good_run("t") is None


def test_failed_requests_reject_a_candidate_whatever_bounds_are_given():
    """Issue 46, item 12: with only max_size_mb and max_throughput, q4_0 (5 of 10 requests failed) was selected over
    q8_0 (none failed): errors were looked at only inside the latency SLOs. Now max_error_pct (default 0) applies at
    every serving point of a candidate's config, and the verdict names the worst point with its figure."""
    def failing(errors, requests=10, **where):
        return {**point("default", 4, 150, 240, 26, errors=errors), "requests": requests, **where}

    rows = [row("q4_0", 100, 0.05, [failing(5)]), row("q8_0", 144, 0.004, [point("default", 4, 110, 300, 35)])]
    out = select(Selection(max_size_mb=200), rows, SERVING)
    assert out["selected"]["variant"] == "q8_0" and out["selected"]["error_pct"] == 0
    assert out["bounds"]["max_error_pct"] == 0
    [rejected] = out["rejected"]
    assert rejected["why"] == "5 of 10 requests failed at concurrency 4 (50.0 % > max_error_pct 0 %)"
    assert rejected["error_pct"] == 50.0
    # a bound the recipe sets: 50 % is within 60 %, so throughput decides again
    lenient = select(Selection(max_size_mb=200, max_error_pct=60), rows, SERVING)
    assert lenient["selected"]["variant"] == "q4_0" and lenient["bounds"]["max_error_pct"] == 60
    # errors away from the selection's concurrency count too: the worst point is named
    elsewhere = [row("q4_0", 100, 0.05, [point("default", 4, 150, 240, 26), failing(1, request_rate=2.0,
                                                                                     concurrency=None),
                                         failing(3, concurrency=1)]), rows[1]]
    out = select(Selection(max_size_mb=200, max_error_pct=5), elsewhere, SERVING)
    assert out["selected"]["variant"] == "q8_0"
    assert out["rejected"][0]["why"] == "3 of 10 requests failed at concurrency 1 (30.0 % > max_error_pct 5 %)"


def test_max_error_pct_is_a_validated_selection_field(tmp_path):
    from qbuild.errors import RecipeError
    from qbuild.planning.recipe import parse_recipe

    assert Selection().max_error_pct == 0 and Selection(max_error_pct=2.5).max_error_pct == 2.5
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}], selection={"objective": "min_size",
                                                                               "max_error_pct": 101})
    with pytest.raises(RecipeError, match="selection.max_error_pct"):
        parse_recipe(data)


def test_candidates_on_two_engines_name_their_server_and_the_baseline_is_its_own_reference():
    """recipes/engines.yaml's case: GGUF variants on llama-server, the baseline and a compressed-tensors variant on
    vLLM. Each candidate names the server it was measured on; the baseline, served with an unquantized cache, has KLD
    0 against itself (not "not measured"), so max_kld judges it; a quantized-KV config of it has no such default."""
    def on(server, points):
        return [p | {"server": server, "kv_cache_dtype": None} for p in points]

    rows = [row("baseline", 540, None, on("vllm", [point("default", 4, 30, 2500, 140)])),
            row("w8a8", 160, 0.015, on("vllm", [point("default", 4, 15, 800, 245)])),
            row("q8_0", 144, 0.004, on("llama-server", [point("default", 4, 35, 1200, 93)]))]
    out = select(Selection(ttft_p99_ms=3000, tpot_p50_ms=150, max_kld=0.1, include_baseline=True), rows, SERVING)
    assert out["selected"]["variant"] == "q8_0" and out["selected"]["server"] == "llama-server"
    rejected = {r["variant"]: r for r in out["rejected"]}
    assert rejected["baseline"]["server"] == "vllm" and "kld" not in rejected["baseline"]["why"]
    assert rejected["baseline"]["why"].startswith("meets every bound; objective max_throughput prefers q8_0@default")
    assert rejected["w8a8"]["why"] == "tpot_p50_ms 245 ms at concurrency 4 > 150 (+95 ms, 63 %)"
    kv8 = [row("baseline", 540, None, [p | {"kv_cache_dtype": "q8_0"} for p in on("vllm", [point("kv8", 4, 30, 900, 90)])])]
    assert "kld under config kv8: not measured" in select(Selection(max_kld=0.1, include_baseline=True), kv8,
                                                          SERVING)["rejected"][0]["why"]
    from io import StringIO

    from rich.console import Console

    from qbuild.results.summary import render_selection

    text = StringIO()
    render_selection(out, Console(file=text, width=300))
    lines = text.getvalue().splitlines()
    assert lines[0] == "selected: q8_0 @ default (objective max_throughput)"
    assert lines[1] == "  serve it with: llama-server --model default.gguf"   # the command names the engine
    assert any(line.startswith("  w8a8 @ default on vllm: tpot_p50_ms 245 ms") for line in lines), lines
