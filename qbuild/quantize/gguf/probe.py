"""A GGUF search's probe (step kind `gguf-probe`): quantize into the step's scratch, measure, keep the measurement.

A search measures dozens of files that differ from the base in one group of tensors, and a few finalists; storing each
whole (as it once did) made its extra disk 17× the artifact it chose. A probe builds its file in the step's private
build folder beside `out/` (never published, the executor removes the folder when the step ends in any way), measures
it exactly as a `perplexity` step would measure it stored (qbuild.evaluate.quality.measure: same windows, runtime and
reference), removes it through the store's guarded helper as soon as it is measured, and stores only perplexity.json
and divergence.json, with the file's size, bits per weight and sha256 in its manifest. At most one probe file per
running step exists at a time. The search's selection builds the chosen file again, from the same inputs (llama.cpp's
quantization is deterministic: it checks the sha256 against the probe's).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qbuild.plugins import StepContext

SCRATCH = "probe"            # the probe's folder in its step's build folder (ctx.out's parent), not in out/
PROBED_FILE = "model.gguf"


def scratch_dir(ctx: StepContext) -> Path:
    return ctx.out.parent / SCRATCH


def run_probe(ctx: StepContext) -> dict:
    """Quantize under `params.build` into the scratch, measure under `params.measure`, remove the file."""
    from qbuild.plugin_services import measure
    from qbuild.plugins import sha256_file
    from qbuild.quantize.gguf.options import OUTPUT_FILE  # here: the gguf package imports the search, which imports this
    from qbuild.quantize.gguf.run import quantize_into

    owned = ctx.owned()
    scratch = owned.mkdirs(scratch_dir(ctx), within=ctx.out.parent)
    try:
        path = scratch / PROBED_FILE
        built = quantize_into(ctx, ctx.params["build"], path)
        size, sha256 = path.stat().st_size, sha256_file(path)
        weights = gguf_weights(Path(ctx.inputs["gguf"]) / OUTPUT_FILE)
        result = measure(dataclasses.replace(ctx, params=ctx.params["measure"]), scratch)
    finally:   # measured or failed: the file goes now, not when the step's folder does
        owned.remove(scratch, within=ctx.out.parent)
    metrics = {**result["metrics"], "gguf_bytes": size, "bpw": size * 8 / weights}
    info = {**result.get("info", {}), "quantized": built,
            "probed_files": [{"path": PROBED_FILE, "size": size, "sha256": sha256}]}
    return {"format": "metrics", "metrics": metrics, "info": info}


def gguf_weights(path: Path) -> int:
    """Number of weights (elements of every tensor) in a GGUF file: the denominator of bits per weight."""
    from qbuild.plugin_services import check_gguf

    return check_gguf(path).elements   # the bounded header walk: no decoding of every metadata field
