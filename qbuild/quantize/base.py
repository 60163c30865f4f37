"""What every quantization variant shares."""

from __future__ import annotations

from pydantic import Field

from qbuild.names import NAME_PATTERN  # the one name grammar (qbuild/names.py)
from qbuild.schema_base import StrictModel


class VariantBase(StrictModel):
    name: str = Field(pattern=NAME_PATTERN, description="Variant name, used in refs: recipe/variant:tag.")

    def needs_calibration(self) -> bool:
        return False

    def describe(self) -> str:
        """Short human label of the quantization, e.g. 'Q4_K_M' or 'W4A16 g64'."""
        return ""

    def quant_params(self) -> dict:
        """The params that define the quantized weights (everything but the display name)."""
        data = self.canonical()
        data.pop("name", None)
        return data
