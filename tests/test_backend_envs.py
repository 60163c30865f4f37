"""Backend environments (qbuild/envs/): real uv-created environments, a real gptqmodel GPTQ-format run in its
own environment, its output read back by transformers (through gptqmodel) in that environment, and the errors.

The environments live in one directory per test session (pytest's cache: reused by later sessions too), so the
gptqmodel environment is created at most once per CI run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from helpers import qbuild, run_api, write_recipe

pytestmark = pytest.mark.skipif(shutil.which("uv") is None and not (Path(sys.executable).parent / "uv").exists(),
                                reason="uv is not installed")


@pytest.fixture(scope="session")
def envs_dir(request) -> Path:
    root = Path(request.config.cache.mkdir("qbuild-envs"))
    old = os.environ.get("QBUILD_ENVS_DIR")
    os.environ["QBUILD_ENVS_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("QBUILD_ENVS_DIR", None)
    else:
        os.environ["QBUILD_ENVS_DIR"] = old


def recipe(tmp_path: Path, model: Path, variants: list[dict], name="envs", perplexity=True) -> Path:
    data = {"name": name, "model": {"source": "local", "path": str(model)},
            "calibration": {"sources": [{"type": "pydocs", "split": "train"}], "samples": 4, "seq_len": 64, "seed": 0},
            "variants": variants, "runtime": {"threads": 1}}
    if perplexity:
        data["evaluation"] = {"perplexity": {"dataset": {"sources": [{"type": "pydocs", "split": "test"}]},
                                             "protocol": "fixed-window", "context_length": 128, "max_windows": 2}}
    else:
        data["evaluation"] = {"perplexity": None, "baseline": False}
    return write_recipe(tmp_path / f"{name}.yaml", data)


def test_gptqmodel_runs_in_its_own_environment_and_transformers_reads_it_back(tmp_path, tiny_model_dir, envs_dir):
    from qbuild import envs
    from qbuild.artifacts.store import Store

    env = envs.backend("gptqmodel")
    # an interrupted creation (a directory without the completion marker) is redone, not trusted
    if not env.exists():
        env.directory.mkdir(parents=True, exist_ok=True)
        (env.directory / "half-written").write_text("x")
    r = recipe(tmp_path, tiny_model_dir, [{"name": "gptq-fmt", "method": "gptqmodel", "bits": 4, "group_size": 32}])
    code, summary = run_api(r, store=tmp_path / "store")
    assert code == 0, summary
    assert env.exists() and not (env.directory / "half-written").exists()
    row = {v["variant"]: v for v in summary["variants"]}
    base, gptq = row["baseline"], row["gptq-fmt"]
    assert gptq["format"] == "gptq" and gptq["status"] == "built"
    # real 4-bit weights, evaluated: close to the (2-layer, so poor) baseline but not identical
    assert math.isfinite(gptq["ppl"]) and gptq["ppl"] != base["ppl"] and 0.8 < gptq["ppl"] / base["ppl"] < 1.5

    store = Store(tmp_path / "store")
    out = store.object_dir(gptq["digest"])
    qc = json.loads((out / "quantize_config.json").read_text())
    assert (qc["quant_method"], qc["checkpoint_format"], qc["bits"], qc["group_size"]) == ("gptq", "gptq", 4, 32)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.qweight" in names and "model.layers.0.self_attn.q_proj.scales" in names

    manifest = store.manifest(gptq["digest"])
    tc = manifest["toolchain"]
    # the key holds the environment's versions, not qbuild's: gptqmodel 7.6.0 pins another numpy than ours
    assert tc["env"] == env.label and tc["gptqmodel"] == "7.6.0"
    assert tc["numpy"] == env.versions["numpy"] != metadata.version("numpy")

    # the evaluation ran in the gptqmodel environment: transformers loaded it through gptqmodel's kernels
    ppl_step = next(s for s in summary["steps"] if s["name"] == "perplexity[gptq-fmt]")
    ppl_manifest = store.manifest(ppl_step["digest"])
    runtime = json.loads((store.object_dir(ppl_step["digest"]) / "perplexity.json").read_text())["runtime"]
    assert runtime["quant_method"] == "gptq" and runtime["linear_class"].startswith("gptqmodel.")
    assert ppl_manifest["toolchain"]["env"] == env.label

    # a second run builds nothing
    code, again = run_api(r, store=tmp_path / "store")
    assert code == 0 and {s["status"] for s in again["steps"]} <= {"cached", "source"}


def test_environment_versions_enter_only_the_keys_of_steps_run_there(tmp_path, tiny_model_dir, envs_dir):
    from qbuild import api

    plain = recipe(tmp_path, tiny_model_dir, [{"name": "gptq-lc", "method": "gptq", "bits": 4, "group_size": 32}],
                   name="plain", perplexity=False)
    isolated = recipe(tmp_path, tiny_model_dir, [{"name": "gptq-lc", "method": "gptq", "bits": 4, "group_size": 32,
                                                  "env": "llm-compressor"}], name="isolated", perplexity=False)
    a = {p.step.name: p.step for p in api.plan(plain, store=tmp_path / "s").steps}
    b = {p.step.name: p.step for p in api.plan(isolated, store=tmp_path / "s").steps}
    assert a["calibrate"].key == b["calibrate"].key and a["model"].key == b["model"].key
    assert a["quantize[gptq-lc]"].key != b["quantize[gptq-lc]"].key
    assert a["quantize[gptq-lc]"].params == b["quantize[gptq-lc]"].params   # `env:` itself is not a quantization param
    assert b["quantize[gptq-lc]"].toolchain()["env"].startswith("llm-compressor@")
    assert b["quantize[gptq-lc]"].toolchain()["llmcompressor"] == "0.14.0.1"


def test_key_follows_the_resolved_versions(tmp_path):
    from qbuild.contract.envs import BackendEnv
    from qbuild.contract.step import Step

    def step(env):
        return Step("quantize", "quantize[x]", {"bits": 4}, "m:f", tools=("gptqmodel", "torch"), backend_env=env)

    old = BackendEnv("gptqmodel", "/e1/bin/python", "a" * 64, {"gptqmodel": "7.6.0", "torch": "2.13.0"})
    same = BackendEnv("gptqmodel", "/elsewhere/bin/python", "a" * 64, {"gptqmodel": "7.6.0", "torch": "2.13.0"})
    new = BackendEnv("gptqmodel", "/e2/bin/python", "b" * 64, {"gptqmodel": "7.7.0", "torch": "2.13.0"})
    assert step(old).key == step(same).key          # where it lives is not part of the key
    assert step(old).key != step(new).key
    assert step(new).toolchain()["gptqmodel"] == "7.7.0"


@pytest.mark.parametrize("env, field, message", [
    ({"python": "/nonexistent/bin/python"}, "variants[0].env", "does not exist"),
    ("no-such-backend", "variants[0].env", "unknown environment 'no-such-backend'"),
    ({"packages": ["qbuild-no-such-distribution-xyz==1.0"]}, "variants[0].env", "could not be resolved"),
])
def test_bad_environment_is_one_line_naming_the_field(tmp_path, tiny_model_dir, envs_dir, env, field, message):
    r = recipe(tmp_path, tiny_model_dir, [{"name": "v", "method": "gptq", "bits": 4, "group_size": 32, "env": env}],
               perplexity=False)
    proc = qbuild("plan", r, "--store", tmp_path / "store")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_method_without_environments_refuses_env(tmp_path, tiny_model_dir, envs_dir):
    r = recipe(tmp_path, tiny_model_dir, [{"name": "q", "method": "gguf", "type": "Q8_0", "env": "gptqmodel"}],
               perplexity=False)
    proc = qbuild("plan", r, "--store", tmp_path / "store")
    assert proc.returncode == 2 and "variants[0].env" in proc.stderr and "own environment only" in proc.stderr


def test_worker_import_error_in_an_interpreter_names_the_variant_and_environment(tmp_path, tiny_model_dir, envs_dir):
    # a bare interpreter (no pydantic, no torch): the worker cannot import qbuild's step module there
    bare = tmp_path / "bare"
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(bare)], check=True)
    r = recipe(tmp_path, tiny_model_dir, [{"name": "v", "method": "gptq", "bits": 4, "group_size": 32,
                                           "env": {"python": str(bare / "bin" / "python")}}], perplexity=False)
    proc = qbuild(r, "--store", tmp_path / "store", "--json")
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    failed = next(s for s in summary["steps"] if s["name"] == "quantize[v]")
    assert "ModuleNotFoundError" in failed["error"] and f"{bare}/bin/python" in failed["error"]
    assert "Traceback" not in proc.stderr


def test_env_cli_list_create_rm(tmp_path, monkeypatch):
    monkeypatch.setenv("QBUILD_ENVS_DIR", str(tmp_path / "envs"))
    half = tmp_path / "envs" / "gptqmodel-0123456789abcdef"
    half.mkdir(parents=True)
    listed = json.loads(qbuild("env", "list", "--json").stdout)
    assert "gptqmodel" in listed["builtin"]
    assert [(e["name"], e["complete"]) for e in listed["environments"]] == [("gptqmodel", False)]
    proc = qbuild("env", "create")
    assert proc.returncode == 2 and "name an environment" in proc.stderr
    proc = qbuild("env", "rm", "gptqmodel")
    assert proc.returncode == 0 and not half.exists()
    assert json.loads(qbuild("env", "list", "--json").stdout)["environments"] == []


@pytest.mark.slow   # a second real gptqmodel run (~80 s on 2 cores); the environment itself is proven by the test above,
# the AutoAWQ layout by tests/test_awq_gemm.py (CI's 45 minutes)
def test_awq_gemm_checkpoint_is_evaluated_by_transformers_through_gptqmodel(tmp_path, tiny_model_dir, envs_dir):
    from qbuild.artifacts.store import Store

    r = recipe(tmp_path, tiny_model_dir, [{"name": "awq-gemm", "method": "awq", "bits": 4, "group_size": 32,
                                           "checkpoint_format": "autoawq"}])
    code, summary = run_api(r, store=tmp_path / "store")
    assert code == 0, summary
    row = {v["variant"]: v for v in summary["variants"]}
    assert row["awq-gemm"]["format"] == "awq" and 0.8 < row["awq-gemm"]["ppl"] / row["baseline"]["ppl"] < 1.5
    step = next(s for s in summary["steps"] if s["name"] == "perplexity[awq-gemm]")
    runtime = json.loads((Store(tmp_path / "store").object_dir(step["digest"]) / "perplexity.json").read_text())["runtime"]
    assert runtime["quant_method"] == "awq" and "Awq" in runtime["linear_class"]


def test_gptqmodel_group_size_refusal_offers_only_what_the_method_has(tmp_path, tiny_model_dir):
    r = recipe(tmp_path, tiny_model_dir, [{"name": "g", "method": "gptqmodel", "bits": 4, "group_size": 128}],
               perplexity=False)
    proc = qbuild("plan", r, "--store", tmp_path / "store")
    assert proc.returncode == 2 and "variants[0].group_size" in proc.stderr and "(32, 64)" in proc.stderr
    assert "on_indivisible" not in proc.stderr and "ignore" not in proc.stderr   # gptqmodel has neither field


def test_offline_creation_from_a_local_wheelhouse(tmp_path, monkeypatch):
    """No index and an empty uv cache: the environment is resolved and created from the wheelhouse alone, and a
    step (the torch-free test method) runs in it."""
    from helpers import fake_model

    wheels = tmp_path / "wheels"
    download = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d",
                               str(wheels), "click", "pydantic", "pyyaml", "rich", "filelock", "six"],
                              capture_output=True, text=True)
    if download.returncode != 0:
        pytest.skip(f"no package index to fill the wheelhouse from: {download.stderr.strip()[-200:]}")
    for var, value in (("UV_OFFLINE", "1"), ("UV_FIND_LINKS", str(wheels)), ("UV_CACHE_DIR", str(tmp_path / "uv")),
                       ("QBUILD_ENVS_DIR", str(tmp_path / "envs"))):
        monkeypatch.setenv(var, value)
    r = write_recipe(tmp_path / "r.yaml", {
        "name": "offline", "model": {"source": "local", "path": str(fake_model(tmp_path))},
        "variants": [{"name": "v", "method": "fake", "env": {"packages": ["six"]}}],
        "evaluation": {"perplexity": None, "baseline": False}})
    proc = qbuild(r, "--store", tmp_path / "store", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    step = next(s for s in json.loads(proc.stdout)["steps"] if s["name"] == "quantize[v]")
    assert step["status"] == "built"
    listed = json.loads(qbuild("env", "list", "--json").stdout)["environments"]
    assert [(e["name"], e["complete"]) for e in listed] == [("custom", True)]
    python = Path(listed[0]["dir"]) / "bin" / "python"
    six = subprocess.run([str(python), "-c", "import six, sys; print(six.__file__)"], capture_output=True, text=True)
    assert six.returncode == 0 and listed[0]["dir"] in six.stdout
    assert any(w.name.startswith("six-") for w in wheels.iterdir())
