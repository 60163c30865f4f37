"""What the llm-compressor methods (gptq, awq, fp8, rtn) share: recipe fields, the plan step, the runner.

Each method is its own module (gptq.py, awq.py, fp8.py, rtn.py) with a `LLMCompressorMethod`
subclass that declares its options and turns its params into llm-compressor modifiers; this module
runs `oneshot` on the shared calibration set and saves a compressed-tensors HF directory (vLLM,
SGLang and transformers load it). A data-free scheme (RTN, FP8 dynamic) runs llm-compressor's `model_free_ptq`
instead, one safetensors shard at a time, so its memory is a shard's, not the model's (an 8B or 70B quantizes on a
24 GB machine), with the same quantized tensors. Nothing here imports torch or llm-compressor at module level.
"""

from __future__ import annotations

import contextlib
import json
import os
from abc import abstractmethod
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from qbuild.base.files import dir_size
from qbuild.contract.formats import HF_RUNTIMES, FormatSpec, register_format
from qbuild.contract.plugin import Method
from qbuild.contract.shapes import UnsupportedFamily, check_group_size, check_module_patterns
from qbuild.contract.step import Step, StepContext, runner_of
from qbuild.contract.variant import VariantBase, group_size_value

# distributions whose versions enter the key of a quantize step
TOOLS = ("llmcompressor", "compressed-tensors", "torch", "transformers", "safetensors")
# variant fields holding compressed-tensors module patterns (exact names or 're:' regexes): each must match a module
PATTERN_FIELDS = ("ignore", "targets")

# The llm-compressor methods' format (ct_search's mixes and AutoRound's llm_compressor export write it too). Which
# engines load it depends on the scheme: vLLM and SGLang (CompressedTensorsWNA16) and TGI (WNA16Loader) take 4- and
# 8-bit integer weights, with or without zero points; LMDeploy's TurboMind reads llm-compressor W4A16 only at group
# sizes 32 and 128, so it is left out
_INT_WEIGHTS = ("vllm", "sglang", "tgi", "transformers")
COMPRESSED_TENSORS = register_format(FormatSpec(
    "compressed-tensors", "HF checkpoint with compressed-tensors quantization (llm-compressor)",
    load_tools=("compressed-tensors",), evaluated_by=HF_RUNTIMES,
    loads_in=("transformers",),                      # transformers decompresses any scheme
    loads_in_by_scheme=(
        ("w4a16", _INT_WEIGHTS),
        ("w8a16", _INT_WEIGHTS),
        ("w3a16", ("transformers",)),                # the serving kernels take 4 and 8 bits only
        ("w2a16", ("transformers",)),
        # W8A8 INT8 (SmoothQuant + RTN/GPTQ): vLLM's int8 scaled-mm kernels (CUDA, and CPUInt8ScaledMMLinearKernel in
        # its CPU build, served here) and SGLang's CompressedTensorsW8A8Int8
        ("w8a8-int8", ("vllm", "sglang", "transformers")),
        ("fp8-dynamic", ("vllm", "sglang", "tgi", "transformers", "trtllm-pytorch")),
        ("fp8-static", ("vllm", "sglang", "tgi", "transformers")),   # TensorRT-LLM's PyTorch backend: no
    ))).name

# Architectures whose llm-compressor checkpoints qbuild cannot evaluate, found by the architecture matrix
# (tests/test_architectures.py, docs/architectures.md): the methods below declare them (Method.unsupported_families)
ASYMMETRIC_QWEN3_MOE = UnsupportedFamily(
    "qwen3_moe",
    "transformers (5.x) cannot load an asymmetric compressed-tensors checkpoint of Qwen3-MoE's fused experts: its "
    "DecompressExperts step fails on the zero points, so the artifact could not be evaluated; sym: true "
    "(no zero point) loads",
    variant_condition="sym is false (AWQ's default)",
    variant_applies=lambda option: option("sym", True) is False)
MIXTRAL_EXPERTS = UnsupportedFamily(
    "mixtral",
    "llm-compressor writes Mixtral's experts one module each (block_sparse_moe.experts.N), and transformers 5 "
    "reads Mixtral's experts fused (mlp.experts.gate_up_proj): it leaves them at random (KLD 1.07-1.10 against "
    "the baseline for every scheme on the matrix's tiny Mixtral, FP8 included), so qbuild cannot evaluate the "
    "checkpoint")


class IntWeightVariant(VariantBase):
    """Fields of the integer weight-only schemes (W{bits}A16, grouped)."""

    bits: Literal[2, 3, 4, 8] = Field(4, description="Weight bits.")
    group_size: int | None = Field(
        128, description="Columns per scale/zero group; null or -1 = one scale per output channel.")
    sym: bool = Field(True, description="Symmetric (no zero point). Asymmetric is often more accurate; "
                                        "check that your serving kernel supports zero points.")
    ignore: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="Modules kept in full precision: exact module names or 're:<regex>' (compressed-tensors rules).")
    on_indivisible: Literal["error", "ignore"] = Field(
        "error", description="When group_size does not divide a layer's input dim: fail at plan time, "
                             "or keep those layers unquantized (the rule is recorded in the step params).")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v):
        return group_size_value(v)

    def describe(self) -> str:
        g = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"W{self.bits}A16 {g} {'sym' if self.sym else 'asym'}"


def check_int_weights(variant: IntWeightVariant, ctx, field: str) -> tuple[list[str], str]:
    """Plan-time shape check from config.json: (extra ignore rules to apply, the sentence saying so), both empty
    unless on_indivisible: ignore had to act."""
    return check_group_size(variant.group_size, ctx.model_info(), variant.ignore, field, variant.on_indivisible,
                            method=variant.method.upper())


def weight_args(p: dict, **extra) -> dict:
    """compressed-tensors QuantizationArgs for an integer weight scheme."""
    args = {"num_bits": p["bits"], "type": "int", "symmetric": p["sym"], **extra}
    if p.get("group_size"):
        args.update(strategy="group", group_size=p["group_size"])
    else:
        args.update(strategy="channel")
    return args


def resolved_ignore(p: dict) -> list[str]:
    return list(p.get("ignore", [])) + list(p.get("auto_ignore", []))


class LLMCompressorMethod(Method):
    """A method run by llm-compressor's `oneshot`: subclasses give the options and the modifiers."""

    extra = "llmcompressor"
    requires = ("llmcompressor", "compressed_tensors")
    runs_in_env = True     # `env: llm-compressor` (or your own) runs oneshot outside qbuild's environment
    unsupported_families = (MIXTRAL_EXPERTS,)

    def check(self, variant, ctx, field: str) -> None:
        # module patterns first: a typo in `ignore` would otherwise surface as a group-size complaint about the
        # very layers the user meant to ignore
        for name in PATTERN_FIELDS:
            patterns = getattr(variant, name, None)
            if patterns:
                model = ctx.model()
                check_module_patterns(list(patterns), model.source_path, ctx.model_info(), f"{field}.{name}")
        if isinstance(variant, IntWeightVariant):
            _, note = check_int_weights(variant, ctx, field)
            if note:
                ctx.warn(note)

    def scheme(self, variant) -> str:
        """The quantization scheme targets select on (integer weight-only: w<bits>a16)."""
        return f"w{variant.bits}a16"

    def plan(self, variant: VariantBase, ctx) -> Step:
        params = variant.quant_params()
        if isinstance(variant, IntWeightVariant):
            auto_ignore, _ = check_int_weights(variant, ctx, "variants")   # check() has reported it
            if auto_ignore:
                params["auto_ignore"] = list(auto_ignore)
        inputs = {"model": ctx.model()}
        if variant.needs_calibration():
            inputs["calibration"] = ctx.calibration()
        # shard by shard where the scheme is data-free and the model's files name its modules (impl 2: files laid
        # out as the source's shards); the whole model through oneshot otherwise
        shards = self.model_free_scheme(params) is not None and model_free_fits(ctx.model_info())
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", params, runner_of(self.run), inputs=inputs, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=COMPRESSED_TENSORS,
                            scheme=self.scheme(variant), backend_env=ctx.backend_env(variant, self),
                            memory="shard-streamed" if shards else "offloads-to-disk", gpu_capable=True,
                            impl_version=2 if shards else 1, runtime_args={"model_free": True} if shards else {}))

    @abstractmethod
    def modifiers(self, params: dict) -> list:
        """The llm-compressor recipe (a list of modifiers) for these params."""

    def model_free_scheme(self, params: dict) -> dict | str | None:
        """The compressed-tensors scheme (QuantizationScheme fields, or a preset's name) when these params need no
        calibration data, so `model_free_ptq` can quantize the checkpoint shard by shard; None: run oneshot."""
        return None

    def workarounds(self) -> contextlib.AbstractContextManager | None:
        return None

    def run(self, ctx: StepContext) -> dict:
        scheme = self.model_free_scheme(ctx.params)
        if scheme is not None and ctx.runtime_args.get("model_free"):
            done = run_model_free(ctx, scheme, resolved_ignore(ctx.params))
            if done is not None:
                return done
        return run_oneshot(ctx, self.modifiers(ctx.params), self.workarounds())


def model_free_fits(info: dict) -> bool:
    """Plan time (no torch): may the checkpoint go through model_free_ptq? Not a MoE (transformers fuses the experts
    on load, so the files' names are not the model's modules) nor a multimodal checkpoint (towers of their own)."""
    return not (info.get("num_experts") or info.get("num_local_experts") or "vision_config" in info
                or "text_config" in info)


# --- run time ------------------------------------------------------------------------------------
def calibration_dataset(path: Path):
    """The shared calibration artifact as a datasets.Dataset of input_ids/attention_mask."""
    from datasets import Dataset

    from qbuild.calibration.build import load_calibration

    ids, mask = load_calibration(path)
    return Dataset.from_dict({"input_ids": ids.astype("int64").tolist(),
                              "attention_mask": mask.astype("int64").tolist()}), ids.shape


@contextlib.contextmanager
def layer_progress(ctx: StepContext, total: int):
    """Report 'layers done / total' from llm-compressor's per-subgraph callback (restored on exit)."""
    from llmcompressor.core import LifecycleCallbacks

    original = LifecycleCallbacks.__dict__["sequential_epoch_end"]
    done = [0]

    def counting(cls, modules, **kwargs):
        result = original.__func__(cls, modules, **kwargs)
        done[0] += 1
        ctx.progress(min(done[0], total), total, "layers quantized")
        return result

    LifecycleCallbacks.sequential_epoch_end = classmethod(counting)
    try:
        yield
    finally:
        LifecycleCallbacks.sequential_epoch_end = original


@contextlib.contextmanager
def onload_to_cpu():
    """llm-compressor's pipelines onload each layer to the first accelerator torch sees (`get_main_device`), whatever
    the caller wants; a step told to stay on the CPU (runtime.device: cpu on a GPU machine) replaces that choice
    where the pipelines look it up, for the length of one oneshot call."""
    from unittest import mock

    import torch
    from llmcompressor.pipelines.data_free import pipeline as data_free
    from llmcompressor.pipelines.sequential import pipeline as sequential

    with contextlib.ExitStack() as stack:
        for module in (sequential, data_free):
            if hasattr(module, "get_main_device"):
                stack.enter_context(mock.patch.object(module, "get_main_device", lambda: torch.device("cpu")))
        yield


def load_offloadable(src: Path, offload_dir: Path):
    """(the model, whether part of it went to disk): the model in host memory as far as it fits, the rest
    offloaded to `offload_dir` (inside the step's scratch), through compressed-tensors' `load_offloaded_model`
    (device_map "auto_offload": CPU, then disk); llm-compressor onloads each layer as it calibrates and quantizes
    it. The budget is what is free with 5 GB kept for the quantizer's own work, or QBUILD_MEMORY_GB less 1.7 GB
    where the user declares one. A model that fits loads as before and gives the same bytes; one that does not
    gives them too (tests/test_quantize_offload.py: RTN and GPTQ, in memory and on disk)."""
    from transformers import AutoModelForCausalLM

    try:
        from compressed_tensors.offload import get_offloaded_device, load_offloaded_model
    except ImportError:   # an environment with an older compressed-tensors: the whole model in memory, as before
        return AutoModelForCausalLM.from_pretrained(str(src), dtype="auto"), False
    kwargs = {"dtype": "auto", "device_map": "auto_offload", "offload_folder": str(offload_dir)}
    budget = os.environ.get("QBUILD_MEMORY_GB")
    if budget:
        from qbuild.models.size import GB, QUANTIZER_OVERHEAD

        kwargs["max_memory"] = {"cpu": max(1, int(float(budget) * GB - QUANTIZER_OVERHEAD))}
    with load_offloaded_model():
        model = AutoModelForCausalLM.from_pretrained(str(src), **kwargs)
    return model, any(get_offloaded_device(m) == "disk" for m in model.modules())


def weights_not_in_linears(src: Path) -> list[str] | None:
    """The modules of the checkpoint's weight tensors that are not Linear layers (embeddings, ...), read from the
    model's definition on the meta device: model_free_ptq matches tensors by name, not by class, and would
    quantize them where oneshot (targets: Linear) leaves them. Norms it skips itself. None when a weight in the files
    names no module of the definition (renamed or fused on load): the checkpoint is not what oneshot would see."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(src)))
    modules = dict(model.named_modules())
    others = []
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names = list(f.keys())
        for name in names:
            module, _, param = name.rpartition(".")
            if param != "weight" or module.endswith("norm"):
                continue
            if module not in modules:
                return None
            if not isinstance(modules[module], torch.nn.Linear):
                others.append(module)
    return sorted(set(others))


# what a checkpoint folder may hold besides its weights, copied beside the quantized shards (model_free_ptq copies
# every other file of the folder it reads, so it reads a view holding these only)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                    "tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template*")


def run_model_free(ctx: StepContext, scheme: dict | str, ignore: list[str]) -> dict | None:
    """llm-compressor's model_free_ptq: each safetensors shard loaded, its Linear weights quantized and compressed,
    written, before the next (max_workers 1: the step's memory is one shard's). None when the checkpoint's tensor
    names are not its modules' (the caller runs oneshot instead)."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus, preset_name_to_scheme

    try:
        from llmcompressor import model_free_ptq
    except ImportError:   # an `env:` with an llm-compressor older than model_free_ptq
        ctx.log("this llm-compressor has no model_free_ptq: quantizing the whole model through oneshot")
        return None
    src = Path(ctx.inputs["model"])
    others = weights_not_in_linears(src)
    if others is None:
        ctx.log("the checkpoint's tensor names are not its modules' (renamed or fused on load): quantizing the whole "
                "model through oneshot instead of shard by shard")
        return None
    view = ctx.out.parent / "model-free-source"
    view.mkdir()
    for pattern in CHECKPOINT_FILES:
        for f in src.glob(pattern):
            if f.is_file() and not (view / f.name).exists():
                (view / f.name).symlink_to(f.resolve())
    # one group named as oneshot names it ("group_0"), so the checkpoint's config reads the same
    group = (preset_name_to_scheme(scheme, ["Linear"]) if isinstance(scheme, str)
             else QuantizationScheme(targets=["Linear"], **scheme))
    config = QuantizationConfig(config_groups={"group_0": group}, quantization_status=QuantizationStatus.INITIALIZED)
    device = ctx.torch_device()
    ctx.progress(0, 1, "quantizing shard by shard")
    ctx.log(f"model_free_ptq: scheme {group}, ignore {ignore + others}, on {device}")
    model_free_ptq(model_stub=str(view), save_directory=str(ctx.out), config=config, ignore=ignore + others,
                   max_workers=1, device=torch.device(device))
    ctx.progress(1, 1, "quantized")
    return checkpoint_result(ctx, 0, device, shard_by_shard=True)


def checkpoint_result(ctx: StepContext, calibration_samples: int, device: str, **info) -> dict:
    """The step's result for the compressed-tensors checkpoint written in ctx.out, read back from its config."""
    qc = json.loads((ctx.out / "config.json").read_text()).get("quantization_config", {})
    return {"format": COMPRESSED_TENSORS, "metrics": {"size_bytes": dir_size(ctx.out)},
            "info": {"checkpoint_format": "compressed-tensors", "quant_format": qc.get("format"),
                     "ignore": qc.get("ignore"), "calibration_samples": calibration_samples, "device": device,
                     "threads": ctx.threads, **info}}


def run_oneshot(ctx: StepContext, recipe: list, workarounds: contextlib.AbstractContextManager | None = None) -> dict:
    """Load the model, run llm-compressor's oneshot with `recipe`, save compressed-tensors + tokenizer."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    src = Path(ctx.inputs["model"])
    config = json.loads((src / "config.json").read_text())
    n_layers = int((config.get("text_config") or config).get("num_hidden_layers") or 1)
    ctx.progress(0, n_layers + 1, "loading model")
    model, offloaded = load_offloadable(src, ctx.out.parent / "offload")
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    kwargs: dict = {}
    if "calibration" in ctx.inputs:
        dataset, shape = calibration_dataset(ctx.inputs["calibration"])
        kwargs = {"dataset": dataset, "num_calibration_samples": int(shape[0]), "max_seq_length": int(shape[1]),
                  "shuffle_calibration_samples": False}
    ctx.log(f"llm-compressor recipe: {recipe}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(layer_progress(ctx, n_layers + 1))
        if workarounds is not None:
            stack.enter_context(workarounds)
        stack.enter_context(torch.no_grad())
        device = ctx.torch_device()
        if device == "cpu":
            stack.enter_context(onload_to_cpu())
        else:
            torch.cuda.reset_peak_memory_stats()
        oneshot(model=model, recipe=recipe, **kwargs)
    # what the GPU held at most: the layers onloaded there, and the evidence that they were
    gpu = {"gpu_peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)} if device == "cuda" else {}
    ctx.progress(n_layers + 1, n_layers + 1, "saving compressed-tensors")
    # a model partly on disk is saved a shard at a time (each shard is assembled in memory); otherwise one file, as
    # before, so outputs of models that fit are unchanged
    model.save_pretrained(str(ctx.out), save_compressed=True, **({"max_shard_size": "2GB"} if offloaded else {}))
    tokenizer.save_pretrained(str(ctx.out))
    return checkpoint_result(ctx, kwargs.get("num_calibration_samples", 0), device, **gpu,
                             **({"offloaded_to_disk": True} if offloaded else {}))
