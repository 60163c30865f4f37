"""The one module a plugin imports from: the plugin base classes and their registries, the step a plugin plans
and the context its runner gets, format declarations, the variant options base and the errors it raises.

    from qbuild.plugins import FormatSpec, Method, Step, StepContext, VariantBase, methods, register_format

    @methods.register
    class MyMethod(Method):
        name = "my-method"            # the recipe's `method:` value
        options = MyVariant           # pydantic model of the recipe entry (method: Literal["my-method"])
        extra = "my-extra"            # pip install 'qbuild[my-extra]' (or your package) provides...
        requires = ("mylib",)         # ...these import names, checked at plan time (never imported then)
        unsupported_families = ()     # UnsupportedFamily(...): model architectures it cannot build, refused at plan time
        def plan(self, variant, ctx: PlanningContext) -> Step: ...

In-tree plugins are the modules of qbuild.quantize, qbuild.targets, qbuild.runtimes and qbuild.servers
(every module there is imported when a registry is first used: adding one is adding a file). Out-of-tree plugins
are Python entry points in the groups `qbuild.methods`, `qbuild.targets`, `qbuild.runtimes` and `qbuild.servers`,
each naming a plugin class (`name = "package.module:Class"`). What lives where: qbuild/contract/ (the contract) and
qbuild/base/ (the registry mechanism, errors); see docs/plugins.md for a worked example.
"""

from pydantic import Field

from qbuild.base.errors import MissingBackendError, RecipeError, UserError
from qbuild.base.files import dir_size
from qbuild.base.registry import Plugin, Registry
from qbuild.base.schema_base import StrictModel
from qbuild.contract.formats import ANY, HF_RUNTIMES, Format, FormatSpec, loads_in, register_format, runtimes_for
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
from qbuild.contract.shapes import UnsupportedFamily, check_group_size, check_module_patterns, check_patterns
from qbuild.contract.step import OnUnavailable, Step, StepContext
from qbuild.contract.variant import EnvOption, VariantBase

__all__ = [
    "ANY", "HF_RUNTIMES", "PLUGIN_PACKAGES", "EnvOption", "EvalStepFields", "Field", "Format", "FormatSpec",
    "Method", "MissingBackendError", "OnUnavailable", "PlanningContext", "Plugin", "PullOption", "RecipeError",
    "Registry", "Runtime", "RuntimeSession", "Server", "Step", "StepContext", "StrictModel", "Target",
    "TargetOptions", "UnsupportedFamily", "UserError", "VariantBase", "check_group_size", "check_module_patterns",
    "check_patterns", "dir_size", "load_all", "loads_in", "methods", "open_session", "register_format", "runtimes",
    "runtimes_for", "servers", "targets",
]
