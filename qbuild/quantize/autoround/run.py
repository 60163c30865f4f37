"""The autoround method's worker side (imported only in a step's worker): tune with auto-round on the shared
calibration set, export, lift the exported checkpoint into the step's output."""

from __future__ import annotations

from pathlib import Path

from qbuild.plugin_services import narrow_untouched
from qbuild.plugins import StepContext, dir_size, is_ignored, resolved_ignore
from qbuild.quantize.autoround.options import FORMATS


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

    from qbuild.plugin_services import load_calibration

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
    ignore = resolved_ignore(p)
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
    narrowed = narrow_untouched(ctx)
    import json
    from importlib.metadata import version

    qc = json.loads((ctx.out / "config.json").read_text()).get("quantization_config", {})
    ctx.progress(3, 3, "done")
    return {"format": FORMATS[p["format"]], "metrics": {"size_bytes": dir_size(ctx.out)},
            "info": {"export": p["format"], "quant_method": qc.get("quant_method"),
                     "packing_format": qc.get("packing_format") or qc.get("format"),
                     "unquantized": sorted(layer_config), "calibration_samples": len(samples), "seq_len": seqlen,
                     "device": device, "auto-round": version("auto-round"),
                     "threads": ctx.threads, **narrowed}}
