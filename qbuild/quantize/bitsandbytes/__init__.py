"""bitsandbytes through transformers, as a small package: options.py (the variant's schema and the format it
writes), method.py (the plan side: the registered Method) and run.py (the worker's side: quantize on load, save;
imported only in a step's worker)."""

from qbuild.quantize.bitsandbytes.method import BitsAndBytes  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.bitsandbytes.options import FORMAT, FOUR_BIT, BitsAndBytesVariant  # noqa: F401
