"""The gptqmodel method's worker side (imported only in a step's worker, in the gptqmodel backend environment by
default): GPTQ with gptqmodel on the shared calibration set, saved in the GPTQ format."""

from __future__ import annotations

import json
import os

from qbuild.plugin_services import narrow_untouched
from qbuild.plugins import StepContext, dir_size
from qbuild.quantize.gptqmodel.options import GPTQ


def run(ctx: StepContext) -> dict:
    from qbuild.plugin_services import load_calibration

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
    narrowed = narrow_untouched(ctx)
    qc = json.loads((ctx.out / "quantize_config.json").read_text())
    return {"format": GPTQ, "metrics": {"size_bytes": dir_size(ctx.out)},
            "info": {"checkpoint_format": qc.get("checkpoint_format", qc.get("format")),
                     "quant_method": qc.get("quant_method"), "quantizer": (qc.get("meta") or {}).get("quantizer"),
                     "calibration_samples": len(calibration), **narrowed}}
