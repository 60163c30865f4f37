"""FP8 (E4M3) through llm-compressor, as a small package: options.py (the variant's schema, its data-free scheme),
method.py (the plan side: the registered Method) and run.py (the worker's side: the QuantizationModifier, run by
llm-compressor's shared runner; imported only in a step's worker)."""

from qbuild.quantize.llmcompressor.fp8.method import FP8  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.llmcompressor.fp8.options import FP8Variant  # noqa: F401
