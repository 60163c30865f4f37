"""Plan-time memory check (qbuild.pipeline.memory_fit): a step that cannot fit is refused in one line before anything
is built; the model's size is read from its config the way transformers counts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from qbuild.contract.step import PlanStatus
from qbuild.errors import RecipeError
from qbuild.pipeline import memory_fit
from qbuild.pipeline.plan import PlannedStep, build_steps
from qbuild.planning.recipe import load_recipe
from tests.helpers import qbuild
from tests.model_families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_parameter_count_from_the_config_matches_transformers(family):
    """Each family's parameters as transformers builds the model (on the meta device: no memory), within 2 %
    (norms and MoE routers are left out of the estimate)."""
    from accelerate import init_empty_weights

    from tests.model_families import BY_NAME

    model_class, cfg = BY_NAME[family].make()
    with init_empty_weights():
        model = model_class(cfg)
    model.tie_weights()
    counted = sum(p.numel() for p in model.parameters())
    size = memory_fit.model_size(cfg.to_dict())
    assert size is not None
    assert abs(size.parameters - counted) / counted < 0.02, (size.parameters, counted)
    assert size.experts == (family in ("qwen3-moe", "mixtral"))


def test_an_8b_llama_config_is_sized_like_the_real_one():
    """Llama-3.1-8B's published shape: 8.03B parameters, 16.06 GB in bf16."""
    cfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
    size = memory_fit.model_size(cfg)
    assert 8.0e9 < size.parameters < 8.05e9
    assert size.layer * 32 + size.outside == size.total


def _planned(recipe_name: str, status: PlanStatus):
    recipe = load_recipe(ROOT / "recipes" / recipe_name)
    ctx = build_steps(recipe, ROOT / "recipes")
    return ctx, recipe, [PlannedStep(s, status) for s in ctx.steps]


def test_a_step_to_build_that_does_not_fit_is_refused_and_stored_ones_are_not(monkeypatch):
    """bitsandbytes quantizes the whole model in memory: refused where it cannot fit, unless it is stored."""
    ctx, recipe, misses = _planned("methods-extra.yaml", PlanStatus.MISS)
    monkeypatch.setenv("QBUILD_MEMORY_GB", "1.5")
    with pytest.raises(RecipeError) as err:
        memory_fit.check_memory(misses, ctx.model_info(), ctx.model().source_path, recipe.variants)
    assert err.value.field.startswith("variants[") and "loads the whole model" in err.value.message
    assert "QBUILD_MEMORY_GB gives 1.5 GB" in err.value.message
    _, _, hits = _planned("methods-extra.yaml", PlanStatus.HIT)     # everything stored: nothing to hold in memory
    assert memory_fit.check_memory(hits, ctx.model_info(), ctx.model().source_path, recipe.variants) == []
    monkeypatch.setenv("QBUILD_MEMORY_GB", "64")
    assert memory_fit.check_memory(misses, ctx.model_info(), ctx.model().source_path, recipe.variants) == []


def test_llm_compressor_steps_that_do_not_fit_are_offloaded_not_refused(monkeypatch):
    ctx, recipe, misses = _planned("methods.yaml", PlanStatus.MISS)
    # ModelOpt's NVFP4 would be refused, and so would RTN and FP8 dynamic, which read one shard at a time and never
    # offload (the demo model is one 0.5 GB fp32 file)
    misses = [p for p in misses if p.step.memory not in ("whole-model", "shard-streamed")]
    monkeypatch.setenv("QBUILD_MEMORY_GB", "1.5")
    warnings = memory_fit.check_memory(misses, ctx.model_info(), ctx.model().source_path, recipe.variants)
    gptq = [w for w in warnings if w.startswith("quantize[gptq-w4g64]")]
    assert len(gptq) == 1 and "offloaded to disk" in gptq[0]


def test_modelopt_on_cpu_is_sized_in_fp32_and_its_hf_fp8_offloads(monkeypatch):
    """ModelOpt calibrates an fp32 copy on CPU: twice what a whole-model quantizer of the 16-bit checkpoint holds. FP8
    with the HF export offloads to disk instead of being refused; the FP4 schemes load on CUDA in the export dtype."""
    from types import SimpleNamespace

    from qbuild.quantize.modelopt import ModelOptVariant
    from qbuild.quantize.modelopt.method import memory_kind

    def kind(**options):
        return memory_kind(ModelOptVariant(name="v", method="modelopt", **options))

    assert kind(scheme="fp8", export="hf") == kind(scheme="none", export="hf") == "offloads-to-disk"
    assert kind(scheme="fp8") == kind(scheme="int8-sq", export="hf") == kind(scheme="int4-awq") == "whole-model-fp32"
    assert kind(scheme="nvfp4") == "whole-model"
    size = memory_fit.ModelSize(total=16 * memory_fit.GB, outside=2 * memory_fit.GB, layer=memory_fit.GB // 2,
                                parameters=8_000_000_000, experts=False)
    fp32 = memory_fit.step_memory(SimpleNamespace(kind="quantize", memory="whole-model-fp32"), size, False)
    whole = memory_fit.step_memory(SimpleNamespace(kind="quantize", memory="whole-model"), size, False)
    assert fp32[0] - memory_fit.QUANTIZER_OVERHEAD == pytest.approx(2 * (whole[0] - memory_fit.QUANTIZER_OVERHEAD))
    assert "in fp32" in fp32[1]


def test_qbuild_plan_refuses_in_one_line_before_building(tmp_path):
    store = tmp_path / "store"
    out = qbuild("plan", ROOT / "recipes" / "demo.yaml", "--store", store, env={"QBUILD_MEMORY_GB": "0.3"})
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("qbuild: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    # the first step in plan order that cannot fit: the import itself (step `model`), which dequantizes in memory
    assert "model: model needs about" in errors[0] and "dequantizes the GGUF" in errors[0]
    assert not (store / "objects").exists() or not any((store / "objects").iterdir())


def test_machine_memory_is_the_ram_or_the_declared_budget(monkeypatch):
    monkeypatch.delenv("QBUILD_MEMORY_GB", raising=False)
    total, where = memory_fit.machine_memory()
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    ram = int(meminfo["MemTotal"].split()[0]) * 1024
    assert total <= ram and total > ram / 64 and where
    monkeypatch.setenv("QBUILD_MEMORY_GB", "2")
    assert memory_fit.machine_memory() == (2 << 30, "QBUILD_MEMORY_GB")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_machine_memory_is_the_limit_of_the_memory_cgroup_the_process_is_in(tmp_path, monkeypatch, version):
    """A job in a memory cgroup (v1 or v2, at its own path): its limit, not the machine's RAM, sizes the steps."""
    monkeypatch.delenv("QBUILD_MEMORY_GB", raising=False)
    root = tmp_path / "sys-fs-cgroup"
    if version == "v1":
        group = root / "memory" / "jobs" / "q1"
        proc = "12:cpuset:/\n4:memory:/jobs/q1\n1:name=systemd:/\n"
        limit = "memory.limit_in_bytes"
    else:
        group = root / "jobs" / "q1"
        proc = "0::/jobs/q1\n"
        limit = "memory.max"
    group.mkdir(parents=True)
    (group / limit).write_text(str(3 << 30))
    (tmp_path / "cgroup").write_text(proc)
    assert memory_fit.machine_memory(tmp_path / "cgroup", root) == (3 << 30, f"this cgroup's {limit}")
    (group / limit).write_text("max" if version == "v2" else str(1 << 62))   # no limit: the RAM
    assert memory_fit.machine_memory(tmp_path / "cgroup", root)[1] == "this machine's RAM"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_an_enclosing_cgroups_limit_bounds_a_process_nested_below_it(tmp_path, monkeypatch, version):
    """Slurm / systemd nesting: the job's cgroup has the limit, the process sits in job/step/task below it, whose
    own limits say "max". The tightest limit on the way up sizes the steps."""
    monkeypatch.delenv("QBUILD_MEMORY_GB", raising=False)
    root = tmp_path / "sys-fs-cgroup"
    base, limit, none = (root / "memory", "memory.limit_in_bytes", str(1 << 62)) if version == "v1" else \
        (root, "memory.max", "max")
    task = base / "job_1" / "step_0" / "task_0"
    task.mkdir(parents=True)
    for level in (task, task.parent):
        (level / limit).write_text(none)
    (task.parent.parent / limit).write_text(str(4 << 30))
    (base / "job_1" / "step_0" / "other").mkdir()   # a sibling's limit is not ours
    (base / "job_1" / "step_0" / "other" / limit).write_text(str(1 << 30))
    proc = "4:memory:/job_1/step_0/task_0\n" if version == "v1" else "0::/job_1/step_0/task_0\n"
    (tmp_path / "cgroup").write_text(proc)
    assert memory_fit.machine_memory(tmp_path / "cgroup", root) == (4 << 30, f"the enclosing cgroup job_1's {limit}")
    (task / limit).write_text(str(2 << 30))   # the tightest wins, wherever it is
    assert memory_fit.machine_memory(tmp_path / "cgroup", root) == (2 << 30, f"this cgroup's {limit}")


def _plan_rows(tmp_path, recipe: str, fake_gpu: str) -> dict[str, str]:
    import json

    out = qbuild("plan", ROOT / "recipes" / recipe, "--store", tmp_path / "store", "--json",
                 env={"QBUILD_FAKE_GPU": fake_gpu})
    assert out.returncode == 0, out.stderr
    return {r["step"]: r["device"] for r in json.loads(out.stdout)["steps"]}


def test_the_plan_says_which_device_each_step_uses(tmp_path):
    """On a machine with a GPU (device: auto), evaluation through transformers or llama.cpp runs there; llama.cpp's
    converter and quantizer run on the CPU. Without one every step is on the CPU."""
    h100 = "NVIDIA H100 80GB HBM3:9.0:550.54.15"
    gpu = _plan_rows(tmp_path, "demo.yaml", h100)
    assert gpu["reference[baseline]"] == gpu["perplexity[q4km]"] == gpu["import-check"] == "cuda", gpu
    assert gpu["quantize[q4km]"] == gpu["gguf-convert[f16]"] == gpu["eval-data"] == "cpu", gpu
    none = _plan_rows(tmp_path, "demo.yaml", "none")
    assert set(none.values()) == {"cpu"} and none.keys() == gpu.keys()
    table = qbuild("plan", ROOT / "recipes" / "demo.yaml", "--store", tmp_path / "store", env={"QBUILD_FAKE_GPU": h100})
    assert "device" in table.stdout and "cuda" in table.stdout, table.stdout
    cpu_only = qbuild("plan", ROOT / "recipes" / "demo.yaml", "--store", tmp_path / "store",
                      env={"QBUILD_FAKE_GPU": "none"})
    assert "every step runs on the CPU" in cpu_only.stdout and "cuda" not in cpu_only.stdout


def test_llm_compressor_steps_use_the_gpu_the_plan_gives_them(tmp_path, monkeypatch):
    """llm-compressor onloads each layer to the GPU whenever torch sees one, so its steps are on `cuda` in the plan
    of a GPU machine; a step whose recipe says `device: cpu` is kept on the CPU: the library's onload device is
    replaced for its oneshot call (checked on an H200 by tests/gpu/test_torch_cuda_gpu.py)."""
    import torch
    from llmcompressor.pipelines.data_free import pipeline as data_free
    from llmcompressor.pipelines.sequential import pipeline as sequential

    from qbuild.contract.step import StepContext
    from qbuild.quantize.llmcompressor.run import onload_to_cpu

    gpu = _plan_rows(tmp_path, "methods.yaml", "NVIDIA H100 80GB HBM3:9.0:550.54.15")
    assert gpu["quantize[gptq-w4g64]"] == gpu["quantize[rtn-w4g64]"] == gpu["quantize[fp8-static]"] == "cuda", gpu
    assert gpu["quantize[q4km]"] == "cpu"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ctx = {d: StepContext({}, {}, {}, tmp_path, 1, d, "quantize[x]") for d in ("auto", "cuda", "cpu")}
    assert [ctx[d].torch_device() for d in ("auto", "cuda", "cpu")] == ["cuda", "cuda", "cpu"]
    # the names the pipelines look the device up by: if llm-compressor moves them, the override must not go quiet
    assert callable(sequential.get_main_device) and callable(data_free.get_main_device)
    monkeypatch.setattr(sequential, "get_main_device", lambda: torch.device("cuda"))
    with onload_to_cpu():
        assert sequential.get_main_device() == data_free.get_main_device() == torch.device("cpu")
    assert sequential.get_main_device() == torch.device("cuda")


def test_llama_cpp_offloads_the_layers_that_fit_the_gpu():
    """A GGUF larger than the GPU's free memory (a 70B F16 on an 80 GB card) goes partly on the GPU: as many of its
    layers as fit beside the runtime's reserve, read from the file's own block count; a file that fits goes whole."""
    from qbuild.runtimes.llamacpp import GPU_RESERVE, gguf_block_count, gpu_layers
    from tests.conftest import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    size = gguf.stat().st_size
    assert gguf_block_count(gguf) == 30   # SmolLM2-135M
    assert gpu_layers(gguf, free=size + int(GPU_RESERVE)) == -1
    assert gpu_layers(gguf, free=int(GPU_RESERVE) + size // 2) == 15   # half the file: half of 31 slices
    assert gpu_layers(gguf, free=int(GPU_RESERVE) // 2) == 0
