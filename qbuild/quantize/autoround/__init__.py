"""AutoRound (auto-round), as a small package: options.py (the variant's schema and the formats it exports),
method.py (the plan side: the registered Method) and run.py (the worker's side: tune, export; imported only in a
step's worker)."""

from qbuild.quantize.autoround.method import AutoRound  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.autoround.options import AUTO_ROUND, FORMATS, AutoRoundVariant  # noqa: F401
