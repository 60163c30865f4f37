"""Every recipe shipped in recipes/ plans (schema, files, backends) and states in its header how long it takes
on a 2-core machine (issue 25: a user who starts one knows when it ends); the methods recipes share their
model import, calibration and evaluation data, so after recipes/methods.yaml those steps of the others are hits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import qbuild

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = sorted(RECIPES.glob("[!.]*.yaml"))   # not a bench's hidden temporary copy


def planned(recipe: Path, store: Path) -> list[dict]:
    res = qbuild("plan", recipe, "--store", store, "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)["steps"]


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))])


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_plans_and_states_its_time(recipe, tmp_path):
    assert planned(recipe, tmp_path / "store"), f"{recipe.name} plans no steps"
    stated = re.search(r"^# TIME: .*?\b\d+(\.\d+)? ?(s|min|h|hours?|minutes?)\b", header(recipe), re.M)
    assert stated, f"{recipe.name}: its header has no '# TIME: <measured time>' line"


def test_methods_recipes_share_model_calibration_and_evaluation_data(tmp_path):
    shared = ("import-gguf", "calibrate", "eval-data", "reference")
    keys = {name: {(s["kind"], s["key"]) for s in planned(RECIPES / name, tmp_path / "store") if s["kind"] in shared}
            for name in ("methods.yaml", "methods-extra.yaml", "autoround-full.yaml")}
    assert {kind for kind, _ in keys["methods.yaml"]} == set(shared)
    assert keys["methods-extra.yaml"] == keys["methods.yaml"] == keys["autoround-full.yaml"]
