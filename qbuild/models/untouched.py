"""The tensors a quantization leaves as they were keep the source's precision (issue 47).

A quantized GGUF is imported as float32, its exact dequantized values, so the baseline and every calibration see
the file's numbers. A quantized artifact built on it would then carry what its scheme does not touch (embeddings,
an untied head) in float32: an RTN W4A16 artifact of a 0.5B model was 1.2 GiB, larger than the Q8_0 GGUF it came
from. The plan asks for a narrower dtype (`untouched_dtype` in the quantize step's params, so the key follows) and
the method's worker calls `narrow_untouched` after saving: every tensor of at least two dimensions that is a
bit-identical float32 copy of the input checkpoint's is written in that dtype. Norms and biases (1-D, stored F32
in a GGUF as well) stay float32, as do quantization outputs (scales, packed weights: not copies of an input tensor)
and any tensor whose values would not fit the narrower type.
"""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.contract.step import StepContext

PARAM = "untouched_dtype"


def with_untouched_dtype(params: dict, ctx) -> dict:
    """`params` with the plan's untouched_dtype (PlanContext.untouched_dtype) when it has one; unchanged (and so
    the step's key) otherwise."""
    dtype = ctx.untouched_dtype()
    return {**params, PARAM: dtype} if dtype else params


def _tensor_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file() and not p.is_symlink())


def _source_index(folder: Path) -> dict[str, Path]:
    """tensor name → the safetensors file of the input checkpoint holding it."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in _tensor_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                where[name] = file
    return where


def narrow_untouched(ctx: StepContext) -> dict:
    """Rewrite ctx.out's safetensors files with the untouched float32 matrices in ctx.params[untouched_dtype];
    nothing when the step has no such param. Returns {"dtype", "tensors", "bytes_saved"} for the step's info."""
    dtype_name = ctx.params.get(PARAM)
    if not dtype_name:
        return {}
    import torch
    from safetensors import safe_open
    from safetensors.torch import save

    dtype = getattr(torch, dtype_name)
    limit = torch.finfo(dtype).max
    sources = _source_index(Path(ctx.inputs["model"]))
    narrowed, saved = 0, 0
    root = ctx.owned()
    for file in _tensor_files(ctx.out):
        tensors: dict[str, torch.Tensor] = {}
        changed = False
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                tensor = f.get_tensor(name)
                if tensor.dtype == torch.float32 and tensor.dim() >= 2 and name in sources:
                    with safe_open(str(sources[name]), framework="pt") as src:
                        original = src.get_tensor(name)
                    if (original.shape == tensor.shape and torch.equal(original, tensor)
                            and bool(tensor.abs().max() <= limit)):
                        saved += tensor.numel() * (4 - dtype.itemsize)
                        tensor = tensor.to(dtype)
                        narrowed += 1
                        changed = True
                tensors[name] = tensor
        if changed:
            root.write_bytes(file, save(tensors, metadata=metadata), within=ctx.out)
    _fix_index_size(ctx, saved)
    if narrowed:
        ctx.log(f"{narrowed} untouched tensor(s) written in {dtype_name} (the source's precision), {saved / 2**20:.1f} "
                "MiB smaller")
    return {"untouched_dtype": dtype_name, "untouched_tensors": narrowed}


def _fix_index_size(ctx: StepContext, saved: int) -> None:
    """A sharded checkpoint's index states the tensors' total size: keep it true."""
    index = ctx.out / "model.safetensors.index.json"
    if not saved or not index.is_file():
        return
    data = json.loads(index.read_text())
    meta = data.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("total_size"), int):
        meta["total_size"] -= saved
        ctx.owned().write_bytes(index, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), within=ctx.out)
