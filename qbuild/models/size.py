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


@dataclass(frozen=True)
class ModelSize:
    total: int          # bytes of the checkpoint at 2 bytes a parameter (or its files)
    outside: int        # of which outside the decoder layers (embeddings, head)
    layer: int          # one decoder layer
    parameters: int
    experts: bool = False   # MoE: transformers fuses the experts on load, so it evaluates the whole model
    largest_shard: int = 0  # bytes of the largest safetensors file, where the files are at hand


def model_size(info: dict, source: Path | None = None) -> ModelSize | None:
    """The checkpoint's size from its config (HF config.json keys, as qbuild.planning.models.model_info gives them);
    None where the config lacks the dimensions."""
    text = info.get("text_config") or info
    try:
        hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
        heads = int(text["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    head_dim = int(text.get("head_dim") or hidden // heads)
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
    return ModelSize(total, min(total, 2 * outside_params), layer, params, experts > 0, largest)


def machine_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
                   ) -> tuple[int, str]:
    """(bytes, where the figure comes from): QBUILD_MEMORY_GB, else the smaller of RAM and the limit of the memory
    cgroup this process is in (cgroup v2's memory.max, or v1's memory.limit_in_bytes: a container, a systemd slice,
    a job scheduler's group)."""
    declared = os.environ.get("QBUILD_MEMORY_GB")
    if declared:
        return int(float(declared) * GB), "QBUILD_MEMORY_GB"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file, what in _cgroup_limit_files(proc_cgroup, root):
        try:
            limit = limit_file.read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < total:
            return int(limit), f"this cgroup's {what}"
    return total, "this machine's RAM"


def _cgroup_limit_files(proc_cgroup: Path, root: Path) -> list[tuple[Path, str]]:
    """The memory limit files of this process's cgroup: v2 (the `0::/path` line) and v1 (the `N:memory:/path`
    line), at its own path under `root` and at the root of the hierarchy as the process sees it (a container's)."""
    files: list[tuple[Path, str]] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip().lstrip("/")
        if controllers == "":
            files.append((root / rel / "memory.max", "memory.max"))
        elif "memory" in controllers.split(","):
            files.append((root / "memory" / rel / "memory.limit_in_bytes", "memory.limit_in_bytes"))
    files += [(root / "memory.max", "memory.max"), (root / "memory" / "memory.limit_in_bytes", "memory.limit_in_bytes")]
    return files
