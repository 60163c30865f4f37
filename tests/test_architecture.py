"""The code's shape (docs/architecture.md), checked from its imports: no cycles, no module importing from a layer
above its own, no core module naming a plugin module (plugins are reached through qbuild.plugins' registries),
and a CLI over the API alone. Imports under `if TYPE_CHECKING:` count for cycles (a reader follows them too), not
for layering (an annotation may name a type from above)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qbuild"

# Lowest first. A module may import modules of its own layer or a lower one, never a higher one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("utilities", ("qbuild.errors", "qbuild.core", "qbuild.core.hashing", "qbuild.core.names",
                   "qbuild.core.yamlio", "qbuild.core.owned", "qbuild.core.process", "qbuild.core.tool_run", "qbuild.core.worker_env",
                   "qbuild.core.schema_base", "qbuild.core.hardware", "qbuild.core.fingerprint", "qbuild.core.units")),
    # evaluate/protocol.py is self-contained (a copy of it runs in the TensorRT-LLM interpreter): the contract's Window
    ("contract", ("qbuild.formats", "qbuild.plugins", "qbuild.core.step", "qbuild.core.data_sources",
                  "qbuild.core.envs", "qbuild.evaluate.protocol")),
    ("services", ("qbuild.artifacts", "qbuild.calibration", "qbuild.evaluate", "qbuild.models", "qbuild.serving",
                  "qbuild.quantize.base", "qbuild.quantize.shapes", "qbuild.quantize.llamacpp_tools")),
    # the recipe and the planner of each of its sections (they turn recipe entries into steps)
    ("planning", ("qbuild.core.recipe", "qbuild.models.resolve", "qbuild.models.fidelity_plan",
                  "qbuild.serving.plan", "qbuild.serving.bench", "qbuild.serving.capacity",
                  "qbuild.evaluate.plan", "qbuild.evaluate.tasks", "qbuild.calibration.plan")),
    ("plugins", ("qbuild.quantize", "qbuild.build", "qbuild.runtimes", "qbuild.serving.engines")),
    ("pipeline", ("qbuild.core",)),
    ("results", ("qbuild.results",)),
    ("api", ("qbuild", "qbuild.api", "qbuild.output")),   # the package re-exports the API
    ("cli", ("qbuild.cli", "qbuild.__main__")),
]
PLUGIN_PACKAGES = ("qbuild.quantize", "qbuild.build", "qbuild.runtimes", "qbuild.serving.engines")
# what plugins share with the core: the variant schema base, shape facts and the llama.cpp tool paths
PLUGIN_SHARED = ("qbuild.quantize.base", "qbuild.quantize.shapes", "qbuild.quantize.llamacpp_tools")
CLI_MAY_IMPORT = ("qbuild", "qbuild.api", "qbuild.errors", "qbuild.output")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact_only = p in ("qbuild", "qbuild.core") and LAYERS[i][0] != "pipeline"   # the packages themselves
            hit = module == p if exact_only else (module == p or module.startswith(p + "."))
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py"
    return best


def imports_of(path: Path, modules: set[str], annotations: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    here = module_name(path)
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" and not annotations:
                for n in node.orelse:
                    self.visit(n)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            for a in node.names:
                if a.name.startswith("qbuild"):
                    found.add(a.name)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = here.split(".") if is_pkg else here.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("qbuild"):
                return
            for a in node.names:   # `from qbuild.core import step` imports the module qbuild.core.step
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in modules else mod)

    Visitor().visit(tree)
    return {m for m in found if m in modules and m != here}


def graph(annotations: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {m: imports_of(p, modules, annotations) for m, p in files.items()}


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


G = graph()


def test_no_import_cycles():
    cycle = find_cycle(graph(annotations=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_upward_imports():
    bad = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {n} ({LAYERS[layer_of(n)][0]})"
                 for m, deps in G.items() for n in deps if layer_of(n) > layer_of(m))
    assert not bad, "\n".join(bad)


def test_no_core_module_imports_a_plugin_module():
    def is_plugin(m: str) -> bool:
        return m.startswith(tuple(p + "." for p in PLUGIN_PACKAGES)) and not m.startswith(PLUGIN_SHARED)

    bad = sorted(f"{m} imports {n}" for m, deps in G.items() if not is_plugin(m) and not m.startswith(PLUGIN_PACKAGES)
                 for n in deps if is_plugin(n))
    assert not bad, "\n".join(bad)


def test_cli_imports_only_the_api_and_output_helpers():
    assert G["qbuild.cli"] <= set(CLI_MAY_IMPORT), sorted(G["qbuild.cli"] - set(CLI_MAY_IMPORT))


@pytest.mark.parametrize("cycle_graph, expected", [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": set()}, False)])
def test_the_cycle_finder_finds_cycles(cycle_graph, expected):
    assert (find_cycle(cycle_graph) is not None) == expected


def test_the_package_api_is_not_shadowed_by_module_names():
    """`qbuild.plan(...)` is the API's function even after the pipeline's modules were imported (they live in
    qbuild.core and qbuild.results, not beside the API's names)."""
    import importlib

    import qbuild

    for module in ("qbuild.core.plan", "qbuild.results.report", "qbuild.results.selection"):
        importlib.import_module(module)
    for name in qbuild.__all__:
        assert not isinstance(getattr(qbuild, name), type(qbuild)), f"qbuild.{name} is a module"
    assert callable(qbuild.plan) and callable(qbuild.select) and callable(qbuild.report)


def test_the_protocol_module_is_self_contained():
    """The TensorRT-LLM shim loads a copy of evaluate/protocol.py in an interpreter without qbuild."""
    assert G["qbuild.evaluate.protocol"] == set()
