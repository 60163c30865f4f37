"""NVIDIA ModelOpt, as a small package: options.py (the variant's schema and the scheme tables), method.py (the plan
side: the registered Method) and run.py (the worker's side: calibrate, export, validate; imported only in a step's
worker)."""

from qbuild.quantize.modelopt.method import ModelOpt  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.modelopt.options import DECODER_TYPES, ModelOptVariant  # noqa: F401
