"""`selection.on_uncertain: measure_more` (qbuild/results/measure_more.py): which candidates are in doubt, the serving
steps that add rounds to them, and end to end on a real llama-server (slow): a bound within noise gets more rounds,
pooled with the first ones, and `qbuild select` follows the same passes from the store."""

from __future__ import annotations

import pytest

from qbuild.contract.step import Step
from qbuild.results.measure_more import in_doubt, more_steps


def serving_step(label: str, config: str, rounds: int, first_round: int | None = None) -> Step:
    workload = {"concurrency": [1, 2], "requests": 4, "seed": 0, "rounds": rounds}
    if first_round is not None:
        workload["first_round"] = first_round
    name = f"serving[{label}@{config}]" + (f"+{first_round}" if first_round else "")
    return Step("serving", name, {"workload": workload, "config": {"name": config}}, "qbuild.serving.bench_step:run",
                runtime_args={"label": label})


def test_candidates_in_doubt_are_those_within_noise_and_those_tied():
    selection = {"selected": {"variant": "a", "config": "default", "uncertain": []},
                 "rejected": [{"variant": "b", "config": "kv8", "uncertain": ["ttft_p99_ms ... within noise"]},
                              {"variant": "c", "config": "default", "uncertain": []}],
                 "tie": {"candidates": [{"variant": "a", "config": "default"}, {"variant": "c", "config": "default"}]}}
    assert in_doubt(selection) == [("b", "kv8"), ("a", "default"), ("c", "default")]
    assert in_doubt({"selected": None, "rejected": [{"variant": "c", "config": "d", "uncertain": []}]}) == []


def test_added_rounds_go_on_where_the_earlier_ones_ended():
    base = serving_step("q8_0", "default", 3)
    other = serving_step("q4km", "default", 3)
    [more] = more_steps([base, other], [("q8_0", "default")], rounds=2)
    assert more.name == "serving[q8_0@default]+3" and more.params["workload"]["first_round"] == 3
    assert more.params["workload"]["rounds"] == 2 and more.key != base.key
    assert {k: v for k, v in more.params["workload"].items() if k not in ("rounds", "first_round")} == \
        {k: v for k, v in base.params["workload"].items() if k != "rounds"}
    [again] = more_steps([base, other, more], [("q8_0", "default")], rounds=2)
    assert again.name == "serving[q8_0@default]+5" and again.params["workload"]["first_round"] == 5
    assert more_steps([base], [("q8_0", "kv8")], rounds=2) == []   # nothing served under that config


@pytest.mark.slow
def test_measure_more_adds_rounds_to_a_bound_within_noise_on_a_real_server(tmp_path, tiny_model_dir):
    from serving_helpers import llama_server_bin

    from helpers import qbuild, run_api, write_recipe

    llama_server_bin()
    data = {"name": "more", "model": {"source": "local", "path": str(tiny_model_dir)},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}],
            "evaluation": {"perplexity": None, "baseline": False,
                           "serving": {"concurrency": [2], "requests": 6, "warmup": 1, "rounds": 2, "input_len": 32,
                                       "output_len": {"min": 4, "max": 12}, "variants": ["q8_0"]}},
            "selection": {"ttft_p99_ms": 100_000, "objective": "max_throughput"},
            "runtime": {"threads": 1}, "store": {"path": str(tmp_path / "store")}}
    recipe = write_recipe(tmp_path / "r.yaml", data)
    rc, first = run_api(recipe)
    assert rc == 0, first["steps"]
    [pt] = next(v for v in first["variants"] if v["variant"] == "q8_0")["serving"]
    lo, hi = pt["ci"]["ttft_ms_p99"]
    assert lo < hi, pt["ci"]
    # a bound in the middle of the interval: within noise, by construction
    data["selection"] = {"ttft_p99_ms": (lo + hi) / 2, "on_uncertain": "measure_more", "measure_more_rounds": 2,
                         "measure_more_minutes": 3, "objective": "max_throughput"}
    write_recipe(recipe, data)
    rc, more = run_api(recipe)
    added = [s for s in more["steps"] if s["name"].startswith("serving[q8_0@default]+")]
    assert added and added[0]["name"] == "serving[q8_0@default]+2" and added[0]["status"] == "built"
    [pooled] = next(v for v in more["variants"] if v["variant"] == "q8_0")["serving"]
    n_rounds = 2 + 2 * len(added)
    assert len(pooled["rounds"]) == n_rounds and pooled["requests"] == 6 * n_rounds
    assert pooled["rounds"][:2] == pt["rounds"]   # the first rounds are the stored ones, pooled with the added ones
    sel = more["selection"]
    judged = sel["selected"] or sel["rejected"][0]
    verdict = judged["slo"]["ttft_p99_ms"]
    assert verdict["value"] == pooled["ttft_ms_p99"] and verdict["ci"] == pooled["ci"]["ttft_ms_p99"]
    # decided by the added rounds (met or missed beyond the noise), or still in doubt when the passes ended: rejected
    if verdict["verdict"] == "uncertain":
        assert sel["selected"] is None and "(on_uncertain: measure_more)" in judged["why"]
    else:
        assert (sel["selected"] is not None) == (verdict["verdict"] == "met")

    out = qbuild("select", recipe, "--json")   # the same passes from the store: the same verdict, nothing measured
    import json

    again = json.loads(out.stdout)
    assert (again["selected"] or {}).get("variant") == (sel["selected"] or {}).get("variant")
    assert again["rejected"] == sel["rejected"]
    rc, third = run_api(recipe)
    assert third["counts"]["built"] == 0
