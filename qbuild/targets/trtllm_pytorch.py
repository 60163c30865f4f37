"""`type: trtllm-pytorch`: a checkpoint packaged for TensorRT-LLM's PyTorch backend (no engine build).

This is what qbuild offers for TensorRT-LLM after 1.2.x (the TensorRT engine backend is gone after
1.3.0rc20): the PyTorch backend loads a Hugging Face checkpoint directly. The package is the
checkpoint (validated against the source model, RoPE fields fixed for TensorRT-LLM's transformers
4.x) plus a validated `extra_llm_api_options.yaml` for `trtllm-serve` / `trtllm-bench`.

What the PyTorch backend reads (tensorrt_llm/models/quant_config_utils.py, checked for 1.2.x):
ModelOpt HF exports (hf_quant_config.json) and, from compressed-tensors, only FP8 per-channel with
dynamic activations, FP8 block, NVFP4 and MXFP4; not static per-tensor FP8 and not INT4 GPTQ/AWQ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field

from qbuild.plugins import Format, FormatSpec, Step, StepContext, StrictModel, Target, TargetOptions, register_format, targets

KIND = "trtllm-pytorch-package"
OPTIONS_FILE = "extra_llm_api_options.yaml"
INFO_FILE = "qbuild-trtllm.json"
MODELOPT_OK = ("fp8", "int4-awq", "w4a8-awq", "nvfp4", "w4a8-mxfp4-fp8", "none")   # ModelOpt HF exports it loads
CT_OK = ("fp8-dynamic", "fp8-block", "nvfp4", "mxfp4")               # compressed-tensors schemes it loads
# what this target makes: the checkpoint + extra_llm_api_options.yaml, which the PyTorch backend (trtllm-serve) loads
PACKAGE_FORMAT = register_format(FormatSpec(
    "trtllm-pytorch", "checkpoint packaged for TensorRT-LLM's PyTorch backend", loads_in=("trtllm-pytorch",),
    load_commands=(("trtllm-pytorch",
                    "`trtllm-serve {dir} --extra_llm_api_options {dir}/extra_llm_api_options.yaml`"),))).name


class KvCacheConfig(StrictModel):
    free_gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    enable_block_reuse: bool | None = None
    dtype: Literal["auto", "fp8"] | None = None


class CudaGraphConfig(StrictModel):
    enable_padding: bool | None = None
    max_batch_size: int | None = Field(None, ge=1)


class LlmApiOptions(StrictModel):
    """The subset of TensorRT-LLM's LLM-API arguments qbuild validates and writes (unset = TRT-LLM default)."""

    max_batch_size: int | None = Field(None, ge=1)
    max_num_tokens: int | None = Field(None, ge=1)
    max_seq_len: int | None = Field(None, ge=1)
    kv_cache_config: KvCacheConfig | None = None
    cuda_graph_config: CudaGraphConfig | None = None
    enable_chunked_prefill: bool | None = None
    disable_overlap_scheduler: bool | None = None
    attn_backend: Literal["TRTLLM", "FLASHINFER", "VANILLA"] | None = None


class PyTorchBackendTarget(TargetOptions):
    """A checkpoint + extra_llm_api_options.yaml for TensorRT-LLM's PyTorch backend (no build step)."""

    type: Literal["trtllm-pytorch"]
    name: str = Field("trtllm-pytorch", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    tp_size: int = Field(1, ge=1, description="tensor_parallel_size at load time.")
    pp_size: int = Field(1, ge=1, description="pipeline_parallel_size at load time.")
    llm_api_options: LlmApiOptions = Field(default_factory=LlmApiOptions)


def llm_api_options(target_params: dict) -> dict:
    """The YAML content: only what the recipe sets, plus the parallel sizes."""
    def prune(d):
        return {k: prune(v) if isinstance(v, dict) else v for k, v in d.items()
                if v is not None and not (isinstance(v, dict) and not prune(v))}

    opts = prune(target_params.get("llm_api_options") or {})
    opts["tensor_parallel_size"] = target_params["tp_size"]
    opts["pipeline_parallel_size"] = target_params["pp_size"]
    return dict(sorted(opts.items()))


@targets.register
class TensorRTLLMPyTorch(Target):
    """What TensorRT-LLM's PyTorch backend loads, by capability (format + scheme), never by method name."""

    name = "trtllm-pytorch"
    options = PyTorchBackendTarget
    extra = "tensorrt-llm"
    # by name: formats the modelopt and llm-compressor methods declare
    accepts = {"hf-modelopt": MODELOPT_OK, "compressed-tensors": CT_OK, Format.HF: None}
    purpose = "be served by TensorRT-LLM's PyTorch backend"
    hints = {
        "trtllm-checkpoint": "it is a TensorRT-LLM checkpoint (for trtllm-build); set export: hf on the variant",
        "compressed-tensors": "INT4/INT8 weight-only and static per-tensor FP8 compressed-tensors checkpoints are "
                              "not read by the PyTorch backend; use method: fp8 with scheme: dynamic, or method: "
                              "modelopt with scheme: int4-awq",
        "hf-modelopt": "other ModelOpt schemes have not been checked for the PyTorch backend; use the "
                       "tensorrt-llm target",
        "gguf": "GGUF is llama.cpp's format",
    }

    def plan(self, target: PyTorchBackendTarget, artifact: Step, ctx, field: str) -> Step:
        params = target.canonical()
        for k in ("variants", "name"):
            params.pop(k, None)
        ref_name = f"{artifact.variant}.{target.name}"
        return ctx.add(Step(KIND, f"package[{ref_name}]", params, "qbuild.targets.trtllm_pytorch:run_package",
                            inputs={"checkpoint": artifact, "model": ctx.model()}, tools=("pyyaml",), threads=1,
                            variant=ref_name, format=PACKAGE_FORMAT, scheme=artifact.scheme))


def check_quant_config(ckpt: Path) -> str:
    """What the checkpoint itself declares; raises if the PyTorch backend would not load it."""
    hfq = ckpt / "hf_quant_config.json"
    if hfq.is_file():
        algo = (json.loads(hfq.read_text()).get("quantization") or {}).get("quant_algo")
        return f"modelopt:{algo}"
    qc = json.loads((ckpt / "config.json").read_text()).get("quantization_config")
    if not qc:
        return "unquantized"
    if qc.get("quant_method") == "compressed-tensors":
        for name, group in (qc.get("config_groups") or {}).items():
            w, a = group.get("weights") or {}, group.get("input_activations") or {}
            if w.get("type") == "float" and w.get("num_bits") == 8:
                if w.get("strategy") in ("channel", "block") and (not a or a.get("dynamic")):
                    continue
                raise ValueError(f"config_groups.{name}: FP8 with {w.get('strategy')} weights and "
                                 f"{'static' if a and not a.get('dynamic') else 'no'} activation scales is not read "
                                 "by the PyTorch backend (needs per-channel weights + dynamic activations, or block)")
            if w.get("type") == "float" and w.get("num_bits") == 4:
                continue  # NVFP4 / MXFP4
            raise ValueError(f"config_groups.{name}: {w.get('type')} {w.get('num_bits')}-bit weights are not read by "
                             "the PyTorch backend")
        return "compressed-tensors"
    return str(qc.get("quant_method"))


def run_package(ctx: StepContext) -> dict:
    import yaml

    from qbuild.plugin_services import validate_hf_export

    src = Path(ctx.inputs["checkpoint"])
    for f in sorted(src.rglob("*")):
        if f.is_file() and f.name != "manifest.json":
            dest = ctx.out / f.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    source_cfg = json.loads((Path(ctx.inputs["model"]) / "config.json").read_text())
    fixes = validate_hf_export(ctx.out, source_cfg)
    quant = check_quant_config(ctx.out)
    opts = llm_api_options(ctx.params)
    (ctx.out / OPTIONS_FILE).write_text(yaml.safe_dump(opts, sort_keys=True))
    info = {"quantization": quant, "checkpoint_fixes": fixes, "llm_api_options": opts,
            "serve": f"trtllm-serve <dir> --extra_llm_api_options <dir>/{OPTIONS_FILE}"}
    (ctx.out / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    return {"format": PACKAGE_FORMAT, "info": info}
