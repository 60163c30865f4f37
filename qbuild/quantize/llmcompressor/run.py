"""The llm-compressor methods' worker side (imported only in a step's worker): `oneshot` on the shared calibration
set, or `model_free_ptq` shard by shard for a data-free scheme, and the compressed-tensors checkpoint's result.
`run_quantize` is what each method's own runner (qbuild/quantize/<method>/run.py) hands its modifiers to;
`run_search_quantize` runs a quantize step of an rtn variant's `search:` (search.py)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from qbuild.plugin_services import narrow_untouched
from qbuild.plugins import StepContext, dir_size
from qbuild.quantize.llmcompressor.options import COMPRESSED_TENSORS, resolved_ignore


def calibration_dataset(path: Path):
    """The shared calibration artifact as a datasets.Dataset of input_ids/attention_mask."""
    from datasets import Dataset

    from qbuild.plugin_services import load_calibration

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
        from qbuild.plugin_services import GB, QUANTIZER_OVERHEAD

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
    """The step's result for the compressed-tensors checkpoint written in ctx.out, read back from its config (the
    untouched matrices narrowed first, where the plan asks)."""
    info = {**info, **narrow_untouched(ctx)}
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


def run_quantize(ctx: StepContext, modifiers, model_free_scheme: dict | str | None = None,
                 workarounds: contextlib.AbstractContextManager | None = None) -> dict:
    """A llm-compressor method's quantize step: shard by shard through `model_free_ptq` where the plan chose it
    (`model_free_scheme`: the method's model_free_scheme of these params), else `oneshot` with the recipe
    `modifiers(params)` builds (llm-compressor's modifier objects, made only when oneshot runs)."""
    if model_free_scheme is not None and ctx.runtime_args.get("model_free"):
        done = run_model_free(ctx, model_free_scheme, resolved_ignore(ctx.params))
        if done is not None:
            return done
    return run_oneshot(ctx, modifiers(ctx.params), workarounds)


def run_search_quantize(ctx: StepContext) -> dict:
    """A quantize step of `search:` on an rtn variant (search.py): one llm-compressor run (QuantizationModifier,
    data-free round-to-nearest) with one config group per scheme, its targets `re:` regexes of module names; adds the
    quantized weights' bytes and bits to the metrics."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from qbuild.quantize.llmcompressor.options import weight_args
    from qbuild.quantize.llmcompressor.search import SCHEME_BITS, candidate_assignment, quantized_weight_stats

    p = ctx.params
    assign = p.get("assign") or candidate_assignment(Path(ctx.inputs["allocation"]), p["candidate"])
    config_groups = {a["scheme"]: {"targets": a["targets"],
                                   "weights": weight_args({**p, "bits": SCHEME_BITS[a["scheme"]]})}
                     for a in assign}
    result = run_oneshot(ctx, [QuantizationModifier(config_groups=config_groups, ignore=resolved_ignore(p))])
    stats = quantized_weight_stats(ctx.out)
    result["metrics"].update(stats)
    result["info"]["assign"] = assign
    result["info"]["part_types"] = sorted(a["scheme"].lower() for a in assign)   # loads_in: where every part loads
    ctx.log(f"quantized weights: {stats['quantized_weights']}, {stats['weight_bits']:.4f} bits each")
    return result
