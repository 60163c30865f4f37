"""The integer weight-only schemes (W{bits}A16, grouped) as several methods take them (llm-compressor's, AutoRound):
their variant fields (IntWeightVariant), the plan-time group-size check on them and the ignore rules it resolves.
Plan side: no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from qbuild.contract.shapes import check_group_size
from qbuild.contract.variant import VariantBase, group_size_value


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


def check_int_weights(variant: IntWeightVariant, ctx, field: str) -> tuple[list[str], str]:
    """Plan-time shape check from config.json: (extra ignore rules to apply, the sentence saying so), both empty
    unless on_indivisible: ignore had to act."""
    return check_group_size(variant.group_size, ctx.model_info(), variant.ignore, field, variant.on_indivisible,
                            method=variant.method.upper())


def resolved_ignore(p: dict) -> list[str]:
    return list(p.get("ignore", [])) + list(p.get("auto_ignore", []))
