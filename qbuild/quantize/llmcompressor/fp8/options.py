"""The fp8 method's options: the variant's schema (FP8Variant) and the scheme `model_free_ptq` runs when no
calibration is needed. Imported at plan time: no torch, no llm-compressor."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.plugins import VariantBase


class FP8Variant(VariantBase):
    """FP8 W8A8 (E4M3) with dynamic or calibrated static activation scales."""

    method: Literal["fp8"]
    scheme: Literal["dynamic", "static"] = Field(
        "dynamic", description="dynamic: per-token activation scales at run time, no calibration; "
                               "static: per-tensor activation scales calibrated once.")
    kv_cache: bool = Field(False, description="Also quantize the KV cache to FP8 with calibrated scales.")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"],
                              description="Modules kept in full precision: exact names or 're:<regex>'.")

    def needs_calibration(self) -> bool:
        return self.scheme == "static" or self.kv_cache

    def describe(self) -> str:
        return f"FP8 {self.scheme}" + (" +KV" if self.kv_cache else "")


def model_free_scheme(p: dict) -> str | None:
    """FP8 dynamic without KV-cache scales needs no data: llm-compressor's FP8_DYNAMIC preset, shard by shard."""
    return "FP8_DYNAMIC" if p["scheme"] == "dynamic" and not p["kv_cache"] else None
