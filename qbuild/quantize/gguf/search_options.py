"""The schema of a `gguf` variant's `search:` (GGUFSearch), the type tables it is checked and planned with, and the
allocation record's candidates as the quantization reads them (candidate_overrides). Apart
from the search's steps (qbuild/quantize/gguf/search.py), so the variant's options (qbuild/quantize/gguf/options.py)
import it without importing the steps, whose runners import the gguf method's worker side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from qbuild.plugins import StrictModel

ALLOCATION_FILE = "allocation.json"   # the allocation step's output: candidates[i].tensor_types, read by their quantization

# Candidate types, most precise first. The default for a group is those whose blocks fit its rows (no fallback:
# llama.cpp would silently store another type), below the base type; IQ types below 4 bits need an importance matrix.
DEFAULT_TYPES = ("Q6_K", "Q5_K", "Q5_1", "Q5_0", "IQ4_NL", "Q4_K", "IQ4_XS", "Q4_1", "Q4_0", "Q3_K", "IQ3_S", "Q2_K")
NEEDS_IMATRIX = ("IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
# bits per weight of each ggml type (block bytes × 8 / block columns): ranks types and estimates sizes at plan time
BPW = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_1": 6.0, "Q5_0": 5.5,
       "IQ4_NL": 4.5, "Q4_K": 4.5, "IQ4_XS": 4.25, "Q4_1": 5.0, "Q4_0": 4.5, "Q3_K": 3.4375, "IQ3_S": 3.4375,
       "IQ3_XXS": 3.0625, "Q2_K": 2.625, "IQ2_S": 2.5625, "IQ2_XS": 2.3125, "IQ2_XXS": 2.0625}


class GGUFSearch(StrictModel):
    """Reach a size or KLD budget with per-tensor types chosen from measured KL divergence."""

    max_size_mb: float | None = Field(None, gt=0, description="File size budget in MB (10^6 bytes); objective min_kld.")
    max_bpw: float | None = Field(None, gt=0, description="Bits-per-weight budget (file bits / weights); min_kld.")
    max_kld: float | None = Field(None, gt=0, description="Mean KLD budget against the baseline; objective min_size.")
    objective: Literal["min_kld", "min_size"] | None = Field(
        None, description="min_kld under a size budget, min_size under a KLD budget (default: the budget's).")
    types: list[str] | None = Field(
        None, description="Candidate ggml tensor types. Default: those of " + ", ".join(DEFAULT_TYPES) + " whose "
                          "blocks fit each group's rows (IQ3_S only with an importance matrix).")
    base_type: str = Field("Q8_0", description="Type of every tensor a group does not move (and of the sensitivity "
                                               "models' other tensors).")
    layer_bands: int = Field(1, ge=1, description="Split the layers into this many contiguous bands; each tensor kind "
                                                  "in each band is one group (1: one group per tensor kind).")
    sensitivity_windows: int | None = Field(
        2, ge=1, description="Evaluation windows for each sensitivity measurement (null: all of them); the finalists "
                             "are measured on every window.")
    max_candidates: int = Field(3, ge=1, le=16, description="Allocations built and measured for real.")
    max_minutes: float | None = Field(
        None, gt=0, description="Refuse to start a search whose steps still to build are estimated (from the store's "
                                "history of the same or similar steps, else from the model's size) to take longer, "
                                "and stop one that runs longer (what finished stays stored; a rerun resumes). Never "
                                "part of a key: results do not depend on wall time.")

    @field_validator("types")
    @classmethod
    def _types(cls, v):
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one type")
        out = [t.upper() for t in v]   # each checked against the ggml types by the gguf variant
        return sorted(set(out), key=out.index)

    @field_validator("base_type")
    @classmethod
    def _base(cls, v):
        up = v.upper()
        if up not in ("Q8_0", "F16", "BF16", "F32"):
            raise ValueError(f"{v!r}: the base type is a high-precision one (Q8_0, F16, BF16, F32)")
        return up

    @model_validator(mode="before")
    @classmethod
    def _one_budget(cls, data):
        if not isinstance(data, dict):
            return data
        given = [k for k in ("max_size_mb", "max_bpw", "max_kld") if data.get(k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one budget: max_size_mb, max_bpw or max_kld"
                             + (f" (got {', '.join(given)})" if given else ""))
        implied = "min_size" if given[0] == "max_kld" else "min_kld"
        if data.get("objective") is None:
            data = {**data, "objective": implied}   # resolved here: the key holds the objective, never null
        elif data["objective"] != implied:
            raise ValueError(f"objective {data['objective']} does not go with {given[0]}: use {implied}")
        return data

    def budget(self) -> dict:
        return {k: getattr(self, k) for k in ("max_size_mb", "max_bpw", "max_kld") if getattr(self, k) is not None}

    def describe(self) -> str:
        (name, value), = self.budget().items()
        return f"search {name.removeprefix('max_')}≤{value:g} {self.objective}"


def candidate_overrides(allocation_dir: Path, index: int) -> list[dict]:
    """The tensor_types of allocation candidate `index` (what its quantize step passes to llama.cpp)."""
    record = json.loads((Path(allocation_dir) / ALLOCATION_FILE).read_text())
    return record["candidates"][index]["tensor_types"]
