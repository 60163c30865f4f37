"""The plugin surface, plan side: the one module a plugin's plan side imports from. The plugin base classes and their
registries, the step a plugin plans and the context its runner gets, format declarations, the variant options base,
the plan-time shape checks, the errors it raises, and the small helpers of qbuild's lowest layer that plugins use on
either side (a directory's size, running an external tool into the step log, the GPU/CPU probes, distribution
versions, hashing a file, the mixed-precision searches' knapsack), and the integer weight-only options several
methods take (IntWeightVariant, check_int_weights, resolved_ignore).

    from qbuild.plugins import FormatSpec, Method, Step, StepContext, VariantBase, methods, register_format

    @methods.register
    class MyMethod(Method):
        name = "my-method"            # the recipe's `method:` value
        options = MyVariant           # pydantic model of the recipe entry (method: Literal["my-method"])
        extra = "my-extra"            # pip install 'qbuild[my-extra]' (or your package) provides...
        requires = ("mylib",)         # ...these import names, checked at plan time (never imported then)
        unsupported_families = ()     # UnsupportedFamily(...): model architectures it cannot build, refused at plan time
        def plan(self, variant, ctx: PlanningContext) -> Step:
            return ctx.add(Step("quantize", f"quantize[{variant.name}]", variant.quant_params(),
                                "mypackage.run:run", inputs={"model": ctx.model()}, format=..., scheme=...))

A step's runner is one string, "package.module:function" (a module-level function, imported only in the step's
worker); an in-tree method's is "qbuild.quantize.<method>.run:run" (an llm-compressor method's
"qbuild.quantize.llmcompressor.<method>.run:run").

What a plugin needs from qbuild's services and planning (loading the calibration set, the llama.cpp toolchain,
starting a server, checkpoint checks, an evaluation step of a search's probe) is the second and last surface module,
qbuild.plugin_services: those live above the contract in qbuild's layers (and some load numpy), so this module stays
light and importable from anywhere (no torch, no numpy), as planning needs it. In-tree plugins import qbuild only
through these two modules and their own package, never another plugin's: what plugins share is in one of the two
(tests/test_architecture.py checks it; docs/plugins.md).

In-tree plugins are the modules of qbuild.quantize, qbuild.targets, qbuild.runtimes and qbuild.servers
(every module there, and a family's subpackages such as qbuild.quantize.llmcompressor.gptq, is imported when a
registry is first used: adding one is adding a file or a package).
Out-of-tree plugins are Python entry points in the groups `qbuild.methods`, `qbuild.targets`, `qbuild.runtimes` and
`qbuild.servers`, each naming a plugin class (`name = "package.module:Class"`). What lives where: qbuild/contract/
(the contract) and qbuild/base/ (the registry mechanism, errors, the helpers); see docs/plugins.md for a worked
example.
"""

from pydantic import Field

from qbuild.base import fingerprint, hardware
from qbuild.base.errors import MissingBackendError, RecipeError, UserError
from qbuild.base.files import dir_size
from qbuild.base.hashing import sha256_file
from qbuild.base.knapsack import allocate, smallest_within
from qbuild.base.registry import Plugin, Registry
from qbuild.base.schema_base import StrictModel
from qbuild.base.tool_run import OutputTail, ToolFailed, run_tool
from qbuild.contract.formats import ANY, HF_RUNTIMES, Format, FormatSpec, loads_in, register_format, runtimes_for
from qbuild.contract.int_weights import IntWeightVariant, check_int_weights, resolved_ignore
from qbuild.contract.plugin import (
    PLUGIN_PACKAGES,
    EvalStepFields,
    Method,
    PlanningContext,
    PullOption,
    Runtime,
    RuntimeSession,
    Server,
    Target,
    TargetOptions,
    load_all,
    methods,
    open_session,
    runtimes,
    servers,
    targets,
)
from qbuild.contract.shapes import (
    UnsupportedFamily,
    check_group_size,
    check_module_patterns,
    check_patterns,
    checkpoint_weight_names,
    config_linear_names,
    is_ignored,
)
from qbuild.contract.step import HF_PRELOAD, OnUnavailable, Step, StepContext
from qbuild.contract.variant import EnvOption, VariantBase, group_size_value

__all__ = [
    # the plugin kinds, their registries and what they plan
    "ANY", "HF_PRELOAD", "HF_RUNTIMES", "PLUGIN_PACKAGES", "EnvOption", "EvalStepFields", "Field", "Format",
    "FormatSpec", "Method", "OnUnavailable", "PlanningContext", "Plugin", "PullOption", "Registry", "Runtime",
    "RuntimeSession", "Server", "Step", "StepContext", "StrictModel", "Target", "TargetOptions", "VariantBase",
    "group_size_value", "load_all", "loads_in", "methods", "open_session", "register_format", "runtimes",
    "runtimes_for", "servers", "targets",
    # the integer weight-only schemes several methods take
    "IntWeightVariant", "check_int_weights", "resolved_ignore",
    # plan-time checks of a model's shapes and module names
    "UnsupportedFamily", "check_group_size", "check_module_patterns", "check_patterns", "checkpoint_weight_names",
    "config_linear_names", "is_ignored",
    # errors
    "MissingBackendError", "RecipeError", "UserError",
    # helpers of the lowest layer: files, external tools, hardware probes, versions, hashing, the searches' knapsack
    "OutputTail", "ToolFailed", "allocate", "cpu_model", "dir_size", "hardware", "package_version", "run_tool",
    "sha256_file", "smallest_within",
]


def package_version(dist: str) -> str:
    """The installed version of distribution `dist`, as step keys record it: qbuild.base.fingerprint's, looked up
    when called (so the one a test stands in for it is the one a plugin sees too)."""
    return fingerprint.package_version(dist)


def cpu_model() -> str:
    """This machine's CPU model name (qbuild.base.fingerprint's, looked up when called)."""
    return fingerprint.cpu_model()
