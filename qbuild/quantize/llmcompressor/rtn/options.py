"""The rtn method's options: the variant's schema (RTNVariant, with its optional `search:`) and the scheme
`model_free_ptq` runs. Imported at plan time: no torch, no llm-compressor."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.quantize import llmcompressor as lc


class RTNVariant(lc.IntWeightVariant):
    """Round-to-nearest integer weights (min/max scales per group), no calibration data."""

    method: Literal["rtn"]
    search: lc.CTSearch | None = Field(
        None, description="Mix W4A16 / W8A16 per layer to reach an average-bits or KLD budget, chosen from measured "
                          "KL divergence (docs/mixed-precision.md, compressed-tensors); `bits` is then not given.")

    def describe(self) -> str:
        if self.search is not None:
            g = f"g{self.group_size}" if self.group_size else "per-channel"
            return f"RTN {self.search.describe()} {'/'.join(self.search.schemes)} {g}"
        return "RTN " + super().describe()

    def quant_params(self) -> dict:
        data = super().quant_params()
        if data.get("search") is None:
            data.pop("search", None)   # variants without a search keep their earlier keys
        return data


def model_free_scheme(p: dict) -> dict | None:
    """Round-to-nearest needs no data: its weight scheme, shard by shard (a search's mixes go through oneshot)."""
    return None if p.get("search") else {"weights": lc.weight_args(p)}
