"""GPTQ through gptqmodel, writing the GPTQ format: the checkpoint TGI, LMDeploy, ExLlamaV2, transformers and
vLLM (gptq_marlin) load — `quantize_config.json` / `quantization_config: {quant_method: gptq}`, v1 packing.

llm-compressor's GPTQ (gptq.py) writes compressed-tensors, which TGI and LMDeploy do not read. gptqmodel
cannot share qbuild's environment (7.6.0 pins numpy 2.2.6; 7.7 needs torch ≥ 2.14.1), so this method runs
in its own backend environment, `gptqmodel` (qbuild/envs/), created with uv on first use; so does the
evaluation of its output (the `gptq` format's eval_env). Calibration is the shared calibration artifact.
"""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import Field, field_validator

from qbuild.base.files import dir_size
from qbuild.contract.formats import HF_RUNTIMES, FormatSpec, register_format
from qbuild.contract.plugin import Method, methods
from qbuild.contract.shapes import check_group_size
from qbuild.contract.step import Step, StepContext, runner_of
from qbuild.contract.variant import VariantBase, group_size_value

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


@methods.register
class GPTQModel(Method):
    name = "gptqmodel"
    options = GPTQModelVariant
    extra = "gptqmodel environment"
    requires = ("gptqmodel",)   # checked only when the variant runs in qbuild's environment (it does not by default)
    runs_in_env = True
    default_env = "gptqmodel"

    def check(self, variant: GPTQModelVariant, ctx, field: str) -> None:
        # gptqmodel groups columns like compressed-tensors: a group size must divide each layer's input dim
        check_group_size(variant.group_size, ctx.model_info(), ["lm_head"], field, method="gptqmodel", escapes=())

    def plan(self, variant: GPTQModelVariant, ctx) -> Step:
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                            runner_of(self.run), inputs={"model": ctx.model(), "calibration": ctx.calibration()},
                            tools=TOOLS, threads=ctx.threads, variant=variant.name, format=GPTQ,
                            scheme=f"w{variant.bits}a16", backend_env=ctx.backend_env(variant, self),
                            memory="whole-model", gpu_capable=True))

    def run(self, ctx: StepContext) -> dict:
        from qbuild.calibration.build import load_calibration

        # gptqmodel sizes its CPU worker pool from the machine, not from the step's budget; its model loader takes
        # 2 workers from that pool, so 2 is the least it accepts (torch's own threads follow OMP_NUM_THREADS)
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ctx.threads)))
        from gptqmodel import GPTQModel as Library
        from gptqmodel import QuantizeConfig

        p = ctx.params
        config = QuantizeConfig(bits=p["bits"], group_size=p["group_size"] or -1, sym=p["sym"], desc_act=p["desc_act"],
                                damp_percent=p["damp_percent"], true_sequential=p["true_sequential"],
                                offload_to_disk=False)   # no temporary path recorded in the saved config
        ids, mask = load_calibration(ctx.inputs["calibration"])
        calibration = [{"input_ids": row.astype("int64").tolist(), "attention_mask": m.astype("int64").tolist()}
                       for row, m in zip(ids, mask, strict=True)]
        ctx.progress(0, 3, "loading model")
        device = ctx.torch_device()
        model = Library.load(str(ctx.inputs["model"]), config, device=device)
        ctx.progress(1, 3, f"GPTQ on {len(calibration)} calibration sequences")
        model.quantize(calibration, batch_size=1)
        ctx.progress(2, 3, "saving GPTQ format")
        model.save(str(ctx.out))
        ctx.owned().remove(ctx.out / "quant_log.csv", within=ctx.out)   # per-layer timings: not part of the artifact
        qc = json.loads((ctx.out / "quantize_config.json").read_text())
        return {"format": GPTQ, "metrics": {"size_bytes": dir_size(ctx.out)},
                "info": {"checkpoint_format": qc.get("checkpoint_format", qc.get("format")),
                         "quant_method": qc.get("quant_method"), "quantizer": (qc.get("meta") or {}).get("quantizer"),
                         "calibration_samples": len(calibration)}}
