"""The modelopt method's plan side. NVIDIA ModelOpt: FP8, INT8-SmoothQuant, INT4-AWQ, W4A8-AWQ, NVFP4 and
W4A8-MXFP4, exported for TensorRT-LLM.

One step, `quantize[<variant>]`: load the HF model, calibrate ModelOpt's quantizers on the shared
calibration set, export either a TensorRT-LLM checkpoint (config.json + rank<N>.safetensors, the
input of `trtllm-build`) or a Hugging Face checkpoint with hf_quant_config.json (what TensorRT-LLM's
PyTorch backend loads), then validate the export against the source model and record every fix
(see qbuild/models/checkpoint.py: ModelOpt 0.47 writes no rotary_base, for one).
Runs on CPU; ModelOpt is imported only inside the step's worker process. With the HF export, fp8 (and none) load what
fits in host memory and offload the rest to disk (accelerate's device_map, ModelOpt's streaming export): a model
larger than memory quantizes instead of being killed.

NVFP4 and W4A8-MXFP4 (MXFP4 weights, FP8 activations) are exported as HF checkpoints for TensorRT-LLM's
PyTorch backend, whose Linear layers run exactly these two FP4 layouts (QuantAlgo NVFP4 and
W4A8_MXFP4_FP8; plain W4A4 MXFP4 has no dense-layer kernel there, so ModelOpt's MXFP4_DEFAULT_CFG is not
offered). ModelOpt 0.47 fake-quantizes FP4 only on CUDA (its dynamic block quantizer asserts CUDA
tensors, the MX kernels are a CUDA extension), so these steps need a GPU: without one `qbuild plan`
shows them as needs-gpu, and `on_missing_gpu: skip` builds the rest of the recipe. Any CUDA GPU can
quantize; serving the result needs Blackwell (SM 10.x) kernels.
"""

from __future__ import annotations

from qbuild.plugin_services import linear_in_features
from qbuild.plugins import Method, OnUnavailable, RecipeError, Step, hardware, methods
from qbuild.quantize.modelopt.options import (
    AWQ_BLOCK_SIZES,
    DECODER_TYPES,
    EXPORT_RAISES,
    FORMATS,
    FP4_SCHEMES,
    OFFLOADABLE_SCHEMES,
    TOOLS,
    ModelOptVariant,
)


@methods.register
class ModelOpt(Method):
    name = "modelopt"
    options = ModelOptVariant
    extra = "modelopt"
    requires = ("modelopt", "torch", "transformers")

    def check(self, variant: ModelOptVariant, ctx, field: str) -> None:
        info = ctx.model_info()
        model_type = info.get("model_type")
        if variant.export == "trtllm-checkpoint" and model_type in EXPORT_RAISES:
            raise RecipeError(f"{field}.export", f"ModelOpt's TensorRT-LLM checkpoint export raises NotImplementedError "
                              f"for {model_type} (decoder {EXPORT_RAISES[model_type]!r}) where tensorrt_llm is not "
                              "importable; use export: hf on this variant and a target of type: trtllm-pytorch "
                              "(TensorRT-LLM's PyTorch backend loads the HF checkpoint)")
        if variant.export == "trtllm-checkpoint" and model_type not in DECODER_TYPES:
            raise RecipeError(f"{field}.export", f"ModelOpt's TensorRT-LLM export does not map model_type "
                              f"{model_type!r}; supported: {', '.join(sorted(DECODER_TYPES))} (or use export: hf)")
        if variant.block_size:
            dims = linear_in_features(info)
            bad = {name: d for name, d in dims.items() if d % variant.block_size}
            if bad:
                fits = [b for b in AWQ_BLOCK_SIZES if all(d % b == 0 for d in dims.values())]
                what = ", ".join(f"{n} = {d}" for n, d in bad.items())
                allowed = ", ".join(map(str, fits)) if fits else "none of " + ", ".join(map(str, AWQ_BLOCK_SIZES))
                raise RecipeError(f"{field}.block_size", f"{variant.block_size} does not divide {what}; "
                                  f"block sizes that fit this model: {allowed}")
        heads = info.get("num_attention_heads", 1)
        kv = info.get("num_key_value_heads") or heads
        if variant.tp_size > 1 and (heads % variant.tp_size or kv % variant.tp_size):
            raise RecipeError(f"{field}.tp_size", f"{variant.tp_size} does not divide num_attention_heads={heads} "
                              f"and num_key_value_heads={kv}")
        if variant.pp_size > info.get("num_hidden_layers", 1):
            raise RecipeError(f"{field}.pp_size", f"{variant.pp_size} exceeds num_hidden_layers={info.get('num_hidden_layers')}")

    def plan(self, variant: ModelOptVariant, ctx) -> Step:
        model = ctx.model()
        inputs = {"model": model}
        if variant.needs_calibration():
            inputs["calibration"] = ctx.calibration()
        gpu = {}
        if variant.scheme in FP4_SCHEMES:
            why = "" if hardware.gpu() else (f"needs a CUDA GPU: ModelOpt {_modelopt_version()} fake-quantizes "
                                               f"{variant.scheme} only on CUDA; none found here (nvidia-smi)")
            gpu = {"requires_gpu": True, "unavailable": why, "on_unavailable": OnUnavailable(variant.on_missing_gpu)}
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            "qbuild.quantize.modelopt.run:run", inputs=inputs, tools=TOOLS, threads=ctx.threads,
                            variant=variant.name, format=FORMATS[variant.export], scheme=variant.scheme,
                            memory=memory_kind(variant), **gpu))


def memory_kind(variant: ModelOptVariant) -> str:
    """How the step holds the model (qbuild.pipeline.memory_fit): the FP4 schemes load it on CUDA in the export dtype;
    on CPU it is calibrated in fp32, and fp8 (or none) with the HF export offloads to disk what does not fit
    (run.disk_offload_budget)."""
    if variant.scheme in FP4_SCHEMES:
        return "whole-model"
    return "offloads-to-disk" if variant.export == "hf" and variant.scheme in OFFLOADABLE_SCHEMES else "whole-model-fp32"


def _modelopt_version() -> str:
    from qbuild.plugins import package_version

    return package_version("nvidia-modelopt")


# --- worker side ------------------------------------------------------------------------------------
