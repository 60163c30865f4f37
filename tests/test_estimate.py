"""`qbuild plan` estimates each miss from the store's history of similar steps, and the plan's total the way the
executor schedules it (qbuild/pipeline/estimate.py). The fake method sleeps a set time, so the history is known."""

from __future__ import annotations

import json

from qbuild import api
from qbuild.artifacts.store import Store
from qbuild.contract.step import Step
from qbuild.pipeline.estimate import _schedule, estimate_plan

from helpers import fake_recipe, qbuild, run_api, write_recipe


def _recipe(tmp_path, variants):
    return write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, variants))


def test_a_miss_is_estimated_from_the_same_step_built_before_then_from_similar_ones(tmp_path, store_dir):
    variants = [{"name": "a", "method": "fake", "sleep": 1.2}, {"name": "b", "method": "fake", "sleep": 0.4}]
    recipe = _recipe(tmp_path, variants)
    cold = api.plan(recipe, store=store_dir)
    assert cold.estimate.unknown == 2 and cold.estimate.total_seconds == 0        # no history: said, not guessed
    rc, summary = run_api(recipe, store_dir)
    assert rc == 0
    took = {s["name"]: Store(store_dir).manifest(s["digest"])["timings"]["seconds"]   # what the worker took
            for s in summary["steps"] if s["name"].startswith("quantize")}
    stored = api.plan(recipe, store=store_dir, estimate=False)                  # all cached: nothing to estimate...
    assert estimate_plan(stored.steps, Store(store_dir), "t", cores=2).steps == {}
    # ... but a cold build's time: each stored step at its own build time, scheduled as the executor runs them
    assert abs(estimate_plan(stored.steps, Store(store_dir), "t", cores=2).cold_seconds - max(took.values())) < 1e-6
    assert abs(estimate_plan(stored.steps, Store(store_dir), "t", cores=1).cold_seconds - sum(took.values())) < 1e-6
    assert "a cold build of the whole recipe (an empty store) would take about" in \
        qbuild("plan", recipe, "--store", store_dir).stdout

    variants[0]["level"] = 2          # the same step with another setting
    variants.append({"name": "c", "method": "fake", "sleep": 1.2, "level": 7})   # a new step like `a`
    recipe = _recipe(tmp_path, variants)
    res = qbuild("plan", recipe, "--store", store_dir, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = {r["step"]: r for r in data["steps"]}
    assert rows["quantize[a]"]["estimate_basis"] == "same step, built before"
    assert abs(rows["quantize[a]"]["estimate_s"] - took["quantize[a]"]) < 0.06   # its manifest's recorded time
    assert rows["quantize[c]"]["estimate_basis"].startswith("similar step (")
    assert abs(rows["quantize[c]"]["estimate_s"] - took["quantize[a]"]) < 0.06   # most settings in common: a
    assert "estimate_s" not in rows["quantize[b]"]                                # a hit
    assert data["estimate"]["steps_without_history"] == 0 and data["estimate"]["total_s"] > 0
    human = qbuild("plan", recipe, "--store", store_dir)
    assert "estimated" in human.stdout and "from this store's history" in human.stdout


def _step(name, inputs=(), threads=1, timing=False):
    return Step("quantize", name, {"n": name}, "m:f", inputs={f"i{i}": s for i, s in enumerate(inputs)},
                threads=threads, per_hardware=timing)


def test_the_total_schedules_misses_like_the_executor():
    from qbuild.pipeline.estimate import StepEstimate

    a, b = _step("a"), _step("b")
    c = _step("c", inputs=(a,))
    t = _step("t", timing=True)
    est = {s.key: StepEstimate(sec, "x") for s, sec in ((a, 10), (b, 4), (c, 3), (t, 5))}
    assert _schedule([a, b, c], est, cores=2) == 13      # a ‖ b, then c after a
    assert _schedule([a, b, c], est, cores=1) == 17      # one core: one after another
    assert _schedule([a, b, t], est, cores=2) == 15      # a timing step runs alone: a ‖ b (10), then t (5)
    wide = _step("w", threads=2)
    est[wide.key] = StepEstimate(6, "x")
    assert _schedule([a, wide], est, cores=2) == 16      # a two-thread step waits for both cores


def test_estimate_plan_without_misses_reads_nothing(tmp_path, store_dir):
    recipe = _recipe(tmp_path, [{"name": "a", "method": "fake"}])
    assert run_api(recipe, store_dir)[0] == 0
    plan = api.plan(recipe, store=store_dir, estimate=False)
    assert estimate_plan(plan.steps, None, "t").steps == {}   # no store access at all (None would fail)


def test_a_similar_evaluation_is_scaled_by_the_tokens_it_scores(store_dir):
    """A search's 2-window sensitivity pass estimated from an 8-window pass of another recipe: a quarter of it."""
    from qbuild.contract.step import PlanStatus
    from qbuild.pipeline.plan import PlannedStep

    st = Store(store_dir)
    old = Step("perplexity", "perplexity[a]", {"max_windows": 8, "context_length": 512, "runtime": "llama.cpp"}, "m:f")
    assert st.owned is not None   # claims the new store (its marker) before anything is written into it
    tmp = st.root / "tmp" / "old"
    tmp.mkdir(parents=True)
    (tmp / "perplexity.json").write_text("{}")
    st.publish(old.key, tmp, {"kind": "perplexity", "name": old.name, "runner": "m:f", "params": dict(old.params),
                              "recipe": {"name": "other"}, "timings": {"seconds": 40.0}})
    new = Step("perplexity", "perplexity[b~attn_q@Q4_0]", {**old.params, "max_windows": 2}, "m:f")
    est = estimate_plan([PlannedStep(new, PlanStatus.MISS)], st, "search").steps[new.key]
    assert est.seconds == 10.0 and est.basis.endswith("scaled by evaluated tokens x0.25"), est
    same = Step("perplexity", "perplexity[c]", dict(old.params), "m:f")   # the same windows: not scaled
    assert estimate_plan([PlannedStep(same, PlanStatus.MISS)], st, "search").steps[same.key].seconds == 40.0


def test_history_of_a_method_counts_after_its_runner_moved(store_dir):
    """A GPTQ step stored when its runner lived elsewhere (qbuild.quantize.gptq:GPTQ.run, before the per-method
    packages) still estimates another GPTQ variant: the method, not the runner's module path, makes it similar. Another
    method under that old runner does not."""
    from qbuild.contract.step import PlanStatus
    from qbuild.pipeline.plan import PlannedStep

    st = Store(store_dir)
    assert st.owned is not None
    for i, (method, seconds) in enumerate((("gptq", 30.0), ("awq", 90.0))):
        old = Step("quantize", f"quantize[{method}-old]", {"method": method, "bits": 4}, "old.module:Old.run")
        tmp = st.root / "tmp" / f"old{i}"
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        st.publish(old.key, tmp, {"kind": "quantize", "name": old.name, "runner": old.runner, "params": dict(old.params),
                                  "recipe": {"name": "other"}, "timings": {"seconds": seconds}})
    new = Step("quantize", "quantize[gptq-w4]", {"method": "gptq", "bits": 4, "group_size": 64}, "new.module.run:run")
    est = estimate_plan([PlannedStep(new, PlanStatus.MISS)], st, "mine").steps[new.key]
    assert est.seconds == 30.0 and est.basis.startswith("similar step (2/3 params equal)"), est
    other = Step("quantize", "quantize[rtn]", {"method": "rtn", "bits": 4}, "new.rtn.run:run")   # no rtn stored
    assert estimate_plan([PlannedStep(other, PlanStatus.MISS)], st, "mine").steps[other.key].seconds is None


def test_a_cold_build_leaves_out_what_this_machine_cannot_build(store_dir):
    """A GPU engine and what evaluates it are skipped by a run here, so the cold estimate leaves them out, and says so."""
    from qbuild.artifacts.store import Hit
    from qbuild.contract.step import PlanStatus
    from qbuild.pipeline.estimate import history_note
    from qbuild.pipeline.plan import PlannedStep

    a, b = _step("a"), _step("b")
    engine = _step("engine", inputs=(a,))
    evaluated = _step("eval", inputs=(engine,))

    def stored(step, seconds):
        return PlannedStep(step, PlanStatus.HIT, Hit(step.key, "0" * 64, None, {"timings": {"seconds": seconds}}))

    planned = [stored(a, 10.0), stored(b, 4.0), PlannedStep(engine, PlanStatus.NEEDS_GPU, reason="needs a GPU"),
               PlannedStep(evaluated, PlanStatus.MISS)]
    est = estimate_plan(planned, Store(store_dir), "t", cores=1)
    assert (est.cold_seconds, est.cold_excluded) == (14.0, 2)
    assert history_note(est).endswith("(2 step(s) this machine cannot build not counted)")
    planned[1] = PlannedStep(b, PlanStatus.HIT, Hit(b.key, "0" * 64, None, {}))   # stored before timings were kept
    assert estimate_plan(planned, Store(store_dir), "t", cores=1).cold_seconds is None
