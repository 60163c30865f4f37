"""GGUF through llama.cpp, as a small package: options.py (the variant's schema and llama.cpp's type tables),
method.py (the plan side: the registered Method and its plan-time checks) and run.py (the workers' side: convert,
imatrix, quantize, imported only in a step's worker). The per-tensor search (`search:`) lives beside them:
search_options.py (its schema and type tables), search.py (its steps' planning, allocation and selection) and
probe.py (a probe step's runner); llamacpp_log.py keeps llama.cpp's log while run.py calls the library in-process."""

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
