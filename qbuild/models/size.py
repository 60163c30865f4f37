"""How big a model is, and how much memory this machine gives: the figures the plan-time memory check
(qbuild.pipeline.memory_fit) and the quantizers that offload to disk (qbuild.quantize.modelopt.run) size steps by.
Never imports torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GB = 1 << 30
HUB_SHARD = 5 * GB   # transformers' default max_shard_size: what a hub checkpoint's shards are at most
QUANTIZER_OVERHEAD = 1.7 * GB
SHARD_QUANTIZER_OVERHEAD = 1.0 * GB
RUNTIME_OVERHEAD = 1.2 * GB
# a GGUF's import (float32 weights and the dequantized tensors on their way) peaked at 1.37 GB for SmolLM2-135M's
# 134.5M parameters and at 2.32 GB for a 309M-parameter GGUF: about 6.1 bytes a parameter above 0.5 GB of runtime
IMPORT_BYTES_PER_PARAMETER = 6.2
IMPORT_OVERHEAD = 0.6 * GB


@dataclass(frozen=True)
class ModelSize:
    total: int          # bytes of the checkpoint at 2 bytes a parameter (or its files)
    outside: int        # of which outside the decoder layers (embeddings, head)
    layer: int          # one decoder layer
    parameters: int
    experts: bool = False   # MoE: transformers fuses the experts on load, so it evaluates the whole model
    largest_shard: int = 0  # bytes of the largest safetensors file, where the files are at hand
    file_parameters: int = 0   # a GGUF source's parameters, counted from its tensors (0: not a GGUF)


def model_size(info: dict, source: Path | None = None) -> ModelSize | None:
    """The checkpoint's size from its config (HF config.json keys, as qbuild.planning.models.model_info gives them);
    None where the config lacks the dimensions."""
    text = info.get("text_config") or info
    in_file = int(info.get("gguf_elements") or 0)
    try:
        hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        # a GGUF without the dimensions still says how many parameters its tensors hold
        return ModelSize(2 * in_file, 0, 0, in_file, file_parameters=in_file) if in_file else None
    kv = int(text.get("num_key_value_heads") or heads)
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    ffn = experts * int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0) if experts \
        else int(text.get("intermediate_size") or 4 * hidden)
    layer_params = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * ffn
    outside_params = vocab * hidden * (1 if text.get("tie_word_embeddings", info.get("tie_word_embeddings")) else 2)
    params = outside_params + layers * layer_params
    total = 2 * params
    largest = 0
    if source is not None:   # the files say exactly; the layers share what the config does not explain
        sizes = [f.stat().st_size for f in Path(source).glob("*.safetensors")]
        if sizes:
            total, largest = sum(sizes), max(sizes)
    layer = max(0, total - 2 * outside_params) // max(1, layers)
    return ModelSize(total, min(total, 2 * outside_params), layer, params, experts > 0, largest, in_file)


def machine_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
                   ) -> tuple[int, str]:
    """(bytes, where the figure comes from): QBUILD_MEMORY_GB, else the smallest of RAM and the limits of the memory
    cgroup this process is in and of every cgroup above it (cgroup v2's memory.max, or v1's memory.limit_in_bytes: a
    container, a systemd slice, a job scheduler's job with its steps and tasks nested inside it)."""
    declared = os.environ.get("QBUILD_MEMORY_GB")
    if declared:
        return int(float(declared) * GB), "QBUILD_MEMORY_GB"
    best = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM")
    for limit_file, what in _cgroup_limit_files(proc_cgroup, root):
        try:
            limit = limit_file.read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < best[0]:
            best = int(limit), what
    return best


def _cgroup_limit_files(proc_cgroup: Path, root: Path) -> list[tuple[Path, str]]:
    """The memory limit files of this process's cgroup and of each cgroup above it, up to the root of the hierarchy
    as the process sees it (a container's): v2 (the `0::/path` line) and v1 (the `N:memory:/path` line)."""
    files: list[tuple[Path, str]] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        for depth in range(len(parts), 0, -1):   # the process's own cgroup first, then each ancestor
            own = "this cgroup's" if depth == len(parts) else f"the enclosing cgroup {'/'.join(parts[:depth])}'s"
            files.append((base.joinpath(*parts[:depth]) / name, f"{own} {name}"))
    files += [(root / "memory.max", "the root cgroup's memory.max"),
              (root / "memory" / "memory.limit_in_bytes", "the root cgroup's memory.limit_in_bytes")]
    return files
