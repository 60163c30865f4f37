"""Interface shared by engine build targets."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qbuild.schema_base import StrictModel


class TargetBase(StrictModel):
    variants: list[str] | Literal["all"] = Field("all", description="Which variants to build this target for.")


class NoTarget(TargetBase):
    """Placeholder so the schema is valid while no target is registered."""

    type: Literal["__none__"]
