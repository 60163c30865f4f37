"""The gptqmodel method's options: the variant's schema (GPTQModelVariant) and the GPTQ format it writes, declared
here (imported at plan time: gptqmodel is not even installed in qbuild's environment)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from qbuild.plugins import HF_RUNTIMES, FormatSpec, VariantBase, group_size_value, register_format

# distributions whose versions (in the gptqmodel environment) enter the key
TOOLS = ("gptqmodel", "torch", "transformers", "safetensors", "numpy")
# the GPTQ format this method writes (AutoRound's auto_gptq export too): read back through gptqmodel and optimum, in
# the gptqmodel environment; every engine below loads it, for every scheme
GPTQ = register_format(FormatSpec(
    "gptq", "GPTQ-format HF checkpoint (quantize_config.json, v1 packing; gptqmodel)",
    load_tools=("gptqmodel", "optimum"), eval_env="gptqmodel", evaluated_by=HF_RUNTIMES,
    loads_in=("vllm", "sglang", "tgi", "lmdeploy", "transformers", "exllamav2"),
    load_commands=(("lmdeploy", "`lmdeploy serve api_server {dir} --model-format gptq`"),
                   ("exllamav2", "load `{dir}` with ExLlamaV2's model loader (GPTQ format)")))).name


class GPTQModelVariant(VariantBase):
    """GPTQ (Frantar et al.) by gptqmodel, saved in the GPTQ checkpoint format."""

    method: Literal["gptqmodel"]
    bits: Literal[2, 3, 4, 8] = Field(4, description="Weight bits.")
    group_size: int | None = Field(128, description="Columns per scale/zero group; null or -1 = per output channel.")
    sym: bool = Field(True, description="Symmetric weights (vLLM's gptq_marlin and ExLlamaV2 want sym).")
    desc_act: bool = Field(False, description="Activation order (act-order): better accuracy, slower kernels.")
    damp_percent: float = Field(0.05, gt=0, lt=1, description="Hessian dampening, fraction of its mean diagonal.")
    true_sequential: bool = Field(True, description="Quantize a block's sublayers in order, each seeing the last.")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v):
        return group_size_value(v)

    def needs_calibration(self) -> bool:
        return True

    def describe(self) -> str:
        g = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"GPTQ-format W{self.bits}A16 {g} {'sym' if self.sym else 'asym'}{' act-order' if self.desc_act else ''}"
