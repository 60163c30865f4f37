"""Recipe validation: one clear line naming the field, the bad value, what is allowed, and the line."""

from __future__ import annotations

import json

import pytest

from qbuild.errors import MissingBackendError, RecipeError
from qbuild.planning.recipe import load_recipe

from helpers import fake_model, fake_recipe, qbuild, write_recipe

GOOD = """\
name: demo
model:
  source: local
  path: {model}
variants:
  - name: f16
    method: gguf
    type: F16
  - name: q8
    method: gguf
    type: q8_0
"""


@pytest.fixture
def model_dir(tmp_path):
    return fake_model(tmp_path)


def _error(tmp_path, text) -> RecipeError:
    path = write_recipe(tmp_path / "r.yaml", text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return info.value


def test_valid_recipe_fills_defaults(tmp_path, model_dir):
    r = load_recipe(write_recipe(tmp_path / "r.yaml", GOOD.format(model=model_dir)))
    assert [v.name for v in r.variants] == ["f16", "q8"]
    assert r.variants[1].type == "Q8_0"  # normalized
    assert r.evaluation.perplexity.context_length == 512
    assert r.store.path == "./artifacts"
    assert r.runtime.threads == "auto"


def test_unknown_key_names_field_and_line(tmp_path, model_dir):
    text = GOOD.format(model=model_dir).replace("    type: q8_0", "    type: q8_0\n    bitz: 4")
    err = _error(tmp_path, text)
    assert err.field == "variants[1].bitz"
    assert err.line == 12
    assert "unknown key" in str(err) and "r.yaml:12" in str(err)


def test_bad_gguf_type_lists_allowed(tmp_path, model_dir):
    err = _error(tmp_path, GOOD.format(model=model_dir).replace("type: q8_0", "type: Q9_K"))
    assert err.field == "variants[1].type"
    assert err.line == 11
    assert "'Q9_K'" in err.message and "Q4_K_M" in err.message


def test_typo_in_method_name(tmp_path, model_dir):
    err = _error(tmp_path, GOOD.format(model=model_dir).replace("method: gguf\n    type: F16", "method: ggfu\n    type: F16"))
    assert err.field == "variants[0].method"
    assert err.line == 7
    assert "'ggfu'" in err.message and "'gguf'" in err.message


def test_duplicate_variant_names(tmp_path, model_dir):
    err = _error(tmp_path, GOOD.format(model=model_dir).replace("name: q8", "name: f16"))
    assert err.field == "variants"
    assert "used twice" in err.message


def test_yaml_syntax_error_has_line(tmp_path, model_dir):
    err = _error(tmp_path, GOOD.format(model=model_dir) + "  - name: [unclosed\n")
    assert err.line is not None and err.line >= 12
    assert "invalid YAML" in err.message


def test_missing_backend_names_extra():
    from qbuild.quantize.gguf import GGUF

    class NotInstalled(GGUF):
        requires = ("definitely_not_installed_mod",)

    with pytest.raises(MissingBackendError) as info:
        NotInstalled.require("variants[0].method", "method 'gguf'")
    assert "pip install 'qbuild[gguf]'" in str(info.value)
    assert "variants[0].method" in str(info.value) and "definitely_not_installed_mod" in str(info.value)


def test_a_step_whose_package_is_not_installed_stops_the_run_before_any_work(tmp_path, monkeypatch):
    """Like the demo's task evaluation once did without lm-eval (the demo's install lacked it): plan says which step
    needs which package and the extra that installs it, and run exits 2 in one line before building anything."""
    from click.testing import CliRunner

    from qbuild.base.fingerprint import install_hint
    from qbuild.cli import cli
    from qbuild.pipeline import plan

    assert install_hint(["lm_eval"]) == "pip install 'qbuild[tasks]'"   # the extra, from qbuild's own metadata
    assert install_hint(["bitsandbytes", "no-such-dist"]) == "pip install 'qbuild[bitsandbytes]' no-such-dist"
    real = plan.package_version
    monkeypatch.setattr(plan, "package_version", lambda d: "absent" if d == "pydantic" else real(d))
    path = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    store = tmp_path / "s"
    res = CliRunner().invoke(cli, ["plan", str(path), "--store", str(store), "--json"])
    assert res.exit_code == 0, res.output
    row = {r["step"]: r for r in json.loads(res.output)["steps"]}["quantize[a]"]
    assert row["status"] == "unavailable"
    assert row["reason"] == "needs pydantic, not installed here (pip install pydantic)"
    res = CliRunner().invoke(cli, ["run", str(path), "--store", str(store)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "step quantize[a]: needs pydantic" in res.output and "on_missing_gpu" not in res.output
    assert not list(store.glob("objects/*/*"))


def test_cli_validate_errors_are_one_line_exit_2(tmp_path, model_dir):
    path = write_recipe(tmp_path / "bad.yaml", GOOD.format(model=model_dir).replace("type: F16", "type: F17"))
    res = qbuild("validate", path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "bad.yaml:8: variants[0].type" in lines[0]
    assert "Traceback" not in res.stderr


def test_cli_missing_model_dir_is_user_error(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", GOOD.format(model=tmp_path / "absent"))
    res = qbuild("plan", path)
    assert res.returncode == 2
    assert "r.yaml:4: model.path" in res.stderr and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_missing_recipe_file(tmp_path):
    res = qbuild(tmp_path / "nothing.yaml")
    assert res.returncode == 2
    assert "recipe file not found" in res.stderr


def test_schema_is_json_schema_with_variants():
    res = qbuild("schema")
    assert res.returncode == 0
    schema = json.loads(res.stdout)
    assert "variants" in schema["properties"]
    assert "additionalProperties" in json.dumps(schema)
