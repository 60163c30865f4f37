"""The llm-compressor methods' shared options: the key's tools, the compressed-tensors format they write (a
service's), the families they cannot build, the integer weight-only fields (IntWeightVariant) and the params → compressed-
tensors arguments their modifiers are built from. Imported at plan time: no torch, no llm-compressor."""

from __future__ import annotations

from qbuild.plugin_services import COMPRESSED_TENSORS  # noqa: F401  (the shared names the family imports from here)
from qbuild.plugins import IntWeightVariant, UnsupportedFamily, resolved_ignore  # noqa: F401

# distributions whose versions enter the key of a quantize step
TOOLS = ("llmcompressor", "compressed-tensors", "torch", "transformers", "safetensors")
# variant fields holding compressed-tensors module patterns (exact names or 're:' regexes): each must match a module
PATTERN_FIELDS = ("ignore", "targets")

# The compressed-tensors format they write is a service's (qbuild/models/compressed_tensors.py): AutoRound writes it
# too, and trtllm-pytorch takes it

# Architectures whose llm-compressor checkpoints qbuild cannot evaluate, found by the architecture matrix
# (tests/test_architectures.py, docs/architectures.md): the methods below declare them (Method.unsupported_families)
ASYMMETRIC_QWEN3_MOE = UnsupportedFamily(
    "qwen3_moe",
    "transformers (5.x) cannot load an asymmetric compressed-tensors checkpoint of Qwen3-MoE's fused experts: its "
    "DecompressExperts step fails on the zero points, so the artifact could not be evaluated; sym: true "
    "(no zero point) loads",
    variant_condition="sym is false (AWQ's default)",
    variant_applies=lambda option: option("sym", True) is False)
MIXTRAL_EXPERTS = UnsupportedFamily(
    "mixtral",
    "llm-compressor writes Mixtral's experts one module each (block_sparse_moe.experts.N), and transformers 5 "
    "reads Mixtral's experts fused (mlp.experts.gate_up_proj): it leaves them at random (KLD 1.07-1.10 against "
    "the baseline for every scheme on the matrix's tiny Mixtral, FP8 included), so qbuild cannot evaluate the "
    "checkpoint")


def weight_args(p: dict, **extra) -> dict:
    """compressed-tensors QuantizationArgs for an integer weight scheme."""
    args = {"num_bits": p["bits"], "type": "int", "symmetric": p["sym"], **extra}
    if p.get("group_size"):
        args.update(strategy="group", group_size=p["group_size"])
    else:
        args.update(strategy="channel")
    return args
