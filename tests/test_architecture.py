"""The code's shape (docs/architecture.md), checked from its source: no import cycles, no module importing from a
layer above its own, every folder in a layer, no module outside the plugin packages naming a plugin module (plugins
are reached through the registries; the packages are read from the registries themselves), every plugin module
importing qbuild only through the plugin surface (qbuild.plugins, qbuild.plugin_services) and its own plugin package
(never another plugin's), and a CLI over the API alone.

The import graph is drawn as a reader follows the code: `import` statements anywhere (in functions too), a step's
runner ("qbuild.module:function": the worker imports it for the module that planned the step, so it counts as that
module's import), the qbuild modules named in a preload list (a worker imports them ahead), and a module run as
`-m qbuild.x` (a program in a process of its own: it counts for layering, not for cycles, as no import waits on
it). Imports under `if TYPE_CHECKING:` count for cycles (a reader follows them too), not for layering (an
annotation may name a type from above).

What a reader could not follow is refused, so the graph cannot be fooled: a module loaded by a name given at run
time (importlib.import_module, __import__, an alias of either, runpy, a loader's exec_module) anywhere but the
calls pinned in DYNAMIC_LOADS_ALLOWED; a qbuild module looked up in sys.modules; a step's runner that is not written
whole (a string literal) or that names anything but a module-level function ("qbuild.module:function", the one form a
runner takes: no "module:Class.method"). The checks are functions of a package
root: the tests run them on the tree, and on scratch copies of it with each known way around them added."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qbuild"

# Lowest first, as paths under qbuild/: a folder ("name/") holds its subfolders unless a longer prefix names them;
# a module at the top is named as a file. A module may import modules of its own layer or a lower one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("base/",)),
    ("contract", ("contract/", "plugins.py")),   # qbuild.plugins: the contract, as plugin authors import it
    ("services", ("artifacts/", "calibration/", "envs/", "evaluate/", "models/", "serving/")),
    ("planning", ("planning/", "plugin_services.py")),   # qbuild.plugin_services: the services, as plugins import them
    ("plugins", ("quantize/", "targets/", "runtimes/", "servers/")),
    ("pipeline", ("pipeline/",)),
    ("results", ("results/",)),
    ("api", ("__init__.py", "api.py", "output.py", "errors.py")),   # errors.py: the public name of base/errors.py
    ("cli", ("cli.py", "__main__.py")),
]
CLI_MAY_IMPORT = ("qbuild", "qbuild.api", "qbuild.errors", "qbuild.output")
RUNNER = re.compile(r"^(qbuild(?:\.\w+)+):(\w[\w.]*)$")   # Step(..., runner="qbuild.evaluate.quality:perplexity")

# What loads a module by a name (or path) given at run time. The first four are refused wherever they are named
# (`x.import_module`, `spec.loader.exec_module`); the others as attributes of a loader module or imported by name.
LOADERS = ("import_module", "__import__", "exec_module", "load_module", "run_module", "run_path", "resolve_name")
LOADER_MODULES = ("importlib", "builtins", "runpy", "pkgutil")   # used only as `module.attribute`, never passed on
# The only loads by a run-time name, each pinned to its exact call (ast.unparse), so a new computed name (an
# f-string of qbuild's, a dict's value) fails here even inside these functions:
DYNAMIC_LOADS_ALLOWED: dict[tuple[str, str], set[str]] = {
    # a registry imports its in-tree plugin packages and every module in them: the plugin mechanism itself (which
    # modules it reaches is checked as the plugin packages, read from the registries)
    ("qbuild.base.registry", "Registry._load"): {"importlib.import_module(package)",
                                                 "importlib.import_module(module)"},
    # the worker imports a step's runner (runners are checked where they are written, and drawn in the graph)...
    ("qbuild.pipeline.worker", "resolve_runner"): {"importlib.import_module(module)"},
    # ...and, in a standby worker or the fork server, the modules it imports ahead (preload lists, runner modules)
    ("qbuild.pipeline.worker", "standby"): {"importlib.import_module(name)"},
    ("qbuild.pipeline.worker", "fork_server"): {"importlib.import_module(name)"},
    # runs inside TensorRT-LLM's interpreter, without qbuild: loads its copy of contract/protocol.py by path
    ("qbuild.runtimes._trtllm_shim", "load_protocol"): {"spec.loader.exec_module(module)"},
    # the remote-code guard runs the user's script, and rebinds a name in the transformers modules already loaded
    ("qbuild.models.no_remote_code", "main"): {"runpy.run_path(script, run_name='__main__')"},
    ("qbuild.models.no_remote_code", "forbid_remote_code"): {"sys.modules.items()"},
}
# Modules of a plugin package that are not a plugin's: the remote-store machinery beside the store plugins in
# qbuild.artifacts.remote (the store's contract, its read/write-through cache, the recipe's remotes section, gc).
# The registry imports them with the rest when it scans its package; the rest of qbuild imports them by name.
PLUGIN_PACKAGE_SHARED = ("qbuild.artifacts.remote.base", "qbuild.artifacts.remote.cache",
                         "qbuild.artifacts.remote.config", "qbuild.artifacts.remote.gc")
# The plugin surface (docs/plugins.md): an in-tree plugin module imports from qbuild only these modules and its own
# plugin package: the kind's child package it lives in (qbuild.quantize.llmcompressor.* for llmcompressor/gptq/run.py),
# or, for a flat module of a kind's folder (servers/vllm.py, targets/trtllm_select.py), that folder's flat modules.
# Nothing of another plugin package: what two plugins share is a service or the contract, exported by the surface.
PLUGIN_SURFACE = ("qbuild.plugins", "qbuild.plugin_services")
PLUGIN_KINDS = ("qbuild.quantize", "qbuild.targets", "qbuild.runtimes", "qbuild.servers")
SYS_MODULES_NAMES_ONLY = ("set", "frozenset", "list", "sorted", "tuple", "len")   # list(sys.modules): names only


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_in(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def layer_of_path(rel: str) -> int | None:
    """The layer of a file or folder (a path under qbuild/, folders ending in "/"): its longest prefix's."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = rel == p or (p.endswith("/") and rel.startswith(p))
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def is_qbuild_name(name: object) -> bool:
    return isinstance(name, str) and (name == "qbuild" or name.startswith("qbuild."))


@dataclass
class ModuleFacts:
    imports: set[str] = field(default_factory=set)              # what it needs when it runs
    annotation_imports: set[str] = field(default_factory=set)   # under `if TYPE_CHECKING:`
    programs: set[str] = field(default_factory=set)             # run as `-m qbuild.x`, in a process of their own
    problems: list[str] = field(default_factory=list)           # what a reader could not follow
    allowed_loads: set[tuple[str, str, str]] = field(default_factory=set)   # DYNAMIC_LOADS_ALLOWED entries it uses
    runner_forwarders: set[str] = field(default_factory=set)    # functions with a keyword-only `runner`
    spread_calls: list[tuple[str, str]] = field(default_factory=list)   # (callee, where): `**kw`, no runner=


@functools.cache
def _tree(source: str) -> ast.Module:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node
    return tree


class _Reader(ast.NodeVisitor):
    """One module's imports as a reader follows them, and what it could not follow."""

    def __init__(self, module: str, is_package: bool, modules: set[str], tree: ast.Module):
        self.module, self.is_package, self.modules = module, is_package, modules
        self.facts = ModuleFacts()
        self.scope: list[ast.AST] = []
        self.type_checking = False
        # names bound by imports anywhere in the module (a function may use a name bound further down)
        self.loader_aliases: set[str] = set()
        self.loader_modules: set[str] = set()
        self.sys_names: set[str] = set()
        self.step_names = {"Step"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    bound = a.asname or top
                    if top in LOADER_MODULES and (a.asname is None or a.name in LOADER_MODULES):
                        self.loader_modules.add(bound)
                    if a.name == "sys":
                        self.sys_names.add(bound)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name in LOADERS:
                        self.loader_aliases.add(a.asname or a.name)
                    if a.name == "Step" and is_qbuild_name(node.module or "qbuild"):
                        self.step_names.add(a.asname or a.name)

    # --- what it imports -----------------------------------------------------------------------------------------
    def depends_on(self, name: str, program: bool = False) -> None:
        if name in self.modules and name != self.module:
            kind = "programs" if program else "annotation_imports" if self.type_checking else "imports"
            getattr(self.facts, kind).add(name)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self.visit(test)
            outer, self.type_checking = self.type_checking, True
            for n in node.body:
                self.visit(n)
            self.type_checking = outer
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.depends_on(a.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        names = {a.name for a in node.names}
        if names & set(LOADERS):
            self.refuse_unless_allowed(node, "a module loader imported by name")
        if mod == "sys" and "modules" in names:
            self.refuse_unless_allowed(node, "sys.modules imported by name")
        for a in node.names:   # `from qbuild.contract import step` imports the module qbuild.contract.step
            sub = f"{mod}.{a.name}"
            self.depends_on(sub if sub in self.modules else mod)

    def visit_Constant(self, node: ast.Constant) -> None:
        runner = RUNNER.match(node.value) if isinstance(node.value, str) else None
        if runner:   # the worker imports it for the step this module plans
            self.depends_on(runner.group(1))
        if node.value in LOADERS:   # getattr(importlib, "import_module")
            self.refuse_unless_allowed(node, "a module loader named by a string")

    def visit_List(self, node: ast.List | ast.Tuple) -> None:
        # [python, "-m", "qbuild.pipeline.worker", ...]: a module run by name
        for flag, name in zip(node.elts, node.elts[1:], strict=False):
            if isinstance(flag, ast.Constant) and flag.value == "-m" and isinstance(name, ast.Constant):
                self.depends_on(name.value, program=True)
        self.generic_visit(node)

    visit_Tuple = visit_List

    def preloaded(self, value: ast.AST) -> None:
        for n in ast.walk(value):
            if isinstance(n, ast.Constant) and is_qbuild_name(n.value):
                self.depends_on(n.value)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and "preload" in t.id.lower() for t in node.targets):
            self.preloaded(node.value)
        self.generic_visit(node)

    # --- what it could not follow ---------------------------------------------------------------------------------
    def where(self, node: ast.AST) -> str:
        return f"{self.module}:{node.lineno}"

    def qualname(self) -> str:
        return ".".join(s.name for s in self.scope)

    def refuse_unless_allowed(self, node: ast.AST, what: str) -> None:
        text = ast.unparse(node)
        if text in DYNAMIC_LOADS_ALLOWED.get((self.module, self.qualname()), ()):
            self.facts.allowed_loads.add((self.module, self.qualname(), text))
        else:
            self.facts.problems.append(f"{self.where(node)}: {what}: {text}")

    def loader_use(self, node: ast.AST) -> ast.AST:
        """The call of a loader named by `node`, or `node` itself where it is only named (`f = import_module`)."""
        parent = getattr(node, "parent", None)
        return parent if isinstance(parent, ast.Call) and parent.func is node else node

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        if not isinstance(node, ast.ClassDef) and any(a.arg == "runner" for a in node.args.kwonlyargs):
            self.facts.runner_forwarders.add(node.name)
        self.scope.append(node)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.loader_aliases or node.id in ("__import__", "__builtins__"):
            self.refuse_unless_allowed(self.loader_use(node), "a module loaded by a name given at run time")
        elif node.id in self.loader_modules:
            parent = getattr(node, "parent", None)
            if not (isinstance(parent, ast.Attribute) and parent.value is node and parent.attr != "__dict__"):
                self.refuse_unless_allowed(parent or node, "a loader module passed on")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        on_loader_module = isinstance(node.value, ast.Name) and node.value.id in self.loader_modules
        if node.attr in LOADERS[:4] or (node.attr in LOADERS and on_loader_module):
            self.refuse_unless_allowed(self.loader_use(node), "a module loaded by a name given at run time")
        if node.attr == "modules" and isinstance(node.value, ast.Name) and node.value.id in self.sys_names:
            self.sys_modules_use(node)
        self.generic_visit(node)

    def sys_modules_use(self, node: ast.Attribute) -> None:
        """`x in sys.modules`, `sys.modules["torch"]`, a module registered there: fine. A qbuild module (or one by a
        computed name) looked up there, or the module objects themselves: refused unless allowed."""
        parent = node.parent
        if isinstance(parent, ast.Compare) and node in parent.comparators and \
                all(isinstance(op, ast.In | ast.NotIn) for op in parent.ops):
            return
        if isinstance(parent, ast.Subscript) and parent.value is node:
            key = parent.slice
            if isinstance(parent.ctx, ast.Store) or (isinstance(key, ast.Constant) and not is_qbuild_name(key.value)):
                return
            return self.refuse_unless_allowed(parent, "a module looked up in sys.modules")
        if isinstance(parent, ast.Attribute) and isinstance(parent.parent, ast.Call) and parent.parent.func is parent:
            call = parent.parent
            if parent.attr in ("keys", "__contains__"):
                return
            if parent.attr in ("get", "pop", "setdefault", "__getitem__") and call.args and \
                    isinstance(call.args[0], ast.Constant) and not is_qbuild_name(call.args[0].value):
                return
            return self.refuse_unless_allowed(call, "a module looked up in sys.modules")
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and \
                parent.func.id in SYS_MODULES_NAMES_ONLY and node in parent.args:
            return
        self.refuse_unless_allowed(parent, "sys.modules passed on")

    # --- runners ---------------------------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        callee = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        runners = [k.value for k in node.keywords if k.arg == "runner"]
        spread = any(k.arg is None for k in node.keywords)
        if callee in self.step_names:   # Step(kind, name, params, runner, ...)
            if any(isinstance(a, ast.Starred) for a in node.args[:4]):
                self.facts.problems.append(f"{self.where(node)}: a step's runner given by *args: {ast.unparse(node)}")
            if len(node.args) > 3:
                runners.append(node.args[3])
            if not runners and spread:
                self.facts.problems.append(f"{self.where(node)}: a step's runner given by **kwargs")
        elif spread and not runners:
            self.facts.spread_calls.append((callee, self.where(node)))
        for runner in runners:
            self.check_runner(runner)
        if any(k.arg == "preload" for k in node.keywords):
            self.preloaded(next(k.value for k in node.keywords if k.arg == "preload"))
        self.generic_visit(node)

    def check_runner(self, runner: ast.expr) -> None:
        """A runner is written whole where it is given (a string literal naming a module of the tree and a function of
        it: "qbuild.module:function", never "module:Class.method"); it travels on only as a keyword-only parameter
        `runner` that the function does not change."""
        if isinstance(runner, ast.Constant):
            if runner.value is None:
                return
            found = RUNNER.match(runner.value) if isinstance(runner.value, str) else None
            if found and found.group(1) in self.modules:
                if "." in found.group(2):
                    self.facts.problems.append(f"{self.where(runner)}: a runner naming a class's method, not a module-level "
                                               f"function ('qbuild.module:function'): {runner.value!r}")
                return
            self.facts.problems.append(f"{self.where(runner)}: a runner that names no module of qbuild: {runner.value!r}")
            return
        if isinstance(runner, ast.Name) and runner.id == "runner":
            function = next((s for s in reversed(self.scope) if not isinstance(s, ast.ClassDef)), None)
            forwarded = function is not None and any(a.arg == "runner" for a in function.args.kwonlyargs)
            rebound = function is not None and any(isinstance(n, ast.Name) and n.id == "runner" and
                                                   not isinstance(n.ctx, ast.Load) for n in ast.walk(function))
            if forwarded and not rebound:
                return
        self.facts.problems.append(f"{self.where(runner)}: a runner not written whole (a string literal "
                                   f"'qbuild.module:function'): {ast.unparse(runner)}")


@functools.cache
def read_module(name: str, is_package: bool, source: str, modules: frozenset[str]) -> ModuleFacts:
    """Cached by source: a scratch copy of the tree reads again only the file it changed."""
    reader = _Reader(name, is_package, modules, _tree(source))
    reader.visit(_tree(source))
    return reader.facts


@functools.cache
def read_package(root: Path) -> dict[str, ModuleFacts]:
    files = modules_in(root)
    modules = frozenset(files)
    return {name: read_module(name, path.name == "__init__.py", path.read_text(), modules) for name, path in files.items()}


# --- the checks, each of a package root -------------------------------------------------------------------------------
def import_graph(root: Path, annotations: bool = False, programs: bool = False) -> dict[str, set[str]]:
    return {m: f.imports | (f.annotation_imports if annotations else set()) | (f.programs if programs else set())
            for m, f in read_package(root).items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if color.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in color:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        color[m] = 2
        return None

    for m in sorted(g):
        if m not in color:
            found = visit(m)
            if found:
                return found
    return None


def import_cycles(root: Path) -> list[str]:
    cycle = find_cycle(import_graph(root, annotations=True))
    return ["import cycle: " + " -> ".join(cycle)] if cycle else []


def layers_of(root: Path) -> dict[str, int]:
    layers = {m: layer_of_path(path.relative_to(root).as_posix()) for m, path in modules_in(root).items()}
    assert None not in layers.values(), "a module is in no layer of tests/test_architecture.py"
    return layers


def upward_imports(root: Path) -> list[str]:
    layer = layers_of(root)
    return sorted(f"{m} ({LAYERS[layer[m]][0]}) imports {n} ({LAYERS[layer[n]][0]})"
                  for m, deps in import_graph(root, programs=True).items() for n in deps if layer[n] > layer[m])


def places_in_no_layer(root: Path) -> list[str]:
    # a folder counts when it holds Python (a moved package leaves only its __pycache__ behind in a checkout)
    places = {p.relative_to(root).as_posix() + ("/" if p.is_dir() else "") for p in root.rglob("*")
              if "__pycache__" not in p.parts and (p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py"))))}
    return sorted(f"{x} is in no layer of tests/test_architecture.py" for x in places if layer_of_path(x) is None)


def dynamic_load_problems(root: Path) -> list[str]:
    """Modules loaded by a name given at run time outside DYNAMIC_LOADS_ALLOWED, sys.modules lookups of qbuild's,
    runners not written whole."""
    facts = read_package(root)
    forwarders = set().union(*(f.runner_forwarders for f in facts.values()))
    spread = [f"{where}: a runner given to {callee}() by **kwargs" for f in facts.values()
              for callee, where in f.spread_calls if callee in forwarders]
    return sorted([p for f in facts.values() for p in f.problems] + spread)


def plugin_module_imports(root: Path, packages: tuple[str, ...]) -> list[str]:
    def is_plugin(m: str) -> bool:
        return m.startswith(tuple(p + "." for p in packages)) and m not in PLUGIN_PACKAGE_SHARED

    return sorted(f"{m} imports {n}" for m, deps in import_graph(root).items()
                  if not is_plugin(m) and not m.startswith(packages) for n in deps if is_plugin(n))


def plugin_package_of(module: str, root: Path = PACKAGE) -> str | None:
    """The plugin package a module of a plugin kind belongs to: the kind's child package it lives in
    (qbuild.quantize.llmcompressor for qbuild.quantize.llmcompressor.gptq.run), or the kind itself for its own
    __init__ and its folder's flat modules (qbuild.servers for qbuild.servers.vllm and qbuild.servers._gpu); None
    elsewhere."""
    for kind in PLUGIN_KINDS:
        if module == kind:
            return kind
        if module.startswith(kind + "."):
            child = module[len(kind) + 1:].split(".")[0]
            folder = root.joinpath(*kind.split(".")[1:], child)
            return f"{kind}.{child}" if folder.is_dir() else kind
    return None


def plugin_surface_problems(root: Path) -> list[str]:
    """Imports of a plugin module (annotations and modules run by `-m` included) that are neither the surface nor its
    own plugin package (a flat module's: its folder's flat modules)."""
    def allowed(module: str, name: str) -> bool:
        own, other = plugin_package_of(module, root), plugin_package_of(name, root)
        if name in PLUGIN_SURFACE:
            return True
        if own in PLUGIN_KINDS:   # a flat module: its folder's flat modules (and the folder's package itself)
            return other == own
        return name == own or name.startswith(own + ".")

    return sorted(f"{m} imports {n}: a plugin module imports qbuild only through {' and '.join(PLUGIN_SURFACE)} and its "
                  f"own package ({plugin_package_of(m, root)})"
                  for m, deps in import_graph(root, annotations=True, programs=True).items()
                  if plugin_package_of(m, root) is not None for n in deps if not allowed(m, n))


def architecture_problems(root: Path, packages: tuple[str, ...]) -> list[str]:
    return (places_in_no_layer(root) or upward_imports(root)) + import_cycles(root) + dynamic_load_problems(root) \
        + plugin_module_imports(root, packages) + plugin_surface_problems(root)


@functools.cache
def plugin_packages() -> tuple[str, ...]:
    """The in-tree packages the registries scan, read from the registries themselves: every module of the tree that
    builds a Registry(...) is imported and its module-level registries asked."""
    from qbuild.base.registry import Registry

    packages: set[str] = set()
    for name, path in modules_in(PACKAGE).items():
        builds = any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) == "Registry"
                     for n in ast.walk(_tree(path.read_text())))
        if builds:
            found = [v for v in vars(importlib.import_module(name)).values() if isinstance(v, Registry)]
            assert found, f"{name} builds a Registry that is not one of its module-level names"
            packages |= {p for r in found for p in r.packages}
    return tuple(sorted(packages))


# --- the tree ----------------------------------------------------------------------------------------------------
def test_no_import_cycles():
    assert not import_cycles(PACKAGE), import_cycles(PACKAGE)


def test_no_upward_imports():
    bad = upward_imports(PACKAGE)
    assert not bad, "\n".join(bad)


def test_every_folder_and_module_is_in_a_layer():
    assert not places_in_no_layer(PACKAGE), places_in_no_layer(PACKAGE)


def test_no_module_is_loaded_by_a_name_the_graph_cannot_see():
    bad = dynamic_load_problems(PACKAGE)
    assert not bad, "\n".join(bad)


def test_every_allowed_dynamic_load_is_still_there():
    """An allowance for a call that went away is removed with it: the allow-list stays the list of what exists."""
    used = set().union(*(f.allowed_loads for f in read_package(PACKAGE).values()))
    allowed = {(m, fn, text) for (m, fn), texts in DYNAMIC_LOADS_ALLOWED.items() for text in texts}
    assert not allowed - used, sorted(allowed - used)


def test_the_plugin_packages_are_every_registrys():
    packages = plugin_packages()
    from qbuild.artifacts.remote import remotes
    from qbuild.contract import plugin

    for registry in (plugin.methods, plugin.targets, plugin.runtimes, plugin.servers, remotes):
        assert set(registry.packages) <= set(packages), registry.group
    assert {"qbuild.servers", "qbuild.artifacts.remote"} <= set(packages)


def test_no_module_outside_the_plugin_packages_imports_a_plugin_module():
    bad = plugin_module_imports(PACKAGE, plugin_packages())
    assert not bad, "\n".join(bad)


def test_plugin_modules_import_qbuild_only_through_the_surface():
    assert set(PLUGIN_KINDS) <= set(plugin_packages())
    bad = plugin_surface_problems(PACKAGE)
    assert not bad, "\n".join(bad)


def test_the_plugin_surface_stays_light():
    """qbuild.plugins is imported at plan time by every plugin: no torch, no numpy; qbuild.plugin_services loads a
    service only when a name of it is asked for."""
    import os
    import subprocess
    import sys

    code = ("import sys, qbuild.plugins, qbuild.plugin_services; "
            "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'qbuild.planning.evaluation', "
            "'qbuild.calibration.build') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    import qbuild.plugin_services as services

    assert all(getattr(services, name) is not None for name in services.__all__)


def test_cli_imports_only_the_api_and_output_helpers():
    cli = import_graph(PACKAGE)["qbuild.cli"]
    assert cli <= set(CLI_MAY_IMPORT), sorted(cli - set(CLI_MAY_IMPORT))


def test_output_draws_the_renderers_it_loads():
    """qbuild.output imports its renderers on first use, by ordinary imports the graph sees."""
    assert {"qbuild.results.diff", "qbuild.results.junit", "qbuild.results.report", "qbuild.results.summary",
            "qbuild.evaluate.gates", "qbuild.pipeline.estimate"} <= import_graph(PACKAGE)["qbuild.output"]


def test_the_protocol_module_is_self_contained():
    """The TensorRT-LLM shim loads a copy of contract/protocol.py in an interpreter without qbuild."""
    assert import_graph(PACKAGE)["qbuild.contract.protocol"] == set()


# --- the checker itself ----------------------------------------------------------------------------------------------
def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / "qbuild" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "qbuild" / rel).write_text(text)
    return root / "qbuild"


def test_the_reader_sees_lazy_imports_runners_modules_run_by_name_and_preloads(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "api.py": "", "cli.py": "", "output.py": "", "results/__init__.py": "",
        "results/report.py": "", "pipeline/__init__.py": "", "pipeline/worker.py": "", "base/__init__.py": "",
        "base/types.py": "",
        "m.py": 'from typing import TYPE_CHECKING\n'
                'if TYPE_CHECKING:\n'
                '    from qbuild.base import types\n'
                'PRELOAD = ("qbuild.api",)\n'
                'def f(Step):\n'
                '    from qbuild.results import report\n'
                '    cmd = ["python", "-m", "qbuild.pipeline.worker"]\n'
                '    return Step("k", "k", {}, "qbuild.cli:main"), dict(name="qbuild.output is no runner")\n'})
    facts = read_package(root)["qbuild.m"]
    assert facts.imports == {"qbuild.api", "qbuild.results.report", "qbuild.cli"}
    assert facts.programs == {"qbuild.pipeline.worker"}
    assert facts.annotation_imports == {"qbuild.base.types"} and facts.problems == []


# Each known way around the checks, appended to base/units.py of a scratch copy of the tree: (file, text, what the
# refusal says). base/ is the lowest layer, so each names a module above it without an import the graph would see.
WAYS_AROUND = {
    "an alias of import_module": (
        "base/units.py", 'from importlib import import_module as _load\n\n\ndef _report():\n'
                         '    return _load("qbuild.results.report")\n', "a module loader imported by name"),
    "an alias of importlib": (
        "base/units.py", 'import importlib as _il\n\n\ndef _report():\n    return _il.import_module("qbuild.results.report")\n',
        "a name given at run time"),
    "__import__": ("base/units.py", 'def _report():\n    return __import__("qbuild.results.report")\n',
                   "a name given at run time"),
    "a name that is not a constant": (
        "base/units.py", 'import importlib\n\nAPIS = {"api": "qbuild.api"}\n\n\ndef _api():\n'
                         '    return importlib.import_module(APIS["api"])\n', "a name given at run time"),
    "a computed constant": (
        "base/units.py", 'import importlib\n\n\ndef _report():\n'
                         '    return importlib.import_module("qbuild." + "results.report")\n', "a name given at run time"),
    "getattr on importlib": (
        "base/units.py", 'import importlib\n\n\ndef _report():\n'
                         '    return getattr(importlib, "import_" + "module")("qbuild.results.report")\n',
        "a loader module passed on"),
    "a runner named by an f-string": (
        "base/units.py", 'def _plan(ctx, contract, part="report"):\n'
                         '    return ctx.add(contract.Step("k", "k", {}, f"qbuild.results.{part}:render_html"))\n',
        "a runner not written whole"),
    "a runner handed on by keyword": (
        "base/units.py", 'def _plan(ctx, evaluation, part="report"):\n'
                         '    return evaluation.runtime_step("k", "k", {}, None, "", None, {}, (), ctx,\n'
                         '                                   runner="qbuild.results." + part + ":render_html")\n',
        "a runner not written whole"),
    "a runner hidden in **kwargs": (
        "base/units.py", 'def _plan(ctx, evaluation, part="report"):\n'
                         '    extra = {"runner": f"qbuild.results.{part}:render_html"}\n'
                         '    return evaluation.probe_step(ctx, "k", "k", "", None, {}, {}, None, (), **extra)\n',
        "by **kwargs"),
    "a runner naming a class's method": (
        "base/units.py", 'def _plan(ctx, contract):\n    return contract.Step("k", "k", {}, "qbuild.results.report:Report.render")\n',
        "a runner naming a class's method"),
    "a runner made from a bound method": (
        "base/units.py", 'def _plan(ctx, contract, plugin):\n'
                         '    return contract.Step("k", "k", {}, contract.runner_of(plugin.run))\n',
        "a runner not written whole"),
    "a runner that names no module": (
        "base/units.py", 'def _plan(ctx, contract):\n    return contract.Step("k", "k", {}, "qbuild.results.gone:run")\n',
        "names no module"),
    "a lookup in sys.modules": (
        "base/units.py", 'import sys\n\n\ndef _recipe():\n    return sys.modules["qbuild.planning.recipe"]\n',
        "looked up in sys.modules"),
    "sys.modules.get by a computed name": (
        "base/units.py", 'import sys\n\n\ndef _recipe(part="recipe"):\n    return sys.modules.get("qbuild.planning." + part)\n',
        "looked up in sys.modules"),
    "a computed name inside an allowed loader": (
        "base/registry.py", None, "a name given at run time"),
}


def _scratch_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "qbuild"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_a_scratch_copy_of_the_tree_passes(tmp_path):
    assert architecture_problems(_scratch_copy(tmp_path), plugin_packages()) == []


@pytest.mark.parametrize("way", WAYS_AROUND)
def test_each_way_around_the_checks_fails_them(tmp_path, way):
    rel, text, refusal = WAYS_AROUND[way]
    copy = _scratch_copy(tmp_path)
    target = copy / rel
    if text is None:   # inside Registry._load, beside the loads it is allowed
        source = target.read_text()
        anchor = "        self._loaded = True\n"
        assert source.count(anchor) == 1
        text = anchor + '        importlib.import_module(f"qbuild.{self.group}")\n'
        target.write_text(source.replace(anchor, text))
    else:
        target.write_text(target.read_text() + "\n\n" + text)
    module = module_name(target, copy)
    problems = architecture_problems(copy, plugin_packages())
    assert any(p.startswith(f"{module}:") and refusal in p for p in problems), problems


# Plugin modules reaching past the surface, planted in a scratch copy of the tree: (file, line, the module refused).
PAST_THE_SURFACE = {
    "the pipeline's planner": ("quantize/llmcompressor/gptq/method.py", "from qbuild.pipeline.plan import make_plan  # noqa: F401\n",
                               "qbuild.pipeline.plan"),
    "a service by its own module": ("servers/sglang.py", "from qbuild.serving.server import PORT  # noqa: F401\n",
                                    "qbuild.serving.server"),
    "the contract by its own module": ("targets/trtllm_pytorch.py", "from qbuild.contract.step import Step  # noqa: F401\n",
                                       "qbuild.contract.step"),
    "another plugin package's inside": ("quantize/gptqmodel/method.py",
                                        "from qbuild.quantize.llmcompressor.search import CTSearch  # noqa: F401\n",
                                        "qbuild.quantize.llmcompressor.search"),
    "a runner of another package's inside": ("quantize/llmcompressor/fp8/method.py",
                                             'RUNNER = "qbuild.quantize.gguf.probe:run_probe"\n', "qbuild.quantize.gguf.probe"),
}


@pytest.mark.parametrize("way", PAST_THE_SURFACE)
def test_a_plugin_module_past_the_surface_fails_the_checks(tmp_path, way):
    rel, line, refused = PAST_THE_SURFACE[way]
    copy = _scratch_copy(tmp_path)
    target = copy / rel
    target.write_text(target.read_text() + "\n" + line)
    module = module_name(target, copy)
    problems = architecture_problems(copy, plugin_packages())
    assert any(p.startswith(f"{module} imports {refused}: a plugin module imports qbuild only through") for p in problems), \
        problems


@pytest.mark.parametrize("rel, line, refused", [
    # a runtime importing a target (the TensorRT-LLM runtime did: its environment is the service envs/tensorrt_llm.py)
    ("runtimes/llamacpp.py", "from qbuild.targets import tensorrt_llm  # noqa: F401,E402\n", "qbuild.targets.tensorrt_llm"),
    # another plugin package itself, and its run module (once allowed as its public modules)
    ("quantize/llmcompressor/gptq/run.py", "from qbuild.quantize import gguf  # noqa: F401,E402\n",
     "qbuild.quantize.gguf"),
    ("quantize/autoround/run.py", "from qbuild.quantize.llmcompressor.run import run_quantize  # noqa: F401,E402\n",
     "qbuild.quantize.llmcompressor.run"),
    # a flat module of another kind's folder
    ("servers/sglang.py", "from qbuild.runtimes import transformers  # noqa: F401,E402\n", "qbuild.runtimes.transformers"),
    # a server importing the runtime of its engine (the vLLM server did: where vLLM is is the service envs/vllm.py)
    ("servers/vllm.py", "from qbuild.runtimes import vllm  # noqa: F401,E402\n", "qbuild.runtimes.vllm"),
])
def test_a_cross_plugin_import_fails_the_checks(tmp_path, rel, line, refused):
    copy = _scratch_copy(tmp_path)
    target = copy / rel
    target.write_text(target.read_text() + "\n" + line)
    module = module_name(target, copy)
    problems = plugin_surface_problems(copy)
    assert any(p.startswith(f"{module} imports {refused}: a plugin module imports qbuild only through") for p in problems), \
        problems


def test_a_flat_module_imports_its_folders_flat_modules(tmp_path):
    assert plugin_package_of("qbuild.servers.vllm") == plugin_package_of("qbuild.servers._gpu") == "qbuild.servers"
    assert plugin_package_of("qbuild.quantize.llmcompressor.gptq.run") == "qbuild.quantize.llmcompressor"
    copy = _scratch_copy(tmp_path)
    target = copy / "runtimes" / "llamacpp.py"
    target.write_text(target.read_text() + "\nfrom qbuild.runtimes import layer_stream  # noqa: F401,E402\n")
    assert plugin_surface_problems(copy) == []


@pytest.mark.parametrize("cycle_graph, expected", [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": set()}, False)])
def test_the_cycle_finder_finds_cycles(cycle_graph, expected):
    assert (find_cycle(cycle_graph) is not None) == expected


def test_a_folder_outside_the_layers_is_refused():
    assert layer_of_path("newfolder/x.py") is None and layer_of_path("newfolder/") is None
    assert layer_of_path("servers/vllm.py") == [n for n, _ in LAYERS].index("plugins")
    assert layer_of_path("serving/server.py") == [n for n, _ in LAYERS].index("services")


# --- the package as it runs ------------------------------------------------------------------------------------------
def test_the_package_api_is_not_shadowed_by_module_names():
    """`qbuild.plan(...)` is the API's function even after the pipeline's modules were imported (they live in
    qbuild.pipeline and qbuild.results, not beside the API's names)."""
    import qbuild

    for module in ("qbuild.pipeline.plan", "qbuild.results.report", "qbuild.results.selection"):
        importlib.import_module(module)
    for name in qbuild.__all__:
        assert not isinstance(getattr(qbuild, name), type(qbuild)), f"qbuild.{name} is a module"
    assert callable(qbuild.plan) and callable(qbuild.select) and callable(qbuild.report)


def test_the_llm_compressor_methods_run_their_own_run_module():
    """Each llm-compressor method plans its quantize step with its own package's runner (a function of its run.py,
    which hands its modifiers to llmcompressor/run.py), and the worker resolves it to that function."""
    from qbuild.pipeline.worker import resolve_runner

    for method in ("gptq", "awq", "fp8", "rtn", "smoothquant"):
        runner = f"qbuild.quantize.llmcompressor.{method}.run:run"
        function = resolve_runner(runner)
        assert callable(function) and function.__module__ == f"qbuild.quantize.llmcompressor.{method}.run", runner
        assert f'"{runner}"' in (PACKAGE / "quantize" / "llmcompressor" / method / "method.py").read_text(), method
    with pytest.raises(ValueError, match="module-level function"):   # the one form: no 'module:Class.method'
        resolve_runner("qbuild.quantize.llmcompressor.gptq.method:GPTQ.plan")


def test_the_architecture_page_states_these_layers():
    """docs/architecture.md's layer table names the same layers, in the same order, with the same folders."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = text[text.index("### Layers"):]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| ")]
    stated = [(r[0], set(re.findall(r"`([^`]+)`", r[1]))) for r in rows[1:]]
    assert stated == [(name, set(folders)) for name, folders in LAYERS]


def test_every_import_of_qbuild_names_a_module_that_exists():
    """An import of a module that moved away fails only when its line runs (inside a function, a plan-time branch):
    every `import qbuild.x` / `from qbuild.x import ...` in the package must name an existing module or package."""
    modules = set(modules_in(PACKAGE))
    missing = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(_tree(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            missing += [f"{path.relative_to(PACKAGE)}:{node.lineno} {n}" for n in names
                        if n.startswith("qbuild.") and n not in modules]
    assert not missing, "\n".join(missing)


def test_the_contract_names_no_plugin_format_or_method():
    """Plugin knowledge lives on the plugins: each declares the formats it writes in its own module (register_format)
    and a method the model families it cannot build (Method.unsupported_families), so no module of qbuild/contract
    names a method or a format a plugin declares. Checked on the source: no string literal outside a docstring is
    such a name (prose that mentions one, a description or a comment, is not a name). Engine names are the contract's
    own words (`trtllm-pytorch` is an engine and a format). The built-in backend environments, named after the
    libraries they hold as some methods are, live with the code that creates them (qbuild/envs/), not here."""
    from qbuild.contract.formats import ENGINES, FORMATS, Format, declared
    from qbuild.contract.plugin import methods

    declared()
    names = (set(methods.names()) | (set(FORMATS) - set(Format))) - set(ENGINES)
    assert {"gguf", "gptq", "awq", "rtn", "fp8", "smoothquant", "bitsandbytes", "auto-round", "compressed-tensors",
            "hf-modelopt", "trtllm-engine"} <= names   # what the scan looks for: every in-tree method and format
    found = []
    for path in sorted((PACKAGE / "contract").glob("*.py")):
        tree = _tree(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.relative_to(PACKAGE.parent)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in names and id(n) not in docstrings]
    assert not found, "\n".join(found)
