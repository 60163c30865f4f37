"""Will each step to build fit this machine's memory? Decided at plan time, from the model's size and the step's kind,
so a step that cannot fit is refused in one line before anything runs, instead of being killed by the kernel.

The model's size comes from its config (parameters in the decoder layers and outside them, at 2 bytes each, as
bf16/fp16 checkpoints store them) or, for a local checkpoint, its safetensors files. What a step holds, measured
on random-weight Llama-shaped models of 135M-3B parameters (bench/bench_model_size.py, docs/benchmarks.md):

- `memory="whole-model"` on a quantize step (GPTQModel, AutoRound, bitsandbytes, ModelOpt's FP4 on CUDA): 1.1 x the
  checkpoint + 1.7 GB;
- `memory="whole-model-fp32"` (ModelOpt on CPU: it calibrates an fp32 copy): 2.2 x the 16-bit checkpoint + 1.7 GB;
- `memory="offloads-to-disk"` (llm-compressor; ModelOpt fp8 with the HF export, in fp32 where it fits): the same
  where it fits; what does not fit is offloaded to disk (compressed-tensors' or accelerate's offloading), so the step
  is not refused, and the plan says it will be slower;
- `memory="shard-streamed"` (llm-compressor's model_free_ptq, data-free schemes: RTN, FP8 dynamic): 2 x the largest
  safetensors shard (read, and its quantized copy) + 1 GB (torch, transformers and llm-compressor imported: 0.75 GB
  peak on a 40M-parameter model); a hub model's shards are taken as 5 GB at most;
- `memory="layer-streamed"` (transformers evaluating windows of one length: qbuild.runtimes.layer_stream): the
  weights outside the layers in fp32, one layer in fp32 and as stored, and 1.2 GB of activations and runtime (an
  unquantized or compressed-tensors checkpoint); a MoE checkpoint, or one another quantizer loads (bitsandbytes,
  GPTQ, AWQ), is loaded whole by transformers instead;
- `memory="whole-model"` on an evaluation step (generation), or a streamed one that cannot stream: 3 x the
  checkpoint (the fp32 copy and the stored file's pages);
- `memory="dequantizes-gguf"` (the import of a GGUF source: transformers dequantizes every tensor to float32 in
  memory, then saves): 6.2 bytes a parameter of the file + 0.6 GB (peaks of 1.37 GB at 135M parameters, SmolLM2, and
  2.32 GB at 309M);
- `memory=""`: llama.cpp steps map the GGUF file (pages the kernel can drop) and hold about one tensor; steps on
  another machine or without a model: not limited here.

The machine's memory is the smaller of the host's RAM and the cgroup limit, or QBUILD_MEMORY_GB where the user
declares a budget (a machine shared with other jobs). Planning never imports torch.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.models.size import (
    GB,
    HUB_SHARD,
    IMPORT_BYTES_PER_PARAMETER,
    IMPORT_OVERHEAD,
    QUANTIZER_OVERHEAD,
    RUNTIME_OVERHEAD,
    SHARD_QUANTIZER_OVERHEAD,
    ModelSize,
    machine_memory,
    model_size,
)


def step_memory(step, size: ModelSize, loaded_whole: bool) -> tuple[int, str] | None:
    """(peak bytes, how the step holds the model) for a step that holds model weights in memory (Step.memory, as the
    plugin that made the step declares it); None otherwise."""
    if step.memory == "dequantizes-gguf":
        parameters = max(size.file_parameters, size.parameters)
        return (int(IMPORT_BYTES_PER_PARAMETER * parameters + IMPORT_OVERHEAD),
                "dequantizes the GGUF to float32 in memory")
    if step.memory == "shard-streamed":
        shard = size.largest_shard or min(size.total, HUB_SHARD)
        return int(2 * shard + SHARD_QUANTIZER_OVERHEAD), "quantizes one safetensors shard at a time"
    if step.memory == "whole-model-fp32" and step.kind == "quantize":
        return int(2.2 * size.total + QUANTIZER_OVERHEAD), "loads the whole model in fp32 to quantize it"
    if step.memory in ("whole-model", "offloads-to-disk") and step.kind == "quantize":
        return int(1.1 * size.total + QUANTIZER_OVERHEAD), "loads the whole model to quantize it"
    if step.memory == "whole-model" or (step.memory == "layer-streamed" and (loaded_whole or size.experts)):
        return 3 * size.total, "loads the whole model, in fp32 on CPU"
    if step.memory == "layer-streamed":
        return 2 * size.outside + 3 * size.layer + int(RUNTIME_OVERHEAD), "layer-streamed"
    return None


def refusal(step, need: tuple[int, str], size: ModelSize, memory: tuple[int, str]) -> str:
    """One line saying why `step`, needing `need` (step_memory), cannot run in `memory`."""
    return (f"{step.name} needs about {need[0] / GB:.1f} GB of memory ({need[1]}; a {size.parameters / 1e9:.2f}B-"
            f"parameter model) and {memory[1]} gives {memory[0] / GB:.1f} GB: use a machine with more memory, drop "
            f"the step, or declare a larger budget with QBUILD_MEMORY_GB")


STREAMABLE_FORMATS = ("hf", "compressed-tensors")   # what qbuild.runtimes.layer_stream reads one layer at a time


def check_memory(planned, model_info: dict, source: Path | None, variants) -> list[str]:
    """Refuse the plan (RecipeError on the step's variant, the model for its checks, else `evaluation`) when a step
    still to build would not fit this machine's memory; the warnings for steps that will offload to disk."""
    from qbuild.base.errors import RecipeError
    from qbuild.contract.step import PlanStatus

    size = model_size(model_info, source)
    if size is None:
        return []
    memory = machine_memory()
    warnings = []
    for p in planned:
        if p.status != PlanStatus.MISS:
            continue
        model_input = p.step.inputs.get("model")
        loaded_whole = model_input is not None and model_input.format not in STREAMABLE_FORMATS
        need = step_memory(p.step, size, loaded_whole)
        if need is None or need[0] <= memory[0]:
            continue
        if p.step.memory == "offloads-to-disk":
            warnings.append(f"{p.step.name} needs about {need[0] / GB:.1f} GB of memory and {memory[1]} gives "
                            f"{memory[0] / GB:.1f} GB: the part of the model that does not fit is offloaded to disk "
                            f"(slower, same result)")
            continue
        index = next((i for i, v in enumerate(variants) if f"[{v.name}" in p.step.name), None)
        field = ("model" if p.step.kind in ("import-gguf", "import-check", "convert-check") else
                 f"variants[{index}]" if p.step.kind == "quantize" and index is not None else "evaluation")
        raise RecipeError(field, refusal(p.step, need, size, memory))
    return warnings
