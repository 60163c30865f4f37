"""The llm-compressor methods' shared options: the key's tools, the compressed-tensors format they write (declared
here), the families they cannot build, the integer weight-only fields (IntWeightVariant) and the params → compressed-
tensors arguments their modifiers are built from. Imported at plan time: no torch, no llm-compressor."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from qbuild.plugins import HF_RUNTIMES, FormatSpec, UnsupportedFamily, VariantBase, group_size_value, register_format

# distributions whose versions enter the key of a quantize step
TOOLS = ("llmcompressor", "compressed-tensors", "torch", "transformers", "safetensors")
# variant fields holding compressed-tensors module patterns (exact names or 're:' regexes): each must match a module
PATTERN_FIELDS = ("ignore", "targets")

# The llm-compressor methods' format (search.py's mixes and AutoRound's llm_compressor export write it too). Which
# engines load it depends on the scheme: vLLM and SGLang (CompressedTensorsWNA16) and TGI (WNA16Loader) take 4- and
# 8-bit integer weights, with or without zero points; LMDeploy's TurboMind reads llm-compressor W4A16 only at group
# sizes 32 and 128, so it is left out
_INT_WEIGHTS = ("vllm", "sglang", "tgi", "transformers")
COMPRESSED_TENSORS = register_format(FormatSpec(
    "compressed-tensors", "HF checkpoint with compressed-tensors quantization (llm-compressor)",
    load_tools=("compressed-tensors",), evaluated_by=HF_RUNTIMES,
    loads_in=("transformers",),                      # transformers decompresses any scheme
    loads_in_by_scheme=(
        ("w4a16", _INT_WEIGHTS),
        ("w8a16", _INT_WEIGHTS),
        ("w3a16", ("transformers",)),                # the serving kernels take 4 and 8 bits only
        ("w2a16", ("transformers",)),
        # W8A8 INT8 (SmoothQuant + RTN/GPTQ): vLLM's int8 scaled-mm kernels (CUDA, and CPUInt8ScaledMMLinearKernel in
        # its CPU build, served here) and SGLang's CompressedTensorsW8A8Int8
        ("w8a8-int8", ("vllm", "sglang", "transformers")),
        ("fp8-dynamic", ("vllm", "sglang", "tgi", "transformers", "trtllm-pytorch")),
        ("fp8-static", ("vllm", "sglang", "tgi", "transformers")),   # TensorRT-LLM's PyTorch backend: no
    ))).name

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


class IntWeightVariant(VariantBase):
    """Fields of the integer weight-only schemes (W{bits}A16, grouped)."""

    bits: Literal[2, 3, 4, 8] = Field(4, description="Weight bits.")
    group_size: int | None = Field(
        128, description="Columns per scale/zero group; null or -1 = one scale per output channel.")
    sym: bool = Field(True, description="Symmetric (no zero point). Asymmetric is often more accurate; "
                                        "check that your serving kernel supports zero points.")
    ignore: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="Modules kept in full precision: exact module names or 're:<regex>' (compressed-tensors rules).")
    on_indivisible: Literal["error", "ignore"] = Field(
        "error", description="When group_size does not divide a layer's input dim: fail at plan time, "
                             "or keep those layers unquantized (the rule is recorded in the step params).")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v):
        return group_size_value(v)

    def describe(self) -> str:
        g = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"W{self.bits}A16 {g} {'sym' if self.sym else 'asym'}"


def weight_args(p: dict, **extra) -> dict:
    """compressed-tensors QuantizationArgs for an integer weight scheme."""
    args = {"num_bits": p["bits"], "type": "int", "symmetric": p["sym"], **extra}
    if p.get("group_size"):
        args.update(strategy="group", group_size=p["group_size"])
    else:
        args.update(strategy="channel")
    return args


def resolved_ignore(p: dict) -> list[str]:
    return list(p.get("ignore", [])) + list(p.get("auto_ignore", []))
