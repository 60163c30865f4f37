"""Engine build targets (e.g. TensorRT-LLM). Each target is one adapter module, registered by name.

An adapter module defines:
  Target         pydantic model of the recipe entry (type: Literal[...]; extra keys forbidden)
  EXTRA, REQUIRES, check(target, variant) and plan(target, variant_step, ctx) -> Step, as for quantize.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from qbuild.build.base import NoTarget

TARGETS: dict[str, str] = {
    "tensorrt-llm": "qbuild.build.tensorrt_llm",
    "trtllm-pytorch": "qbuild.build.trtllm_pytorch",
}


def adapter(kind: str) -> ModuleType:
    return importlib.import_module(TARGETS[kind])


def target_models() -> list[type]:
    models = [adapter(t).Target for t in TARGETS]
    # pydantic needs at least one member in the union; NoTarget never validates.
    return models or [NoTarget]
