"""Base pydantic model for every recipe section: unknown keys are errors (typos never pass silently)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def canonical(self) -> dict:
        """The resolved section (defaults filled in) as plain JSON data: what gets hashed."""
        return self.model_dump(mode="json", by_alias=True)
