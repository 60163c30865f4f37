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
    from qbuild.evaluate.gates import check_gates
    from qbuild.planning.recipe import Gate

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

    from qbuild.evaluate.task_run import registered

    cls = registered()
    assert issubclass(cls, LM) and get_model("qbuild") is cls and registered() is cls
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


FUNCTION_TASK = """task: pystdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: pystdlib_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: !function utils.doc_to_text
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _function_task(root: Path) -> Path:
    """pystdlib_mc with its prompt from Python (`!function`): lm-eval imports utils.py from the task directory."""
    import shutil

    task = root / "fn_task"
    shutil.copytree(TASKS, task)
    (task / "pystdlib_mc.yaml").write_text(FUNCTION_TASK)
    (task / "utils.py").write_text('def doc_to_text(doc):\n    return f"Question: {doc[\'question\']}\\nAnswer:"\n')
    return task


def test_task_fingerprint_is_the_tasks_own_sources(tmp_path):
    """Bytecode (written when lm-eval imports a `!function`, named per Python version) and other generated files
    (hidden tool and editor caches) leave the fingerprint alone; an edited source changes it."""
    import py_compile

    from qbuild.base.fingerprint import dir_fingerprint

    task = _function_task(tmp_path)
    clean = dir_fingerprint(task, sources_only=True)
    py_compile.compile(str(task / "utils.py"), doraise=True)   # __pycache__/utils.cpython-3XX.pyc, as an import does
    assert list((task / "__pycache__").glob("utils.cpython-*.pyc"))
    (task / "__pycache__" / "utils.cpython-312.pyc").write_bytes(b"\xcb\r\r\n" + bytes(12))   # another Python's
    (task / "utils.pyc").write_bytes(b"\0" * 16)
    (task / ".ipynb_checkpoints").mkdir()
    (task / ".ipynb_checkpoints" / "pystdlib_mc-checkpoint.yaml").write_text(FUNCTION_TASK)
    (task / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    assert dir_fingerprint(task, sources_only=True) == clean
    with open(task / "utils.py", "a") as f:
        f.write("# edited\n")
    assert dir_fingerprint(task, sources_only=True) != clean
    # any directory's fingerprint (a local model's, a calibration file set's) ignores bytecode too
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    before = dir_fingerprint(model)
    (model / "__pycache__").mkdir()
    (model / "__pycache__" / "modeling.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert dir_fingerprint(model) == before


def test_a_function_task_keeps_its_key_after_it_runs(tmp_path, tiny_model_dir, monkeypatch):
    """`qbuild plan` before and after a run of a task whose prompt is a `!function`: the same key, a hit (lm-eval's
    import wrote __pycache__ into the task directory, which changed the key and rebuilt the step once more)."""
    from qbuild import api

    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)   # the worker writes bytecode, as Python does

    task = _function_task(tmp_path)
    data = _recipe(tmp_path, tiny_model_dir, [{"name": "a", "method": "fake"}])
    data["evaluation"]["tasks"][0]["include_path"] = str(task)
    recipe = write_recipe(tmp_path / "r.yaml", data)
    before = {p.step.name: p.step.key for p in api.plan(recipe).steps if p.step.kind == "task"}
    assert list(before) == [f"task:{TASK}[baseline]"]
    rc, summary = run_api(recipe)
    assert rc == 0, summary["steps"]
    assert summary["variants"][0]["tasks"][0]["documents"] == 40
    assert list((task / "__pycache__").glob("utils.*.pyc"))   # lm-eval imported the task's Python
    after = {p.step.name: (p.step.key, p.status) for p in api.plan(recipe).steps if p.step.kind == "task"}
    assert after == {name: (key, "hit") for name, key in before.items()}
