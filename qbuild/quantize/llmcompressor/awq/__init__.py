"""AWQ through llm-compressor, as a small package: options.py (the variant's schema; the AutoAWQ GEMM layout's
constants and its `awq` format), method.py (the plan side: the registered Method, its AutoAWQ checks, the convert
step), run.py (the worker's side: the AWQ modifiers run by llm-compressor's shared runner, and the convert step) and
gemm.py (the exact compressed-tensors → AutoAWQ GEMM converter run.py calls; imported only in a step's worker)."""

from qbuild.quantize.llmcompressor.awq.method import AWQ  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.llmcompressor.awq.options import AWQ_FORMAT, AWQVariant  # noqa: F401
