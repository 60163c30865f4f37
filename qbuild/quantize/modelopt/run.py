"""The modelopt method's worker side (imported only in a step's worker): calibrate ModelOpt's quantizers on the
shared calibration set, export, validate the export against the source model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qbuild.plugin_services import QUANT_ALGO
from qbuild.plugins import StepContext, dir_size
from qbuild.quantize.modelopt.options import (
    DECODER_TYPES,
    FORMATS,
    FP4_GROUP_SIZE,
    FP4_QUANT_ALGO,
    FP4_SCHEMES,
    OFFLOADABLE_SCHEMES,
    TOKENIZER_FILES,
)


def quant_config(params: dict) -> dict:
    """ModelOpt's preset for the scheme, with the AWQ block size applied."""
    import copy

    import modelopt.torch.quantization as mtq

    preset = {"fp8": mtq.FP8_DEFAULT_CFG, "int8-sq": mtq.INT8_SMOOTHQUANT_CFG, "int4-awq": mtq.INT4_AWQ_CFG,
              "w4a8-awq": mtq.W4A8_AWQ_BETA_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG,
              "w4a8-mxfp4-fp8": mtq.W4A8_MXFP4_FP8_CFG}[params["scheme"]]
    cfg = copy.deepcopy(preset)
    if params.get("block_size"):
        entries = cfg["quant_cfg"]
        for entry in entries if isinstance(entries, list) else entries.values():
            attrs = entry.get("cfg", entry) if isinstance(entry, dict) else entry
            for attr in attrs if isinstance(attrs, list) else [attrs]:
                if isinstance(attr, dict) and isinstance(attr.get("block_sizes"), dict):
                    attr["block_sizes"][-1] = params["block_size"]
    return cfg


def _calibrated(model, ctx: StepContext, device: str):
    """The model with ModelOpt's quantizers calibrated on the shared calibration set (one sequence per pass)."""
    import modelopt.torch.quantization as mtq
    import torch

    from qbuild.plugin_services import load_calibration

    p = ctx.params
    ids, mask = load_calibration(Path(ctx.inputs["calibration"]))
    n = len(ids)

    def forward_loop(m):
        for i in range(n):
            m(input_ids=torch.from_numpy(ids[i: i + 1]).long().to(device),
              attention_mask=torch.from_numpy(mask[i: i + 1]).long().to(device))
            ctx.progress(i + 1, n, f"calibrating {p['scheme']}")

    with torch.no_grad():
        return mtq.quantize(model, quant_config(p), forward_loop)


def run(ctx: StepContext) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from qbuild.plugin_services import validate_hf_export, validate_trtllm_checkpoint

    p = ctx.params
    src = Path(ctx.inputs["model"])
    src_cfg = json.loads((src / "config.json").read_text())
    ctx.progress(0, 3, "loading model")
    if p["scheme"] in FP4_SCHEMES:   # CUDA-only in ModelOpt; calibrate in the export dtype (memory)
        device, load_dtype = "cuda", getattr(torch, p["dtype"])
    else:
        device, load_dtype = "cpu", torch.float32
    dtype = getattr(torch, p["dtype"])
    offload = disk_offload_budget(src, src_cfg) if device == "cpu" and p["export"] == "hf" and \
        p["scheme"] in OFFLOADABLE_SCHEMES else None
    if offload is None:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=load_dtype).to(device).eval()
    else:
        # in the export dtype: an offloaded model cannot be cast as a whole before the export
        ctx.log(f"the model does not fit in memory in fp32: {offload / (1 << 30):.2f} GB of it in memory, the rest "
                f"offloaded to disk")
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, device_map="auto",
                                                     max_memory={"cpu": offload},
                                                     offload_folder=str(ctx.out.parent / "offload")).eval()
    on_disk = "disk" in (getattr(model, "hf_device_map", None) or {}).values()
    if p["scheme"] != "none":
        model = _calibrated(model, ctx, device)
    ctx.progress(1, 3, f"exporting {p['export']}")
    with torch.no_grad():
        if p["export"] == "trtllm-checkpoint":
            from modelopt.torch.export import export_tensorrt_llm_checkpoint

            export_tensorrt_llm_checkpoint(model, DECODER_TYPES[src_cfg["model_type"]], dtype=dtype,
                                           export_dir=str(ctx.out), inference_tensor_parallel=p["tp_size"],
                                           inference_pipeline_parallel=p["pp_size"])
        else:
            from modelopt.torch.export import export_hf_checkpoint

            if offload is None:
                export_hf_checkpoint(model.to(dtype), export_dir=str(ctx.out))
            else:   # ModelOpt's streaming export: one layer at a time, as accelerate onloads it; it buffers a
                # whole shard in memory before writing it, so a shard is a quarter of the memory the model was given
                export_hf_checkpoint(model, dtype=dtype, export_dir=str(ctx.out),
                                     max_shard_size=max(offload // 4, 64 << 20))
    for name in TOKENIZER_FILES:  # the engine/runtime needs the tokenizer next to the weights
        if (src / name).is_file() and not (ctx.out / name).exists():
            shutil.copyfile(src / name, ctx.out / name)
    ctx.progress(2, 3, "validating against the source model")
    if p["export"] == "trtllm-checkpoint":
        fixes = validate_trtllm_checkpoint(ctx.out, src_cfg, quant_algo=QUANT_ALGO[p["scheme"]],
                                           group_size=p.get("block_size"), tp_size=p["tp_size"], pp_size=p["pp_size"])
    else:
        fixes = validate_hf_export(ctx.out, src_cfg)
        if p["scheme"] in FP4_SCHEMES:
            check_fp4_export(ctx.out, p["scheme"])
    for f in fixes:
        ctx.log(f"fixed {f['field']}: {f['was']!r} -> {f['now']!r} ({f['why']})")
    ctx.progress(3, 3, "done")
    from importlib.metadata import version

    size = dir_size(ctx.out)
    algo = FP4_QUANT_ALGO.get(p["scheme"]) or QUANT_ALGO[p["scheme"]]
    return {"format": FORMATS[p["export"]], "metrics": {"size_bytes": size},
            "info": {"quant_algo": algo, "device": device, "checkpoint_fixes": fixes,
                     "validated_against_source": True, "modelopt": version("nvidia-modelopt"),
                     **({"offloaded_to_disk": True} if on_disk else {})}}


def disk_offload_budget(src: Path, src_cfg: dict) -> int | None:
    """The host memory (bytes) to give the model when its fp32 copy would not fit this machine's memory
    (qbuild.models.size.machine_memory, QBUILD_MEMORY_GB where declared) beside the quantizer's own; None when it fits (it
    is then loaded whole, as before). At least the weights outside the layers and two layers stay in memory:
    ModelOpt's export runs a forward on the device of the model's first weights, which must not be on disk, and
    accelerate keeps room for one offloaded layer."""
    from qbuild.plugin_services import QUANTIZER_OVERHEAD, machine_memory, model_size

    size = model_size(src_cfg, src)
    if size is None:
        return None
    memory = machine_memory()[0]
    if 2 * size.total + QUANTIZER_OVERHEAD <= memory:   # fp32: twice a 16-bit checkpoint
        return None
    return int(max(memory - QUANTIZER_OVERHEAD, size.outside + 2 * size.layer))


def check_fp4_export(ckpt: Path, scheme: str) -> dict:
    """The export declares what TensorRT-LLM's PyTorch backend will run: quant_algo and block size (raises if not)."""
    hfq = ckpt / "hf_quant_config.json"
    if not hfq.is_file():
        raise ValueError(f"{scheme} export has no hf_quant_config.json: TensorRT-LLM could not tell it is quantized")
    quant = json.loads(hfq.read_text()).get("quantization") or {}
    want_algo, want_group = FP4_QUANT_ALGO[scheme], FP4_GROUP_SIZE[scheme]
    if quant.get("quant_algo") != want_algo or quant.get("group_size") != want_group:
        raise ValueError(f"{scheme} export declares quant_algo {quant.get('quant_algo')!r}, group_size "
                         f"{quant.get('group_size')!r}; TensorRT-LLM expects {want_algo!r}, {want_group}")
    return quant
