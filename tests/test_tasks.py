"""Task accuracy through lm-eval over qbuild's runtime sessions: acc ± stderr per artifact, flips against the baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_api, write_recipe

TASKS = Path(__file__).parent / "tasks" / "pystdlib_mc"
TASK = "pystdlib_mc"

pytest.importorskip("lm_eval")


def _recipe(root: Path, model_dir: Path, variants: list[dict], **evaluation) -> dict:
    return {"name": "tasks", "model": {"source": "local", "path": str(model_dir)}, "variants": variants,
            "evaluation": {"baseline": True, "perplexity": None,
                           "tasks": [{"task": TASK, "include_path": str(TASKS)}], **evaluation},
            "store": {"path": str(root / "store")}}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("tasks")
    data = _recipe(root, tiny_model_dir, [{"name": "q2k", "method": "gguf", "type": "Q2_K"}],
                   gates=[{"max_acc_drop_pct": 100, "max_flips_pct": 100}])
    recipe = write_recipe(root / "r.yaml", data)
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    return {"root": root, "recipe": recipe, "summary": summary, "data": data,
            "variants": {v["variant"]: v for v in summary["variants"]}}


def test_every_artifact_gets_accuracy_and_variants_get_flips(built):
    base = built["variants"]["baseline"]["tasks"]
    assert [t["task"] for t in base] == [TASK]
    assert base[0]["documents"] == 40 and 0 <= base[0]["acc"] <= 1 and base[0]["acc_stderr"] > 0
    assert base[0]["flips"] is None and base[0]["runtime"] == "transformers"
    for name in ("q2k",):
        [t] = built["variants"][name]["tasks"]
        assert t["runtime"] == "llama.cpp"          # GGUF through llama.cpp, the same adapter
        f = t["flips"]
        assert f["total"] == f["right_to_wrong"] + f["wrong_to_right"]
        # accuracy moves by exactly the net flips: both come from the same per-document outcomes
        assert round(40 * (t["acc"] - base[0]["acc"])) == f["wrong_to_right"] - f["right_to_wrong"]
    assert [g["passed"] for g in built["summary"]["gates"]["checks"]] == [True] * 2


def test_flips_and_accuracy_read_the_stored_per_document_outcomes(built):
    from qbuild.artifacts.store import Store
    from qbuild.evaluate.tasks import flips, read_samples

    st = Store(built["root"] / "store")
    steps = {s["name"]: s for s in built["summary"]["steps"]}
    base = read_samples(st.object_dir(steps[f"task:{TASK}[baseline]"]["digest"]))
    q2k = read_samples(st.object_dir(steps[f"task:{TASK}[q2k]"]["digest"]))
    assert sorted(base) == list(range(40))
    counted = flips(base, q2k)
    assert counted["flips"] == built["variants"]["q2k"]["tasks"][0]["flips"]["total"]
    assert sum(base.values()) / 40 == pytest.approx(built["variants"]["baseline"]["tasks"][0]["acc"])


def test_baseline_accuracy_equals_lm_eval_hf_model(built, tiny_model_dir):
    """lm-eval's own `hf` model on the same checkpoint and task: the same per-document answers and accuracy."""
    import os

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(TASKS)
    try:
        res = simple_evaluate(model="hf", model_args={"pretrained": str(tiny_model_dir), "dtype": "float32"},
                              tasks=[TASK], task_manager=TaskManager(include_path=str(TASKS)), batch_size=1,
                              device="cpu", log_samples=True)
    finally:
        os.chdir(cwd)
    ours = built["variants"]["baseline"]["tasks"][0]
    assert res["results"][TASK]["acc,none"] == pytest.approx(ours["acc"])
    assert res["results"][TASK]["acc_stderr,none"] == pytest.approx(ours["acc_stderr"])


def test_gates_on_accuracy_drop_and_flips(built):
    from qbuild.core.recipe import Gate
    from qbuild.evaluate.gates import check_gates

    # bounds no result can meet (constructed: the recipe schema refuses a negative flips bound)
    rows = check_gates([Gate.model_construct(max_acc_drop_pct=-100, max_flips_pct=-1)], built["summary"])
    assert {(r["variant"], r["check"]) for r in rows if not r["passed"]} == {
        ("q2k", "max_acc_drop_pct"), ("q2k", "max_flips_pct")}
    variant = built["variants"]["q2k"]
    assert variant["flips_pct"] == variant["tasks"][0]["flips"]["pct"]
    assert variant["acc_drop_pct"] == pytest.approx(
        100 * (built["variants"]["baseline"]["tasks"][0]["acc"] - variant["tasks"][0]["acc"]))


def test_task_steps_are_cached_per_artifact_and_task(built):
    rc, again = run_api(built["recipe"])
    assert rc == 0
    task_steps = [s for s in again["steps"] if s["kind"] == "task"]
    assert len(task_steps) == 2 and {s["status"] for s in task_steps} == {"cached"}
    strip = [[{k: v for k, v in t.items() if k != "status"} for t in v["tasks"]] for v in again["variants"]]
    assert strip == [[{k: v for k, v in t.items() if k != "status"} for t in v["tasks"]]
                     for v in built["summary"]["variants"]]


def test_task_files_are_part_of_the_key(tmp_path, built):
    import shutil

    from qbuild import api

    copy = tmp_path / "task"
    shutil.copytree(TASKS, copy)
    data = json.loads(json.dumps(built["data"]))
    data["evaluation"]["tasks"][0]["include_path"] = str(copy)
    same = {p.step.name: p.status for p in api.plan(data).steps if p.step.kind == "task"}
    assert set(same.values()) == {"hit"}      # content, not location
    with open(copy / "pystdlib_mc.jsonl", "a") as f:
        f.write(json.dumps({"id": 40, "question": "Which module?", "choices": ["a", "b", "c", "d"], "answer": 0}) + "\n")
    changed = {p.step.name: p.status for p in api.plan(data).steps if p.step.kind == "task"}
    assert set(changed.values()) == {"miss"}


def test_the_adapter_is_an_lm_eval_model_beside_lm_evals_own():
    """Registering `qbuild` must not hide lm-eval's own models (its registry loads them only when empty)."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    from qbuild.evaluate.tasks import _lm_class

    cls = _lm_class()
    assert issubclass(cls, LM) and get_model("qbuild") is cls and _lm_class() is cls
    assert get_model("hf").__name__ == "HFLM"


def test_a_task_its_include_path_does_not_declare_is_a_plan_error(tmp_path, tiny_model_dir):
    from helpers import qbuild

    data = _recipe(tmp_path, tiny_model_dir, [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}])
    data["evaluation"]["tasks"][0]["task"] = "pystdlib_mcq"
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data))
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "evaluation.tasks[0].task: 'pystdlib_mcq': no task YAML under" in res.stderr
    data["evaluation"]["tasks"][0] |= {"task": TASK, "include_path": str(tmp_path / "nowhere")}
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data))
    assert res.returncode == 2 and "evaluation.tasks[0].include_path" in res.stderr
