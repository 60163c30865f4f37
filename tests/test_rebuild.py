"""`qbuild verify --rebuild`: stored steps re-executed in scratch, compared file by file, the result recorded."""

from __future__ import annotations

import json
import os

import pytest

from helpers import fake_recipe, qbuild, write_recipe


def _tree_state(root):
    """Every file under root with its bytes' mtime and size: what must not change."""
    return {p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in root.rglob("*") if p.is_file()}


def test_rebuild_says_identical_or_names_the_differing_files(tmp_path):
    data = fake_recipe(tmp_path, [{"name": "steady", "method": "fake", "level": 2},
                                  {"name": "noisy", "method": "fake", "level": 3, "noise": True}])
    store = tmp_path / "store"
    data["store"] = {"path": str(store)}
    recipe = write_recipe(tmp_path / "r.yaml", data)
    assert qbuild("run", recipe).returncode == 0
    objects_before = _tree_state(store / "objects")

    res = qbuild("verify", "--rebuild", recipe, "--json")
    assert res.returncode == 1, res.stderr            # one step is not reproducible: a nightly job sees it
    out = json.loads(res.stdout)
    rows = {r["step"]: r for r in out["steps"]}
    assert rows["quantize[steady]"]["status"] == "identical"
    assert rows["quantize[steady]"]["files_differ"] == []
    noisy = rows["quantize[noisy]"]
    assert noisy["status"] == "different"
    assert [f["path"] for f in noisy["files_differ"]] == ["noise.bin"]   # weights.bin is the same, only the noise
    assert noisy["files_differ"][0]["stored_sha256"] != noisy["files_differ"][0]["rebuilt_sha256"]
    assert out["checked"] == 2 and out["identical"] is False
    # the stored objects were never touched, and the scratch is gone
    assert _tree_state(store / "objects") == objects_before
    assert not [p for p in (store / "tmp").iterdir() if p.name.startswith("rebuild-")]

    # the last check is recorded beside the object and shown with its manifest
    shown = json.loads(qbuild("show", "t/steady", "--store", store).stdout)
    assert shown["rebuild_check"]["status"] == "identical"
    assert shown["rebuild_check"]["where"] == os.uname().nodename
    shown = json.loads(qbuild("show", "t/noisy", "--store", store).stdout)
    assert shown["rebuild_check"]["status"] == "different"

    # a ref alone: found through the recipe its manifest names
    res = qbuild("verify", "--rebuild", "t/steady", "--store", store)
    assert res.returncode == 0, res.stderr
    assert "IDENTICAL" in res.stdout and "all identical" in res.stdout


def test_rebuild_of_a_step_whose_recipe_is_gone_is_one_line(tmp_path):
    data = fake_recipe(tmp_path, [{"name": "a", "method": "fake"}])
    store = tmp_path / "store"
    data["store"] = {"path": str(store)}
    recipe = write_recipe(tmp_path / "r.yaml", data)
    assert qbuild("run", recipe).returncode == 0
    recipe.unlink()
    res = qbuild("verify", "--rebuild", "t/a", "--store", store)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "give the recipe file instead" in res.stderr


def test_a_recipe_can_require_a_rebuild_check_of_chosen_steps(tmp_path):
    """runtime.rebuild_check: the named steps are re-executed right after the run; one that is not bit-identical
    fails the run like a gate (exit 3), naming the step."""
    data = fake_recipe(tmp_path, [{"name": "steady", "method": "fake", "level": 2},
                                  {"name": "noisy", "method": "fake", "level": 3, "noise": True}],
                       runtime={"rebuild_check": ["quantize[steady]"]})
    data["store"] = {"path": str(tmp_path / "store")}
    res = qbuild("run", write_recipe(tmp_path / "r.yaml", data), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert [r["step"] for r in summary["rebuild_check"]["steps"]] == ["quantize[steady]"]
    assert summary["gates"]["passed"] is True

    data["runtime"]["rebuild_check"] = ["quantize"]      # a kind: every quantize step
    res = qbuild("run", write_recipe(tmp_path / "r.yaml", data), "--json")
    assert res.returncode == 3, res.stderr
    summary = json.loads(res.stdout)
    failed = [g for g in summary["gates"]["checks"] if not g["passed"]]
    assert [(g["variant"], g["check"]) for g in failed] == [("quantize[noisy]", "rebuild_identical")]


@pytest.mark.slow   # a real server swept twice (run, then verify --rebuild): 141 s (CI's 45 min)
def test_rebuild_of_a_serving_recipe_leaves_its_timings_out(tmp_path, tiny_model_dir):
    """A recipe with evaluation.serving (a real llama-server sweep): `verify --rebuild` re-executes its other steps,
    lists the serving step as not rebuilt (a timing, like throughput) and exits 0 (it re-ran the sweep, whose
    numbers are never the same bytes, and exited 1)."""
    from qbuild.models.llamacpp_toolchain import cached_bin_dir

    if cached_bin_dir() is None:
        pytest.skip("llama-server is not built yet (scripts/install.sh builds it)")
    store = tmp_path / "store"
    data = {"name": "srv", "model": {"source": "local", "path": str(tiny_model_dir)},
            "variants": [{"name": "q8_0", "method": "gguf", "type": "Q8_0"}],
            "evaluation": {"baseline": False, "perplexity": None,
                           "serving": {"concurrency": [1], "requests": 2, "warmup": 1, "input_len": 16,
                                       "output_len": 4, "variants": ["q8_0"]}},
            "runtime": {"threads": 1}, "store": {"path": str(store)}}
    recipe = write_recipe(tmp_path / "r.yaml", data)
    res = qbuild("run", recipe, "--json")
    assert res.returncode == 0, res.stderr
    assert {s["name"]: s["status"] for s in json.loads(res.stdout)["steps"]}["serving[q8_0@default]"] == "built"

    res = qbuild("verify", "--rebuild", recipe, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    rows = {r["step"]: r for r in out["steps"]}
    assert rows["serving[q8_0@default]"]["status"] == "not checked"
    assert rows["serving[q8_0@default]"]["reason"].startswith("a timing")
    assert out["timings_not_rebuilt"] == ["serving[q8_0@default]"]
    assert rows["quantize[q8_0]"]["status"] == "identical" and out["identical"] is True
    human = qbuild("verify", "--rebuild", recipe)
    assert human.returncode == 0
    assert "NOT CHECKED   serving[q8_0@default]: a timing" in human.stdout
    assert "all identical; 1 timing step(s) not rebuilt" in human.stdout
