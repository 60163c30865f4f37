"""`selection:` judged on summary rows: each bound where it applies, the objective among those meeting every bound,
and for every other candidate the bound it missed and by how much (the numbers of a serving sweep, as
`qbuild run --json` records them). The selected artifact's model card carries its exact server command."""

from __future__ import annotations

from qbuild.core.recipe import Selection, Serving
from qbuild.results.selection import select

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
