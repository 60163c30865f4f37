"""GGUF through llama.cpp, as a small package: options.py (the variant's schema and llama.cpp's type tables),
method.py (the plan side: the registered Method and its plan-time checks) and run.py (the workers' side: convert,
imatrix, quantize, imported only in a step's worker)."""

from qbuild.quantize.gguf.method import GGUF  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.gguf.options import (  # noqa: F401
    QUANTIZE_PARAMS,
    TENSOR_TYPES,
    TYPE_ALIASES,
    TYPES,
    GGUFVariant,
    block_size,
    fallback_type,
)
