"""The awq method's options: the variant's schema (AWQVariant), and the AutoAWQ GEMM layout its `checkpoint_format:
autoawq` converts to: the layout's constants and its format (`awq`), declared here. Imported at plan time: no torch,
no llm-compressor."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.plugins import HF_RUNTIMES, FormatSpec, register_format
from qbuild.quantize import llmcompressor as lc

# distributions whose versions enter the key of a convert step
CONVERT_TOOLS = ("compressed-tensors", "torch", "safetensors", "transformers")
# the layout the convert step writes (the awq method's `checkpoint_format: autoawq`, AutoRound's auto_awq export):
# loaded as it is by these engines, for every scheme; transformers 5 reads AWQ through gptqmodel
AWQ_FORMAT = register_format(FormatSpec(
    "awq", "HF checkpoint in AutoAWQ's GEMM layout (4-bit, grouped, zero points; quant_method awq)",
    load_tools=("gptqmodel",), eval_env="gptqmodel", evaluated_by=HF_RUNTIMES,
    loads_in=("vllm", "sglang", "tgi", "lmdeploy", "transformers"),
    load_commands=(("lmdeploy", "`lmdeploy serve api_server {dir} --model-format awq`"),))).name

BITS = 4                    # the only width AutoAWQ's GEMM layout (and the kernels reading it) holds
VALUES_PER_WORD = 32 // BITS


class AWQVariant(lc.IntWeightVariant):
    """AWQ (Lin et al.): calibrated weight-only integer quantization by activation-aware scaling."""

    method: Literal["awq"]
    sym: bool = Field(False, description="Symmetric weights; AWQ is normally asymmetric (zero points).")
    duo_scaling: bool | Literal["both"] = Field(
        True, description="Scale search uses activations and weights (true), activations only (false), or both halves.")
    n_grid: int = Field(20, ge=1, le=200, description="Grid points of the per-mapping scale search.")
    checkpoint_format: Literal["compressed-tensors", "autoawq"] = Field(
        "compressed-tensors", description="compressed-tensors (vLLM, SGLang, transformers), or autoawq: AutoAWQ's "
                                          "GEMM layout (also LMDeploy, TGI), converted exactly; needs bits 4 and a group_size.")

    def needs_calibration(self) -> bool:
        return True

    def describe(self) -> str:
        return "AWQ " + super().describe() + (" (AutoAWQ GEMM)" if self.checkpoint_format == "autoawq" else "")

    def quant_params(self) -> dict:
        """What the quantize step computes. The checkpoint format is not part of it (the convert step is), except
        that AutoAWQ stores float16 scales: for an exact conversion the scales are computed as float16 numbers
        from the start. The default format leaves the params as they were before the option existed (same keys)."""
        data = super().quant_params()
        if data.pop("checkpoint_format") == "autoawq":
            data["scale_dtype"] = "float16"
        return data
