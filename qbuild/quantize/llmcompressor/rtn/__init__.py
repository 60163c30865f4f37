"""Round-to-nearest through llm-compressor, as a small package: options.py (the variant's schema, its data-free
scheme), method.py (the plan side: the registered Method, and `search:`'s steps through llmcompressor/search.py) and
run.py (the worker's side: the QuantizationModifier, run by llm-compressor's shared runner; imported only in a step's
worker)."""

from qbuild.quantize.llmcompressor.rtn.method import RTN  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.llmcompressor.rtn.options import RTNVariant  # noqa: F401
