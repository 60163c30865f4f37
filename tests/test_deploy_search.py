"""The deployment search (recipe `deploy:`): the candidates a space expands to, the pruning and choice rules on
crafted rows, the plan (a screen per candidate, reused when the space widens), and end to end with a real
llama-server on the 2-layer SmolLM2: screened, searched, chosen, speculative drafts measured, a rerun measures
nothing, and `qbuild deploy` prints the answer."""

from __future__ import annotations

import json

import pytest

from helpers import qbuild, run_api, write_recipe


def deploy_recipe(model, store, **deploy) -> dict:
    space = deploy.pop("space", {"variants": ["q8_0", "q4_0"], "parallel": [1, 2], "draft": [None, "q4_0"]})
    return {"name": "dep", "model": {"source": "local", "path": str(model)},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"},
                         {"name": "q4_0", "method": "gguf", "type": "Q4_0"}],
            "evaluation": {"perplexity": {"context_length": 128, "max_windows": 2}, "kld": True,
                           "serving": {"concurrency": [1], "input_len": 32, "output_len": 8, "variants": []}},
            "deploy": {"slo": {"ttft_p99_ms": 150}, "space": space, "screen_requests": 6, "requests": 8,
                       "rounds": 1, "max_searched": 2, "max_minutes": 4, "target_rps": 100, **deploy},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}


# --- the space and the rules, on crafted rows ---------------------------------------------------------------------
def test_the_space_expands_to_every_combination_and_no_variant_drafts_for_itself():
    from qbuild.planning.deploy import candidates
    from qbuild.planning.recipe import DeploySpace

    space = DeploySpace(kv_cache_dtype=[None, "q8_0"], parallel=[1, 4], draft=[None, "q4_0"], draft_max=4)
    found = candidates(space, ["q8_0", "q4_0"])
    names = [f"{label}@{c.name}" for label, c in found]
    # q8_0: 2 KV × 2 slots × 2 drafts; q4_0: 2 × 2 × 1 (never its own draft)
    assert len(names) == 12 == len(set(names))
    assert "q8_0@kv-q8_0.p4.d-q4_0" in names and "q4_0@p1" in names and not any("q4_0@" in n and "d-q4_0" in n
                                                                                   for n in names)
    drafted = dict(found)
    config = next(c for label, c in found if c.name == "kv-q8_0.p4.d-q4_0")
    assert config.draft == "q4_0" and config.draft_max == 4 and config.kv_cache_dtype == "q8_0" and drafted
    assert next(c for label, c in found if c.name == "p1").draft_max is None


def row(name, bound, rss, kld=0.01, capacity=None, k=None, rejected=()):
    return {"name": name, "capacity_bound_rps": bound, "peak_rss_mb": rss, "kld": kld, "capacity_rps": capacity,
            "k": k, "next_rps": None if capacity is None else capacity * 2 ** (1 / 16), "rejected": list(rejected)}


def test_a_candidate_is_pruned_only_by_a_measured_one_no_larger_and_no_worse():
    from qbuild.serving.deploy_search import dominated_by

    measured = row("a", 10, rss=300, kld=0.02, capacity=6.0, k=40)
    assert dominated_by(row("b", 5.9, rss=300, kld=0.02), [measured]) is measured    # cannot beat it anywhere
    assert dominated_by(row("c", 6.5, rss=300, kld=0.02), [measured]) is None        # might have more capacity
    assert dominated_by(row("d", 2.0, rss=200, kld=0.02), [measured]) is None        # smaller: may be on the front
    assert dominated_by(row("e", 2.0, rss=300, kld=0.001), [measured]) is None       # better quality: same


def test_a_few_mib_or_a_slightly_lower_kld_is_no_reason_to_search_for_the_front():
    """Within noise (16 MiB or 5 % of memory, 10 % or 0.001 of KLD) a candidate cannot be meaningfully on the front."""
    from qbuild.serving.deploy_search import dominated_by

    measured = row("a", 10, rss=400, kld=0.020, capacity=6.0, k=40)
    assert dominated_by(row("b", 2.0, rss=390, kld=0.020), [measured]) is measured    # 10 MiB less: noise
    assert dominated_by(row("c", 2.0, rss=400, kld=0.019), [measured]) is measured    # 5 % lower KLD: noise
    assert dominated_by(row("d", 2.0, rss=370, kld=0.020), [measured]) is None        # 30 MiB (7.5 %) less
    assert dominated_by(row("e", 2.0, rss=400, kld=0.015), [measured]) is None        # 25 % lower KLD
    big = row("f", 10, rss=2000, kld=0.020, capacity=6.0, k=40)
    assert dominated_by(row("g", 2.0, rss=1920, kld=0.020), [big]) is big              # 4 % of 2 GB: noise
    assert dominated_by(row("h", 2.0, rss=1880, kld=0.020), [big]) is None            # 6 %: searched


def test_the_choice_the_ties_the_front_and_the_replicas():
    from qbuild.serving.deploy_search import choose, pareto_front, replicas

    rows = [row("fast-big", 9, rss=900, capacity=8.0, k=48), row("fast-small", 9, rss=400, capacity=7.7, k=47),
            row("slow-small", 4, rss=300, capacity=3.0, k=25), row("slow-big", 4, rss=950, capacity=3.0, k=25),
            row("too-big", 20, rss=5000, capacity=16.0, k=64, rejected=["max_memory_mb 1024: 5000 MiB peak RSS"])]
    best, ties = choose(rows)
    # 8.0 and 7.7 requests/s are one grid step apart (within the search's resolution): a tie, broken by memory
    assert best["name"] == "fast-small" and ties == ["fast-big"]
    front = pareto_front(rows)
    assert set(front) == {"fast-big", "fast-small", "slow-small", "too-big"}   # slow-big is beaten on every axis
    assert replicas(20, best) == {"target_rps": 20, "replicas": 3, "range": [3, 3]}
    assert choose([r for r in rows if r["rejected"]])[0] is None


# --- the recipe and the plan --------------------------------------------------------------------------------------
def test_recipe_errors_name_the_field():
    from qbuild.base.errors import RecipeError
    from qbuild.planning.recipe import parse_recipe

    data = deploy_recipe("/nonexistent", "/tmp/x")
    data["deploy"]["space"]["draft"] = [None, "q2"]
    with pytest.raises(RecipeError, match=r"deploy.space names unknown variant\(s\) \['q2'\]"):
        parse_recipe(data)
    data = deploy_recipe("/nonexistent", "/tmp/x")
    del data["evaluation"]["serving"]
    with pytest.raises(RecipeError, match="add evaluation.serving"):
        parse_recipe(data)
    data = deploy_recipe("/nonexistent", "/tmp/x")
    data["evaluation"]["serving"]["configs"] = [{"name": "spec", "draft_max": 4}]
    with pytest.raises(RecipeError, match="give draft"):
        parse_recipe(data)


def test_the_plan_screens_each_candidate_once_and_a_wider_space_screens_only_the_new_ones(tmp_path, tiny_model_dir):
    from qbuild.api import plan

    narrow = write_recipe(tmp_path / "a.yaml", deploy_recipe(tiny_model_dir, tmp_path / "store",
                                                             space={"variants": ["q8_0"], "parallel": [1, 2]}))
    wide = write_recipe(tmp_path / "b.yaml", deploy_recipe(tiny_model_dir, tmp_path / "store",
                                                           space={"variants": ["q8_0"], "parallel": [1, 2, 4],
                                                                  "kv_cache_dtype": [None, "q8_0"]}))
    a = {s.step.name: s.step for s in plan(narrow).steps}
    b = {s.step.name: s.step for s in plan(wide).steps}
    screens_a = {n: s.key for n, s in a.items() if n.startswith("deploy-screen[")}
    screens_b = {n: s.key for n, s in b.items() if n.startswith("deploy-screen[")}
    assert sorted(screens_a) == ["deploy-screen[q8_0@p1]", "deploy-screen[q8_0@p2]"]
    assert len(screens_b) == 6 and all(screens_b[n] == k for n, k in screens_a.items())
    screen = a["deploy-screen[q8_0@p2]"]
    assert screen.params["workload"]["concurrency"] == [2] and "--parallel" in screen.params["server_args"]
    assert screen.params["server_args"][screen.params["server_args"].index("--parallel") + 1] == "2"
    # the quantized KV cache gets its own quality pass, which the deploy step reads
    assert any(n.startswith("perplexity[q8_0@kv-q8_0") for n in b)
    assert {i for i in b["deploy"].inputs if i.startswith("screen-")} == {f"screen-{i}" for i in range(6)}


def test_serving_keys_without_the_new_levers_are_unchanged():
    """threads, batch sizes and drafts are left out of a serving config's key while unset."""
    from qbuild.planning.recipe import ServingConfig

    assert ServingConfig(name="default").canonical() == {"name": "default", "kv_cache_dtype": None, "parallel": None,
                                                         "prefix_caching": None, "flash_attn": None}


def test_llama_server_flags_for_each_lever():
    from qbuild.planning.recipe import ServingConfig
    from qbuild.servers.llamacpp import DRAFT, LlamaServer

    args = LlamaServer().args(ServingConfig(name="x", threads=2, batch_size=256, ubatch_size=64, draft="q4_0",
                                            draft_max=6, draft_min=1, parallel=3), threads=1, slots=1, context=100)
    joined = " ".join(args)
    assert "--threads 2 --threads-batch 2" in joined and "--parallel 3" in joined and "--ctx-size 300" in joined
    assert "--batch-size 256" in joined and "--ubatch-size 64" in joined
    assert f"--spec-type draft-simple --spec-draft-model {DRAFT} --metrics" in joined
    assert "--spec-draft-n-max 6 --spec-draft-n-min 1" in joined


def test_gpu_servers_refuse_llama_only_levers_in_one_line():
    from qbuild.planning.recipe import ServingConfig
    from qbuild.servers.sglang import SGLangServer
    from qbuild.servers.vllm import VLLMServer

    assert "llama-server" in VLLMServer().common_refusal(ServingConfig(name="x", threads=2), {"fp8": "fp8"})
    assert "speculative" in VLLMServer().common_refusal(ServingConfig(name="x", draft="q"), {"fp8": "fp8"})
    assert VLLMServer().common_refusal(ServingConfig(name="x", batch_size=512), {"fp8": "fp8"}) is None
    assert "batch_size" in SGLangServer().common_refusal(ServingConfig(name="x", batch_size=512), {"fp8": "fp8"})


# --- end to end with a real llama-server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def searched(tmp_path_factory, tiny_model_dir):
    from serving_helpers import llama_server_bin

    root = tmp_path_factory.mktemp("deploy")
    mp = pytest.MonkeyPatch()
    mp.setenv("QBUILD_LLAMA_CPP_BIN", str(llama_server_bin()))
    mp.setenv("QBUILD_CACHE", str(root / "cache"))
    recipe = write_recipe(root / "deploy.yaml", deploy_recipe(tiny_model_dir, root / "store"))
    rc, summary = run_api(recipe)
    yield {"rc": rc, "summary": summary, "recipe": recipe, "root": root}
    mp.undo()


@pytest.mark.slow
def test_the_search_screens_every_candidate_searches_the_promising_and_chooses(searched):
    assert searched["rc"] == 0, [s.get("error") for s in searched["summary"]["steps"] if s.get("error")]
    d = searched["summary"]["deploy"]
    names = sorted(r["name"] for r in d["candidates"])
    assert names == sorted(["q8_0@p1", "q8_0@p2", "q8_0@p1.d-q4_0", "q8_0@p2.d-q4_0", "q4_0@p1", "q4_0@p2"])
    assert d["screened"] == 6 and 1 <= d["searched"] <= 2
    chosen = d["chosen"]
    assert chosen is not None and chosen["capacity_rps"] > 0 and chosen["name"] in d["front"]
    assert chosen["command"].startswith("llama-server --model model.gguf --port 8080")
    assert d["replicas"]["replicas"] == -(-100 // chosen["capacity_rps"])
    for r in d["candidates"]:
        assert r["peak_rss_mb"] > 10 and r["screen"]["requests_s"] > 0 and r["screen"]["errors"] == 0
        assert r.get("capacity_rps") is not None or r.get("not_searched") or r["rejected"] or \
            r["challenge"]["outcome"] == "below", r
        if r["draft"]:   # the draft's own counters: tokens drafted and accepted, beside the same server without it
            assert r["speculative"]["draft_tokens"] > 0 and 0 <= r["speculative"]["acceptance_rate"] <= 1
            assert r["without_draft"]["name"] == r["name"].replace(".d-q4_0", "")
            assert "--spec-type draft-simple --spec-draft-model model.gguf" in r["command"]
    # what was searched first had the highest screened bound
    searched_rows = [r for r in d["candidates"] if r.get("capacity_rps") is not None]
    assert max(r["capacity_bound_rps"] for r in d["candidates"]) in {r["capacity_bound_rps"] for r in searched_rows}


@pytest.mark.slow
def test_a_rerun_measures_nothing_and_qbuild_deploy_prints_the_answer(searched):
    rc, again = run_api(searched["recipe"])
    assert rc == 0 and all(s["status"] in ("cached", "source") for s in again["steps"]), \
        [(s["name"], s["status"]) for s in again["steps"] if s["status"] not in ("cached", "source")]
    assert again["deploy"]["chosen"] == searched["summary"]["deploy"]["chosen"]
    out = qbuild("deploy", str(searched["recipe"]), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["chosen"]["name"] == searched["summary"]["deploy"]["chosen"]["name"]
    text = qbuild("deploy", str(searched["recipe"]))
    assert text.returncode == 0 and "command: llama-server" in text.stdout and "Pareto front" in text.stdout
    report = searched["root"] / "report.html"
    out = qbuild("report", str(searched["recipe"]), "--out", str(report))
    assert out.returncode == 0, out.stderr
    page = report.read_text()
    chosen = again["deploy"]["chosen"]["name"]
    assert "Deployment search" in page and f"<title>{chosen}</title>" in page and "capacity (requests/s)" in page


@pytest.mark.slow
def test_a_memory_budget_below_every_server_rejects_all_with_the_figure_and_screens_are_reused(
        searched, tmp_path, tiny_model_dir):
    data = deploy_recipe(tiny_model_dir, searched["root"] / "store", max_memory_mb=1)
    recipe = write_recipe(tmp_path / "tight.yaml", data)
    rc, summary = run_api(recipe)
    built = [s["name"] for s in summary["steps"] if s["status"] == "built"]
    assert built == ["deploy"]   # every screen is reused: the bound is not part of what a screen measures
    d = summary["deploy"]
    assert d["chosen"] is None and d["searched"] == 0
    assert all(any("max_memory_mb 1:" in why and "MiB peak RSS" in why for why in r["rejected"])
               for r in d["candidates"])
    out = qbuild("deploy", str(recipe))
    assert out.returncode == 3 and "no candidate meets every bound" in out.stdout


@pytest.mark.slow
def test_a_speculative_server_is_measured_end_to_end_and_judged_by_the_same_rules(searched, tmp_path, tiny_model_dir):
    """A draft's worth, measured: the same server with and without a q4_0 draft, both capacity-searched (a grid over
    the two) at the same SLO, the draft's acceptance counted by the server, and the choice made by capacity alone."""
    data = deploy_recipe(tiny_model_dir, searched["root"] / "store", strategy="grid",
                         space={"variants": ["q8_0"], "parallel": [1], "draft": [None, "q4_0"]})
    recipe = write_recipe(tmp_path / "spec.yaml", data)
    rc, summary = run_api(recipe)
    assert rc == 0, [s.get("error") for s in summary["steps"] if s.get("error")]
    # both screens come from the first search's store: only the capacity searches and the answer are new
    assert [s["name"] for s in summary["steps"] if s["status"] == "built"] == ["deploy"]
    d = summary["deploy"]
    rows = {r["name"]: r for r in d["candidates"]}
    plain, drafted = rows["q8_0@p1"], rows["q8_0@p1.d-q4_0"]
    assert plain["capacity_rps"] > 0 and drafted["capacity_rps"] > 0 and d["searched"] == 2
    assert drafted["speculative"]["accepted"] > 0 and 0 < drafted["speculative"]["acceptance_rate"] <= 1
    assert drafted["without_draft"] == {"name": "q8_0@p1", "tpot_ms_p50": plain["screen"]["tpot_ms_p50"],
                                        "capacity_rps": plain["capacity_rps"]}
    # kept or rejected as any candidate is: the most capacity wins, within one grid step a tie
    best = max((plain, drafted), key=lambda r: r["capacity_rps"])
    assert d["chosen"]["name"] == best["name"] or d["chosen"]["name"] in d["ties"]
    text = qbuild("deploy", str(recipe))
    assert text.returncode == 0 and "draft acceptance" in text.stdout
    assert f"without the draft TPOT p50 {plain['screen']['tpot_ms_p50']:.1f} ms, {plain['capacity_rps']:.4g} " \
           "requests/s" in text.stdout or d["chosen"]["name"] == "q8_0@p1.d-q4_0"


# --- the runner's loop, with the capacity search stood in -----------------------------------------------------------
def fake_step(tmp_path, screens: dict[str, tuple[float, float]], strategy=None, max_searched=10, **bounds):
    """A deploy step's context over crafted screens: name → (screened requests/s, peak RSS MiB)."""
    from types import SimpleNamespace

    candidates, inputs = [], {}
    for i, (name, (rps, rss)) in enumerate(screens.items()):
        label, config = name.split("@")
        d = tmp_path / f"screen-{i}"
        d.mkdir()
        (d / "serving.json").write_text(json.dumps({
            "command": f"llama-server {name}", "peak_rss_bytes": rss * 1024 * 1024,
            "points": [{"concurrency": 2, "requests_s": rps, "output_tok_s": rps * 8, "ttft_ms_p99": 10,
                        "tpot_ms_p50": 2, "errors": 0}]}))
        inputs[f"screen-{i}"] = d
        inputs[f"model-{label}"] = tmp_path
        candidates.append({"label": label, "config": {"name": config}, "server": "llama-server", "slots": 2,
                           "context": 64, "draft": None, "family": "0" * 64, "screen": f"screen-{i}",
                           "quality": None})
    params = {"candidates": candidates, "slo": {"ttft_p99_ms": 100}, "target_rps": None,
              "bounds": {"max_memory_mb": None, "max_kld": None, "max_delta_ppl_pct": None, **bounds},
              "max_searched": max_searched, "max_minutes": 5, "max_error_pct": 1.0, "workload": {},
              **({"strategy": strategy} if strategy else {})}
    out = tmp_path / "out"
    out.mkdir()
    return SimpleNamespace(params=params, inputs=inputs, input_manifests={}, out=out, log=lambda *a: None,
                           runtime_args={}, threads=1)


@pytest.mark.parametrize("strategy", [None, "grid"])
def test_the_runner_searches_in_order_of_promise_and_skips_what_cannot_win(tmp_path, monkeypatch, strategy):
    import qbuild.serving.capacity_step as capacity_step
    from qbuild.serving.capacity_step import grid_index, rate_of
    from qbuild.serving.deploy_step import run

    asked = []

    def search_server(ctx, *, label, **kw):   # a server sustains 90 % of its screened throughput
        asked.append(label)
        rps = {"a@p4": 10.0, "b@p4": 6.0, "a@p1": 3.0, "b@p1": 2.0}[label] * 0.9
        k = grid_index(rps)
        return {"capacity_rps": rate_of(k), "k": k, "next_rps": rate_of(k + 1), "complete": True,
                "probes_measured": 3, "probes_reused": 0, "peak_rss_bytes": None}

    monkeypatch.setattr(capacity_step, "search_server", search_server)
    # a@p4 fastest but biggest; b@p1 smallest; a@p1 is beaten by a@p4 only on capacity, b@p4 by nothing smaller
    ctx = fake_step(tmp_path, {"a@p4": (10.0, 400), "b@p4": (6.0, 300), "a@p1": (3.0, 400), "b@p1": (2.0, 250)},
                    strategy=strategy)
    result = run(ctx)["metrics"]
    rows = {r["name"]: r for r in result["candidates"]}
    if strategy == "grid":
        assert asked == ["a@p4", "b@p4", "a@p1", "b@p1"] and result["searched"] == 4
    else:
        # a@p1's bound (3 × 1.25 = 3.75/s) is below a@p4's measured capacity with the same memory: never searched
        assert asked == ["a@p4", "b@p4", "b@p1"]
        assert "a@p4 already sustains" in rows["a@p1"]["not_searched"]
    assert result["chosen"]["name"] == "a@p4" and set(result["front"]) == {"a@p4", "b@p4", "b@p1"}


def test_without_the_front_pass_the_search_stops_once_the_choice_is_settled(tmp_path, monkeypatch):
    """front: false: only the searches that settle the choice run; a smaller server that could be on the front is
    left, and says why."""
    import qbuild.serving.capacity_step as capacity_step
    from qbuild.serving.capacity_step import grid_index, rate_of
    from qbuild.serving.deploy_step import run

    measured = []

    def fake_search(ctx, *, label, **_):
        measured.append(label)
        k = grid_index({"a@p4": 9.0, "b@p4": 5.4, "a@p1": 2.7}[label])
        return {"capacity_rps": rate_of(k), "k": k, "next_rps": rate_of(k + 1), "complete": True,
                "probes_measured": 3, "probes_reused": 0, "peak_rss_bytes": None}

    monkeypatch.setattr(capacity_step, "search_server", fake_search)
    # a@p4 settles the choice (no other bound beats 9/s); a@p1 needs a fifth of its memory: a front candidate
    screens = {"a@p4": (9.5, 500), "b@p4": (6.0, 400), "a@p1": (3.0, 100)}
    for front, want in ((True, ["a@p4", "b@p4", "a@p1"]), (False, ["a@p4"])):
        measured.clear()
        (tmp_path / str(front)).mkdir()
        ctx = fake_step(tmp_path / str(front), screens)
        ctx.params["front"] = front
        result = run(ctx)["metrics"]
        assert measured == want, (front, measured)
        assert result["chosen"]["name"] == "a@p4" and result["choice_settled"]["searched"] == 1
    rows = {r["name"]: r for r in result["candidates"]}
    assert rows["a@p1"]["not_searched"].startswith("front: false") and result["front"] == ["a@p4"]


def test_the_runner_rejects_a_server_over_the_memory_budget_before_searching_it(tmp_path, monkeypatch):
    import qbuild.serving.capacity_step as capacity_step
    from qbuild.serving.deploy_step import run

    monkeypatch.setattr(capacity_step, "search_server", lambda ctx, **kw: pytest.fail("nothing should be searched"))
    result = run(fake_step(tmp_path, {"a@p4": (10.0, 400)}, max_memory_mb=300))["metrics"]
    assert result["chosen"] is None and result["candidates"][0]["rejected"] == ["max_memory_mb 300: 400 MiB peak RSS"]


def test_the_choice_is_searched_first_and_the_front_with_what_budget_is_left(tmp_path, monkeypatch):
    """max_searched 2: the best candidate first; a bound that cannot beat it waits for the front's pass, where the
    smaller server comes before the one the best already beats."""
    import qbuild.serving.capacity_step as capacity_step
    from qbuild.serving.capacity_step import grid_index, rate_of
    from qbuild.serving.deploy_step import run

    asked = []

    def search_server(ctx, *, label, **kw):
        asked.append(label)
        k = grid_index({"a@p4": 9.0, "b@p4": 5.4, "a@p1": 2.7, "b@p1": 1.8}[label])
        return {"capacity_rps": rate_of(k), "k": k, "next_rps": rate_of(k + 1), "complete": True,
                "probes_measured": 3, "probes_reused": 0, "peak_rss_bytes": None}

    monkeypatch.setattr(capacity_step, "search_server", search_server)
    ctx = fake_step(tmp_path, {"a@p4": (10.0, 400), "b@p4": (6.0, 300), "a@p1": (3.0, 400), "b@p1": (2.0, 250)},
                    max_searched=2)
    rows = {r["name"]: r for r in run(ctx)["metrics"]["candidates"]}
    assert asked == ["a@p4", "b@p4"]
    assert "already sustains" in rows["a@p1"]["not_searched"] and rows["b@p1"]["not_searched"] == \
        "max_searched 2 reached"


@pytest.mark.parametrize("metrics, want", [
    ("llamacpp:spec_decode_num_draft_tokens_total 40\nllamacpp:spec_decode_num_accepted_tokens_total 30\n",
     {"draft_tokens": 40, "accepted": 30, "acceptance_rate": 0.75}),
    ("llamacpp:spec_decode_num_draft_tokens_total nan\nllamacpp:spec_decode_num_accepted_tokens_total 3\n", None),
    ("llamacpp:spec_decode_num_draft_tokens_total 4\nllamacpp:spec_decode_num_accepted_tokens_total 9\n", None),
    ("llamacpp:spec_decode_num_draft_tokens_total x\n", None),
    ("# nothing about drafts\n", None),
])
def test_a_servers_draft_counters_are_read_only_when_they_can_be_counters(monkeypatch, metrics, want):
    import qbuild.serving.client as client
    from qbuild.servers.llamacpp import LlamaServer

    monkeypatch.setattr(client, "get_text", lambda url, timeout_s: metrics)
    assert LlamaServer().speculative_stats("http://127.0.0.1:1", 5) == want


# --- strategy challenge: the leader searched, the others challenged at its rates --------------------------------------
def capacity_measure(capacity_k: int, asked: list[int]):
    """A probe stand-in for a server that meets the SLOs at every grid rate up to index `capacity_k`."""
    def measure(k: int) -> dict:
        asked.append(k)
        return {"errors": 0, "requests": 24, "ttft_ms_p99": 50.0 if k <= capacity_k else 500.0, "tpot_ms_p50": 2.0,
                "arrival_rps": 1.0, "saturated_rps": None, "ci": {}}
    return measure


@pytest.mark.parametrize("server_k, outcome, asked_want, k_want", [
    (40, "beats", [31, 47, 39, 43, 41, 40], 40),   # met the leader's missed rate: searched upward from there
    (30, "ties", [31, 30], 30),                    # the leader's own rate
    (29, "ties", [31, 30, 29], 29),                # one grid step under: within the search's resolution
    (20, "below", [31, 30, 29], None),             # three probes, and no search
])
def test_a_challenge_settles_beats_ties_or_below_in_at_most_three_probes(server_k, outcome, asked_want, k_want):
    from qbuild.serving.capacity_step import challenge, rate_of

    asked: list[int] = []
    found = challenge(capacity_measure(server_k, asked), {"ttft_p99_ms": 100}, 1.0, 30)
    assert found["challenge"] == outcome and found["k"] == k_want and asked == asked_want, (found, asked)
    if outcome == "below":
        assert found["capacity_rps"] is None and found["below_rps"] == rate_of(29) and found["complete"]
    else:
        assert found["capacity_rps"] == rate_of(k_want) and found["next_rps"] == rate_of(k_want + 1)


def test_a_challenge_cut_short_by_the_time_limit_is_no_verdict():
    from qbuild.serving.capacity_step import challenge

    asked: list[int] = []
    found = challenge(capacity_measure(20, asked), {"ttft_p99_ms": 100}, 1.0, 30, out_of_time=lambda: len(asked) >= 1)
    assert found["challenge"] is None and not found["complete"] and asked == [31]


def test_the_challenge_strategy_searches_the_leader_once_and_challenges_the_close_ones(tmp_path, monkeypatch):
    """A screen that reads a candidate low (b@p2: screened below a@p4, sustains more) does not cost the choice: it is
    challenged at the leader's rates, beats it, and is searched upward; a candidate tied with the leader is reported
    as a tie; one whose screen cannot come within a grid step of the leader is left to the front pass."""
    import qbuild.serving.capacity_step as capacity_step
    from qbuild.serving.capacity_step import grid_index, rate_of
    from qbuild.serving.deploy_step import run

    true_k = {"a@p4": grid_index(2.0), "b@p2": grid_index(2.4), "c@p4": grid_index(2.0), "d@p1": grid_index(0.5)}
    calls = []

    def search_server(ctx, *, label, challenge_k=None, **kw):
        calls.append((label, challenge_k))
        asked: list[int] = []
        measure = capacity_measure(true_k[label], asked)
        if challenge_k is not None:
            found = capacity_step.challenge(measure, {"ttft_p99_ms": 100}, 1.0, challenge_k)
        else:
            found = capacity_step.search(measure, {"ttft_p99_ms": 100}, 1.0, grid_index(kw["search_params"]
                                                                                         ["start_rps"]))
        return {**found, "probes_measured": len(asked), "probes_reused": 0, "peak_rss_bytes": None}

    monkeypatch.setattr(capacity_step, "search_server", search_server)
    screens = {"a@p4": (3.0, 300), "b@p2": (2.2, 300), "c@p4": (2.9, 300), "d@p1": (0.6, 300)}
    result = run(fake_step(tmp_path, screens, strategy="challenge"))["metrics"]
    rows = {r["name"]: r for r in result["candidates"]}
    assert calls[:3] == [("a@p4", None), ("c@p4", grid_index(2.0)), ("b@p2", grid_index(2.0))], calls
    assert rows["c@p4"]["challenge"]["outcome"] == "ties" and rows["b@p2"]["challenge"]["outcome"] == "beats"
    assert rows["b@p2"]["capacity_rps"] == rate_of(true_k["b@p2"]) and result["chosen"]["name"] == "b@p2"
    assert ("d@p1", None) not in calls[:3] and result["choice_settled"]["searched"] == 3
    # d@p1 (0.6 × 1.5 < the leader's rate) was not challenged; it needs no less memory: the front pass skips it
    assert "already sustains" in rows["d@p1"]["not_searched"]


def test_a_candidate_below_the_leader_says_so_and_by_how_much(tmp_path, monkeypatch):
    import qbuild.serving.capacity_step as capacity_step
    from qbuild.results.deploy_report import candidate_text
    from qbuild.serving.capacity_step import grid_index
    from qbuild.serving.deploy_step import run

    true_k = {"a@p4": grid_index(2.0), "b@p2": grid_index(1.2)}

    def search_server(ctx, *, label, challenge_k=None, **kw):
        asked: list[int] = []
        measure = capacity_measure(true_k[label], asked)
        found = (capacity_step.challenge(measure, {"ttft_p99_ms": 100}, 1.0, challenge_k) if challenge_k is not None
                 else capacity_step.search(measure, {"ttft_p99_ms": 100}, 1.0, grid_index(2.0)))
        return {**found, "probes_measured": len(asked), "probes_reused": 0, "peak_rss_bytes": None}

    monkeypatch.setattr(capacity_step, "search_server", search_server)
    result = run(fake_step(tmp_path, {"a@p4": (3.0, 300), "b@p2": (2.0, 400)}, strategy="challenge"))["metrics"]
    rows = {r["name"]: r for r in result["candidates"]}
    assert rows["b@p2"]["challenge"]["outcome"] == "below" and rows["b@p2"]["rejected"] == []
    assert result["chosen"]["name"] == "a@p4" and result["ties"] == []
    assert "challenged at the leader's 2/s: below 1.915/s" in candidate_text(rows["b@p2"])
