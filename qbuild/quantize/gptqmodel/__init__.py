"""GPTQ through gptqmodel, as a small package: options.py (the variant's schema and the GPTQ format), method.py (the
plan side: the registered Method) and run.py (the worker's side: quantize, save; imported only in a step's worker,
in the gptqmodel backend environment by default)."""

from qbuild.quantize.gptqmodel.method import GPTQModel  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.gptqmodel.options import GPTQ, GPTQModelVariant  # noqa: F401
