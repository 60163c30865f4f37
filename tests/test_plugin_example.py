"""The plugin contract end to end: examples/qbuild-plugin-example installed as a real distribution
(pip, entry points), then used through the CLI like a built-in method: its own format is evaluated by the
built-in transformers runtime, which the plugin names in the format's declaration; and a format no runtime
reads is reported, not dropped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import fake_recipe, qbuild, write_recipe

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "qbuild-plugin-example"


@pytest.fixture(scope="module")
def example_env(tmp_path_factory) -> dict:
    """The example package pip-installed into its own directory, put on PYTHONPATH (so only these tests see it)."""
    target = tmp_path_factory.mktemp("example-plugin")
    source = shutil.copytree(EXAMPLE, tmp_path_factory.mktemp("example-src") / EXAMPLE.name)  # builds leave files behind
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert list(target.glob("qbuild_plugin_example-*.dist-info/entry_points.txt"))
    return {"PYTHONPATH": os.pathsep.join([str(target), os.environ["PYTHONPATH"]])}


def test_entry_point_plugins_are_listed_and_in_the_schema(example_env):
    res = qbuild("plugins", "--json", env=example_env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = {(r["kind"], r["name"]): r for r in data["plugins"]}
    assert rows[("method", "int8-rtn")]["origin"] == "qbuild-plugin-example"
    assert not [r for r in data["plugins"] if r["origin"] == "qbuild-plugin-example" and r["kind"] != "method"]
    assert "hf-int8-simulated" in rows[("runtime", "transformers")]["formats"]
    fmt = {f["format"]: f for f in data["formats"]}["hf-int8-simulated"]
    assert fmt["evaluated_by"] == ["transformers"] and fmt["loads_in"] == ["vllm", "sglang", "tgi", "transformers"]
    schema = json.loads(qbuild("schema", env=example_env).stdout)
    assert "Int8RTNVariant" in schema["$defs"]


def test_entry_point_method_in_validation_errors(tmp_path, example_env):
    path = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "x", "method": "int8-rtm"}]))
    res = qbuild("validate", path, env=example_env)
    assert res.returncode == 2 and "int8-rtn" in res.stderr and "Traceback" not in res.stderr


def test_method_from_an_entry_point_is_evaluated_by_the_builtin_runtime_end_to_end(tmp_path, tiny_model_dir, example_env):
    recipe = {"name": "ext", "model": {"source": "local", "path": str(tiny_model_dir)},
              "variants": [{"name": "int8", "method": "int8-rtn"}],
              "evaluation": {"baseline": True, "kld": True, "perplexity": {"context_length": 64, "max_windows": 2}},
              "runtime": {"threads": 1}}
    path = write_recipe(tmp_path / "ext.yaml", recipe)
    res = qbuild(path, "--store", tmp_path / "store", "--json", env=example_env)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    steps = {s["name"]: s["status"] for s in summary["steps"]}
    # one pass per model: the baseline's reference log-probs, then the variant's PPL + KLD + top-1 in one step
    assert steps["quantize[int8]"] == steps["perplexity[int8]"] == steps["reference[baseline]"] == "built"
    assert "kld[int8]" not in steps and "perplexity[baseline]" not in steps
    rows = {r["variant"]: r for r in summary["variants"]}
    int8, base = rows["int8"], rows["baseline"]
    assert int8["format"] == "hf-int8-simulated" and int8["scheme"] == "w8a16" and int8["not_evaluated"] is None
    # INT8 per-channel weights are nearly lossless: close to the baseline, but not identical
    assert 0 < abs(int8["ppl"] - base["ppl"]) / base["ppl"] < 0.02
    assert 0 < int8["kld"] < 0.01 and int8["top1"] > 0.95
    manifest = json.loads(qbuild("show", int8["digest"], "--store", tmp_path / "store", env=example_env).stdout)
    assert manifest["toolchain"]["qbuild-plugin-example"] == "0.1.0"  # the plugin's version is in the key


def test_format_without_runtime_is_reported_not_dropped(tmp_path):
    """No runtime reads the fake method's format: plan and summary say so, the artifact is still built."""
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    data["evaluation"] = {"baseline": False, "perplexity": None, "throughput": {"input_len": 8, "output_len": 4}}
    path = write_recipe(tmp_path / "r.yaml", data)
    plan = qbuild("plan", path, "--store", tmp_path / "store", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["not_evaluated"] == [{"artifact": "a", "reason": "no runtime for fake"}]
    human = qbuild("plan", path, "--store", tmp_path / "store")
    assert "not evaluated: a: no runtime for fake" in " ".join(human.stdout.split())

    from qbuild import api

    result = api.run(path, store=tmp_path / "store")
    row = result.summary["variants"][0]
    assert row["status"] == "built" and row["not_evaluated"] == "no runtime for fake"
    assert result.exit_code == 0


def test_broken_plugin_is_one_line_exit_2(tmp_path):
    plugins = tmp_path / "plugins"
    info = plugins / "broken_plugin-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[qbuild.methods]\nbroken = not_a_module_anywhere:Nope\n")
    path = write_recipe(tmp_path / "r.yaml", yaml.safe_dump(fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])))
    env = {"PYTHONPATH": os.pathsep.join([str(plugins), os.environ["PYTHONPATH"]])}
    for args in (("validate", path), ("plan", path), ("schema",), ("plugins",), (path,)):
        res = qbuild(*args, env=env)
        assert res.returncode == 2, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "plugin 'broken'" in lines[0] and "broken-plugin" in lines[0], (args, res.stderr)


def test_the_example_imports_only_qbuild_plugins():
    """A plugin author needs one module of qbuild (issue 35): the example imports nothing else of it, nor pydantic."""
    import ast

    found = set()
    for path in (EXAMPLE / "qbuild_example").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
    assert {m for m in found if m.split(".")[0] in ("qbuild", "pydantic")} == {"qbuild.plugins"}
