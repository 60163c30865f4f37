"""Step keys: stable for the same inputs; a change misses exactly the steps that depend on it."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from qbuild.artifacts.store import Store
from qbuild.base import fingerprint
from qbuild.pipeline.plan import build_steps, make_plan
from qbuild.planning.recipe import parse_recipe

from helpers import fake_model, qbuild, write_recipe


def base_recipe(model: Path) -> dict:
    return {
        "name": "keys",
        "model": {"source": "local", "path": str(model)},
        "calibration": {"sources": [{"type": "pydocs"}], "samples": 4, "seq_len": 64, "seed": 0},
        "variants": [
            {"name": "cal", "method": "fake", "calibrated": True},
            {"name": "plain", "method": "fake", "level": 2},
            {"name": "q4", "method": "gguf", "type": "Q4_K_M"},
            {"name": "q8", "method": "gguf", "type": "Q8_0"},
        ],
        "evaluation": {"perplexity": {"context_length": 64, "max_windows": 2}},
    }


def keys_of(data: dict, base: Path) -> dict[str, str]:
    ctx = build_steps(parse_recipe(copy.deepcopy(data)), base)
    return {s.name: s.key for s in ctx.steps}


def changed(a: dict, b: dict) -> set[str]:
    assert a.keys() == b.keys()
    return {k for k in a if a[k] != b[k]}


@pytest.fixture
def setup(tmp_path):
    model = fake_model(tmp_path)
    data = base_recipe(model)
    return model, data, keys_of(data, tmp_path)


def test_keys_are_stable_and_location_independent(tmp_path, setup):
    model, data, keys = setup
    assert keys_of(data, tmp_path) == keys
    # the same model content elsewhere, recipe with comments/ordering differences → same keys
    other = tmp_path / "elsewhere"
    other.mkdir()
    moved = fake_model(other)
    data2 = dict(reversed(list(copy.deepcopy(data).items())))
    data2["model"] = {"path": str(moved), "source": "local"}
    assert keys_of(data2, tmp_path) == keys


def test_plan_shares_one_calibration_and_one_conversion(setup):
    _, _, keys = setup
    assert sum(1 for k in keys if k == "calibrate") == 1
    assert [k for k in keys if k.startswith("gguf-convert")] == ["gguf-convert[f16]"]


def test_calibration_seed_misses_only_calibrated_methods(tmp_path, setup):
    _, data, keys = setup
    data["calibration"]["seed"] = 1
    assert changed(keys, keys_of(data, tmp_path)) == {"calibrate", "quantize[cal]"}


def test_evaluation_setting_keeps_quantized_models(tmp_path, setup):
    _, data, keys = setup
    data["evaluation"]["perplexity"]["max_windows"] = 3
    diff = changed(keys, keys_of(data, tmp_path))
    # the conversion check compares on the evaluation text, so it is redone; no quantized model is
    assert diff == {"eval-data", "convert-check[f16]"} | {k for k in keys if k.startswith("perplexity[")}


def test_variant_param_misses_only_that_variant(tmp_path, setup):
    _, data, keys = setup
    data["variants"][2]["type"] = "Q5_K_M"
    assert changed(keys, keys_of(data, tmp_path)) == {"quantize[q4]", "perplexity[q4]"}


def test_renaming_a_variant_keeps_its_artifact(tmp_path, setup):
    _, data, keys = setup
    data["variants"][3]["name"] = "q8-renamed"
    new = keys_of(data, tmp_path)
    assert new["quantize[q8-renamed]"] == keys["quantize[q8]"]


def test_model_content_change_misses_everything_downstream(tmp_path, setup):
    model, data, keys = setup
    (model / "model.safetensors").write_bytes(b"\1" * 64)
    diff = changed(keys, keys_of(data, tmp_path))
    assert diff == set(keys)


def test_toolchain_change_misses_only_steps_using_it(tmp_path, setup, monkeypatch):
    _, data, keys = setup
    real = fingerprint.package_version

    def fake_version(dist):
        return "9.9.9" if dist == "llama-cpp-python" else real(dist)

    monkeypatch.setattr("qbuild.base.fingerprint.package_version", fake_version)
    diff = changed(keys, keys_of(data, tmp_path))
    assert diff == {"gguf-convert[f16]", "convert-check[f16]", "quantize[q4]", "quantize[q8]", "perplexity[q4]",
                    "perplexity[q8]"}
    monkeypatch.setattr("qbuild.base.fingerprint.package_version", lambda d: "0.0-unrelated" if d == "requests" else real(d))
    assert changed(keys, keys_of(data, tmp_path)) == set()


def test_plan_explains_why_a_step_misses(tmp_path, setup):
    _, data, _ = setup
    store = Store(tmp_path / "store")
    recipe = parse_recipe(copy.deepcopy(data))
    ctx = build_steps(recipe, tmp_path)
    for s in ctx.steps:  # pretend the first plan was built
        store.remember_build("keys", s.name, {"key": s.key, "params": s.params, "inputs": s.input_keys(),
                                              "toolchain": s.toolchain(), "impl": s.impl_version})
    data["calibration"]["seed"] = 7
    data["variants"][2]["type"] = "Q5_K_M"
    planned = make_plan(parse_recipe(copy.deepcopy(data)), tmp_path, store).steps
    why = {p.step.name: p.reason for p in planned}
    assert why["calibrate"] == "params changed: seed 0 → 7"
    assert why["quantize[q4]"] == "params changed: type Q4_K_M → Q5_K_M"
    assert why["quantize[cal]"].startswith("input changed: calibration")
    assert why["perplexity[q4]"] == "input changed: model (quantize[q4])"
    assert why["quantize[q8]"] == "stored object missing (deleted or damaged)"  # same key, never stored here


def test_planning_never_imports_torch(tmp_path, setup):
    _, data, _ = setup
    recipe = write_recipe(tmp_path / "r.yaml", data)
    code = (
        "import sys; from qbuild.cli import cli; "
        f"sys.argv=['qbuild','plan','{recipe}','--store','{tmp_path / 's'}','--json'];\n"
        "try:\n    cli()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'llama_cpp', 'datasets', 'ray') if m in sys.modules]\n"
        "print('HEAVY', heavy, file=sys.stderr)"
    )
    import subprocess

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "HEAVY []" in res.stderr, res.stderr
    plan = json.loads(res.stdout)
    assert plan["to_build"] == len(plan["steps"]) - 1  # everything but the local model source


def test_cli_plan_json_lists_every_step(tmp_path, setup):
    _, data, keys = setup
    res = qbuild("plan", write_recipe(tmp_path / "r.yaml", data), "--store", tmp_path / "s", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["steps"]
    assert {r["step"] for r in rows} == set(keys)
    assert all(r["reason"] == "new" for r in rows if r["status"] == "miss")
