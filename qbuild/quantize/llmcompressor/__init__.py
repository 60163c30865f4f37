"""llm-compressor, shared by the methods that run it (gptq, awq, fp8, rtn, smoothquant: a subpackage each, inside this
one), as a small package: options.py (the shared fields, the compressed-tensors format, the families they cannot
build), method.py (the plan side: LLMCompressorMethod and its checks), run.py (the worker's side: oneshot,
model_free_ptq, `run_quantize` that each method's run.py hands its modifiers to; imported only in a step's worker)
and search.py (`search:` on an rtn variant, mixed precision for compressed-tensors). Importing the package gives the
plan side's names (`from qbuild.quantize import llmcompressor as lc`): the names its method subpackages use (with
run.py from their own run side); it registers no method itself (discovery imports the subpackages, base/registry.py)."""

from qbuild.plugins import check_int_weights  # noqa: F401
from qbuild.quantize.llmcompressor.method import (  # noqa: F401
    LLMCompressorMethod,
    model_free_fits,
)
from qbuild.quantize.llmcompressor.options import (  # noqa: F401
    ASYMMETRIC_QWEN3_MOE,
    COMPRESSED_TENSORS,
    MIXTRAL_EXPERTS,
    PATTERN_FIELDS,
    TOOLS,
    IntWeightVariant,
    resolved_ignore,
    weight_args,
)
from qbuild.quantize.llmcompressor.search import CTSearch, check_search, plan_search  # noqa: F401
