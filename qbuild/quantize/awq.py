"""AWQ through llm-compressor: activation-aware channel scaling, then integer weights (W4A16 etc.).

llm-compressor's AWQModifier searches per-channel scales on the shared calibration set and a
QuantizationModifier then rounds the scaled weights; output is compressed-tensors (vLLM,
transformers). AutoAWQ is deprecated and points here.
"""

from __future__ import annotations

import contextlib
from typing import Literal

from pydantic import Field

from qbuild.plugins import methods
from qbuild.quantize import llmcompressor as lc


class AWQVariant(lc.IntWeightVariant):
    """AWQ (Lin et al.): calibrated weight-only integer quantization by activation-aware scaling."""

    method: Literal["awq"]
    sym: bool = Field(False, description="Symmetric weights; AWQ is normally asymmetric (zero points).")
    duo_scaling: bool | Literal["both"] = Field(
        True, description="Scale search uses activations and weights (true), activations only (false), or both halves.")
    n_grid: int = Field(20, ge=1, le=200, description="Grid points of the per-mapping scale search.")

    def needs_calibration(self) -> bool:
        return True

    def describe(self) -> str:
        return "AWQ " + super().describe()


@contextlib.contextmanager
def cpu_pin_memory_workaround():
    """llm-compressor 0.14.0.1: AWQ pins its cached activations (`IntermediatesCache.pin_memory`) to
    speed up host→GPU copies, and `Tensor.pin_memory()` raises on a machine without an accelerator.
    Pinning is only an optimisation, so with no accelerator we make it a no-op for the duration of the
    step. Remove once upstream guards it.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.__dict__["pin_memory"]
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


@methods.register
class AWQ(lc.LLMCompressorMethod):
    name = "awq"
    options = AWQVariant

    def modifiers(self, p: dict) -> list:
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [AWQModifier(duo_scaling=p["duo_scaling"], n_grid=p["n_grid"]),
                QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": lc.weight_args(p)}},
                                     ignore=lc.resolved_ignore(p))]

    def workarounds(self):
        return cpu_pin_memory_workaround()
