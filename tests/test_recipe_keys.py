"""Every shipped recipe plans to the same step keys as the committed record (tests/data/recipe_keys.json), so
moving code between modules and packages (issue 35) cannot change a key unnoticed. A runner's dotted name is not
hashed (qbuild's Step key is kind, params, input keys and toolchain), which is why modules can move at all.

The toolchain (installed versions, hardware, GPU facts, a backend environment's lock) differs between machines and
venvs and is what keys are meant to follow, so the record is made with those values pinned: what it holds is
everything the code decides (kinds, params, inputs, which tools and facts enter). Regenerate deliberately with
`python tests/test_recipe_keys.py` when an issue changes keys on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "recipe_keys.json"
# its model file is fetched by the user (see the recipe's header), not shipped with the repository
NOT_PLANNABLE_HERE = {"gemma3-270m.yaml"}
RECIPES = sorted(p for p in (ROOT / "recipes").glob("[!.]*.yaml") if p.name not in NOT_PLANNABLE_HERE)


def pinned_toolchain(step) -> dict[str, str]:
    tc = {t: "pinned" for t in step.tools}
    if step.backend_env is not None:
        tc["env"] = step.backend_env.name
    if step.per_hardware:
        tc["hw"] = "pinned"
    tc.update({k: "pinned" for k in step.env_toolchain})
    return tc


def planned_keys(recipe: Path, store: Path) -> dict[str, str]:
    import qbuild
    from qbuild.contract.step import Step

    original = Step.toolchain
    Step.toolchain = pinned_toolchain
    try:
        plan = qbuild.plan(recipe, store=store, estimate=False)
    finally:
        Step.toolchain = original
    return {p.step.name: p.step.key for p in plan.steps}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_plans_to_the_recorded_keys(recipe, tmp_path):
    recorded = json.loads(RECORD.read_text())[recipe.name]
    assert planned_keys(recipe, tmp_path / "store") == recorded


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:   # a store of its own per recipe, as the test plans each
        RECORD.write_text(json.dumps({r.name: planned_keys(r, Path(d) / r.stem / "store") for r in RECIPES},
                                     indent=1, sort_keys=True) + "\n")
