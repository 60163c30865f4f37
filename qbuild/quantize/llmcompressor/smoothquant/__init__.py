"""SmoothQuant + INT8 W8A8 through llm-compressor, as a small package: options.py (the variant's schema), method.py
(the plan side: the registered Method) and run.py (the worker's side: the SmoothQuant and W8A8 modifiers, run by
llm-compressor's shared runner, and the check of how transformers runs the int8 activations; imported only in a step's
worker)."""

from qbuild.quantize.llmcompressor.smoothquant.method import SmoothQuant  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.llmcompressor.smoothquant.options import SmoothQuantVariant  # noqa: F401
