"""AutoRound (Intel's auto-round): integer weights tuned by signed gradient descent (SignRound).

For each decoder block, AutoRound learns the rounding offsets and clipping ranges of its weights
by `iters` steps of signed gradient descent on the block's output error over the shared calibration
set, then exports in one of the formats auto-round writes:

  format: auto_round       auto-round's own layout (default): transformers (with auto-round installed),
                           vLLM and SGLang load it; evaluated here by the transformers runtime (on CPU
                           through auto-round's torch kernels, which run in float16)
  format: llm_compressor   compressed-tensors (pack-quantized): vLLM, SGLang, transformers
  format: auto_gptq        the GPTQ layout (quant_method gptq): vLLM, SGLang, TGI; transformers reads it through
                           gptqmodel, so it is evaluated in the `gptqmodel` backend environment
  format: auto_awq         the AutoAWQ GEMM layout (quant_method awq; 4-bit, sym: false): vLLM, SGLang, TGI;
                           evaluated in the `gptqmodel` environment too

Tuning runs on CPU (slowly: keep iters and samples small there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from qbuild.base.files import dir_size
from qbuild.contract.formats import HF_RUNTIMES, FormatSpec, register_format
from qbuild.contract.plugin import Method, methods
from qbuild.contract.shapes import is_ignored
from qbuild.contract.step import Step, StepContext
from qbuild.quantize import llmcompressor as lc

TOOLS = ("auto-round", "torch", "transformers", "accelerate", "safetensors")
# AutoRound's own export (quant_method auto-round), declared here: transformers, vLLM and SGLang load it
AUTO_ROUND = register_format(FormatSpec("auto-round", "HF checkpoint in AutoRound's format (quant_method auto-round)",
                                        load_tools=("auto-round",), evaluated_by=HF_RUNTIMES,
                                        loads_in=("transformers", "vllm", "sglang"))).name
# its other exports are formats other plugins declare (llm-compressor's, gptqmodel's, awq_gemm's), named here: a
# method module imported from here would register its method ahead of this one
FORMATS = {"auto_round": AUTO_ROUND, "llm_compressor": lc.COMPRESSED_TENSORS, "auto_gptq": "gptq", "auto_awq": "awq"}


class AutoRoundVariant(lc.IntWeightVariant):
    """AutoRound (SignRound): weight-only integer quantization with tuned rounding, W{bits}A16."""

    method: Literal["autoround"]
    iters: int = Field(200, ge=0, le=10000, description="Signed-gradient steps per block (0 = AutoRound's "
                                                         "optimized round-to-nearest, no tuning).")
    lr: float | None = Field(None, gt=0, description="Learning rate of the rounding offsets; default 1/iters.")
    batch_size: int = Field(8, ge=1, description="Calibration samples per tuning step.")
    format: Literal["auto_round", "llm_compressor", "auto_gptq", "auto_awq"] = Field(
        "auto_round", description="Export layout: auto_round (transformers, vLLM, SGLang), llm_compressor "
                                  "(compressed-tensors), auto_gptq (GPTQ), auto_awq (AWQ GEMM).")

    @model_validator(mode="after")
    def _format_fits_scheme(self):
        if self.format == "auto_awq":   # the AutoAWQ GEMM layout: 4-bit, grouped, with zero points
            if self.bits != 4:
                raise ValueError(f"format auto_awq packs 4-bit weights only (AWQ GEMM kernels), not {self.bits}")
            if self.sym or self.group_size is None:
                raise ValueError("format auto_awq stores grouped weights with zero points: set sym: false and a "
                                 "group_size")
        return self

    def needs_calibration(self) -> bool:
        return True   # iters: 0 still reads calibration activations (auto-round's optimized RTN weighs by them)

    def describe(self) -> str:
        return f"AutoRound {super().describe()} ({self.iters} iters, {self.format})"


@methods.register
class AutoRound(Method):
    name = "autoround"
    options = AutoRoundVariant
    extra = "autoround"
    requires = ("auto_round", "torch", "transformers")
    runs_in_env = True   # `env: auto-round` (or your own auto-round version) runs the tuning outside qbuild's environment

    def check(self, variant: AutoRoundVariant, ctx, field: str) -> None:
        _, note = lc.check_int_weights(variant, ctx, field)
        if note:
            ctx.warn(note)

    def plan(self, variant: AutoRoundVariant, ctx) -> Step:
        params = variant.quant_params()
        auto_ignore, _ = lc.check_int_weights(variant, ctx, "variants")   # check() has reported it
        if auto_ignore:
            params["auto_ignore"] = list(auto_ignore)
        return ctx.add(Step("quantize", f"quantize[{variant.name}]", params, "qbuild.quantize.autoround:run",
                            inputs={"model": ctx.model(), "calibration": ctx.calibration()}, tools=TOOLS,
                            threads=ctx.threads, variant=variant.name, format=FORMATS[variant.format],
                            scheme=f"w{variant.bits}a16", backend_env=ctx.backend_env(variant, self),
                            memory="whole-model", gpu_capable=True))


# --- worker side ------------------------------------------------------------------------------------
def lift_export(export: Path, out: Path, root) -> None:
    """Move the checkpoint auto-round wrote somewhere under `export` (it adds its own <model>-w4g64 folder)
    up into `out`. The folder is found by searching inside `export` only, never taken from auto-round's
    return value (a str for one format, a list for several), and files are renamed, never copied.

    `root` is the step's store (an OwnedRoot): every move and the removal of `export` are confined to `out`; an
    export folder that is a symlink or resolves outside `out` is refused before anything moves."""
    if export.is_symlink() or not export.is_dir():
        raise RuntimeError(f"auto-round's export folder {export} is {'a symlink' if export.is_symlink() else 'missing'}; "
                           "refusing to move anything out of it")
    root.confine(export, within=out)
    configs = sorted(export.rglob("config.json"))
    if len(configs) != 1:
        raise RuntimeError(f"expected one exported checkpoint under {export}, found {len(configs)}")
    folder = configs[0].parent
    root.confine(folder / "config.json", within=export)
    for f in sorted(folder.iterdir()):
        root.move(f, out / f.name, within=out)
    root.remove(export, within=out)


def calibration_samples(path: Path) -> tuple[list[dict], int]:
    """The shared calibration set as auto-round's list-of-batches dataset, and its sequence length.

    auto-round treats an all-ones attention mask like no mask and then mis-shapes block inputs for some
    models (its own loader masks the last position for that reason); the last position has no next-token
    target and no later token attends to it, so masking it changes nothing else."""
    import torch

    from qbuild.calibration.build import load_calibration

    ids, mask = load_calibration(path)
    samples = []
    for i in range(len(ids)):
        m = torch.from_numpy(mask[i: i + 1]).long().clone()
        m[:, -1] = 0
        samples.append({"input_ids": torch.from_numpy(ids[i: i + 1]).long(), "attention_mask": m})
    return samples, int(ids.shape[1])


def run(ctx: StepContext) -> dict:
    import torch
    from auto_round import AutoRound as AutoRoundTuner
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = ctx.params
    src = Path(ctx.inputs["model"])
    device = ctx.torch_device()
    ctx.progress(0, 3, "loading model")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    samples, seqlen = calibration_samples(Path(ctx.inputs["calibration"]))
    ignore = lc.resolved_ignore(p)
    # qbuild's ignore rules (exact names or 're:' patterns, as for llm-compressor) → auto-round's per-layer
    # override: 16 bits means "leave this layer unquantized"
    layer_config = {name: {"bits": 16} for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and is_ignored(name, ignore)}
    extra = {"lr": p["lr"]} if p.get("lr") else {}
    tuner = AutoRoundTuner(model, tokenizer, scheme=f"W{p['bits']}A16", bits=p["bits"],
                           group_size=p["group_size"] or -1, sym=p["sym"], iters=p["iters"], dataset=samples,
                           nsamples=len(samples), seqlen=seqlen, batch_size=min(p["batch_size"], len(samples)),
                           layer_config=layer_config, device_map=device, seed=0,
                           # torch.compile costs ~10 GB of RAM and a compiler run; only worth it on a GPU
                           enable_torch_compile=device == "cuda", **extra)
    ctx.progress(1, 3, f"tuning {p['iters']} iters per block on {device}")
    export = ctx.out / "_export"
    tuner.quantize_and_save(str(export), format=p["format"])
    ctx.progress(2, 3, f"exported {p['format']}")
    lift_export(export, ctx.out, ctx.owned())
    import json
    from importlib.metadata import version

    qc = json.loads((ctx.out / "config.json").read_text()).get("quantization_config", {})
    ctx.progress(3, 3, "done")
    return {"format": FORMATS[p["format"]], "metrics": {"size_bytes": dir_size(ctx.out)},
            "info": {"export": p["format"], "quant_method": qc.get("quant_method"),
                     "packing_format": qc.get("packing_format") or qc.get("format"),
                     "unquantized": sorted(layer_config), "calibration_samples": len(samples), "seq_len": seqlen,
                     "device": device, "auto-round": version("auto-round"),
                     "threads": ctx.threads}}
