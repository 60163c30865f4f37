"""Quantization methods. Each method is one adapter module, registered here by name.

An adapter module defines:
  Variant        pydantic model of the recipe entry (method: Literal[...]; extra keys forbidden)
  EXTRA          the `pip install 'qbuild[EXTRA]'` that provides its libraries
  REQUIRES       import names that must be installed (checked with find_spec, never imported at plan time)
  check(variant, model_info)         plan-time validation (shapes, unsupported combinations)
  plan(variant, ctx) -> Step         adds its steps to the plan and returns the step producing the artifact
Heavy libraries are imported inside the functions its steps run, never at module level.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

METHODS: dict[str, str] = {
    "gguf": "qbuild.quantize.gguf",
    "gptq": "qbuild.quantize.gptq",
    "awq": "qbuild.quantize.awq",
    "fp8": "qbuild.quantize.fp8",
    "rtn": "qbuild.quantize.rtn",
    "modelopt": "qbuild.quantize.modelopt",
}

# Out-of-tree methods: QBUILD_PLUGIN_METHODS="name=package.module,other=pkg.mod"
for _entry in filter(None, os.environ.get("QBUILD_PLUGIN_METHODS", "").split(",")):
    _name, _, _module = _entry.partition("=")
    METHODS[_name.strip()] = _module.strip()


def adapter(method: str) -> ModuleType:
    return importlib.import_module(METHODS[method])


def variant_models() -> list[type]:
    return [adapter(m).Variant for m in METHODS]
