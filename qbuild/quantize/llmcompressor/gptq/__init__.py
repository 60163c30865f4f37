"""GPTQ through llm-compressor, as a small package: options.py (the variant's schema), method.py (the plan side: the
registered Method) and run.py (the worker's side: the GPTQModifier, run by llm-compressor's shared runner; imported
only in a step's worker). The GPTQ *format* (TGI, LMDeploy, ExLlamaV2) is the gptqmodel method's: gptqmodel/."""

from qbuild.quantize.llmcompressor.gptq.method import GPTQ  # noqa: F401  (importing the package registers the method)
from qbuild.quantize.llmcompressor.gptq.options import GPTQVariant  # noqa: F401
