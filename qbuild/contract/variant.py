"""What every quantization variant shares."""

from __future__ import annotations

from pydantic import Field, model_validator

from qbuild.base.names import NAME_PATTERN  # the one name grammar (qbuild/base/names.py)
from qbuild.base.schema_base import StrictModel


class EnvOption(StrictModel):
    """A backend environment of one's own: a requirement list (created with uv) or an existing interpreter."""

    packages: list[str] | None = Field(None, min_length=1, description="Requirements of a uv-created environment.")
    python: str | None = Field(None, description="An existing interpreter, used as it is (e.g. /opt/trtllm/bin/python).")

    @model_validator(mode="after")
    def _one(self):
        if (self.packages is None) == (self.python is None):
            raise ValueError("give either packages: [...] or python: PATH")
        return self


class VariantBase(StrictModel):
    name: str = Field(pattern=NAME_PATTERN, description="Variant name, used in refs: recipe/variant:tag.")
    env: str | EnvOption | None = Field(
        None, description="Backend environment the quantization runs in: a built-in one (gptqmodel, llm-compressor, "
                          "modelopt, auto-round, tensorrt-llm, vllm), {packages: [...]} or {python: PATH}. "
                          "Default: the method's own (qbuild's environment for most).")

    def needs_calibration(self) -> bool:
        return False

    def describe(self) -> str:
        """Short human label of the quantization, e.g. 'Q4_K_M' or 'W4A16 g64'."""
        return ""

    def quant_params(self) -> dict:
        """The params that define the quantized weights (everything but the display name)."""
        data = self.canonical()
        data.pop("name", None)
        data.pop("env", None)   # where it runs enters the key as the environment's resolved versions (Step.backend_env)
        return data


def group_size_value(v: int | None) -> int | None:
    """A recipe's group_size: a power of two ≥ 8, or null / -1 for one scale per output channel (→ None)."""
    if v is None or v == -1:
        return None
    if v < 8 or v & (v - 1):
        raise ValueError(f"group_size must be a power of two ≥ 8, or -1 for per-channel (got {v})")
    return v
