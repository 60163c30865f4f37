"""The code's shape (docs/architecture.md), checked from its imports: no cycles, no module importing from a layer
above its own, every folder in a layer, no module outside the plugin packages naming a plugin module (plugins are
reached through the registries), and a CLI over the API alone. Imports are read as a reader follows them: `import`
statements anywhere (in functions too), `importlib.import_module("qbuild...")` / `__import__("qbuild...")` with a
constant name, and a step's runner named as "qbuild.module:function" (the worker imports it). Imports under
`if TYPE_CHECKING:` count for cycles (a reader follows them too), not for layering (an annotation may name a type
from above)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qbuild"

# Lowest first, as paths under qbuild/: a folder ("name/") holds its subfolders unless a longer prefix names them;
# a module at the top is named as a file. A module may import modules of its own layer or a lower one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("base/",)),
    ("contract", ("contract/", "plugins.py")),   # qbuild.plugins: the contract, as plugin authors import it
    ("services", ("artifacts/", "calibration/", "evaluate/", "models/", "serving/")),
    ("planning", ("planning/",)),
    ("plugins", ("quantize/", "build/", "runtimes/", "serving/engines/")),
    ("pipeline", ("pipeline/",)),
    ("results", ("results/",)),
    ("api", ("__init__.py", "api.py", "output.py", "errors.py")),   # errors.py: the public name of base/errors.py
    ("cli", ("cli.py", "__main__.py")),
]
PLUGIN_PACKAGES = ("qbuild.quantize", "qbuild.build", "qbuild.runtimes", "qbuild.serving.engines")
CLI_MAY_IMPORT = ("qbuild", "qbuild.api", "qbuild.errors", "qbuild.output")
DYNAMIC_IMPORT = {"import_module", "__import__"}
RUNNER = re.compile(r"^(qbuild(?:\.\w+)+):\w[\w.]*$")   # Step(runner="qbuild.evaluate.quality:run_perplexity")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of_path(rel: str) -> int | None:
    """The layer of a file or folder (a path under qbuild/, folders ending in "/"): its longest prefix's."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = rel == p or (p.endswith("/") and rel.startswith(p))
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    return best


FILES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    rel = FILES[module].relative_to(PACKAGE).as_posix()
    found = layer_of_path(rel)
    assert found is not None, f"{rel} is in no layer of tests/test_architecture.py"
    return found


def imports_of(path: Path, modules: set[str], annotations: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    here = module_name(path) if path.is_relative_to(PACKAGE.parent) else path.stem
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

        def visit_Call(self, node: ast.Call) -> None:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in DYNAMIC_IMPORT and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str) and node.args[0].value.startswith("qbuild"):
                found.add(node.args[0].value)
            self.generic_visit(node)

        def visit_Constant(self, node: ast.Constant) -> None:
            runner = RUNNER.match(node.value) if isinstance(node.value, str) else None
            if runner:
                found.add(runner.group(1))

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
            for a in node.names:   # `from qbuild.contract import step` imports the module qbuild.contract.step
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in modules else mod)

    Visitor().visit(tree)
    return {m for m in found if m in modules and m != here}


def graph(annotations: bool = False) -> dict[str, set[str]]:
    modules = set(FILES)
    return {m: imports_of(p, modules, annotations) for m, p in FILES.items()}


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


def test_every_folder_and_module_is_in_a_layer():
    # a folder counts when it holds Python (a moved package leaves only its __pycache__ behind in a checkout)
    places = {p.relative_to(PACKAGE).as_posix() + ("/" if p.is_dir() else "") for p in PACKAGE.rglob("*")
              if "__pycache__" not in p.parts and (p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py"))))}
    assert not sorted(x for x in places if layer_of_path(x) is None), "in no layer of tests/test_architecture.py"


def test_no_module_outside_the_plugin_packages_imports_a_plugin_module():
    def is_plugin(m: str) -> bool:
        return m.startswith(tuple(p + "." for p in PLUGIN_PACKAGES))

    bad = sorted(f"{m} imports {n}" for m, deps in G.items() if not is_plugin(m) and not m.startswith(PLUGIN_PACKAGES)
                 for n in deps if is_plugin(n))
    assert not bad, "\n".join(bad)


def test_the_import_reader_sees_dynamic_imports_and_runners(tmp_path):
    """What the layering checks would miss if the reader did not see them: a module loaded by name, a runner."""
    src = tmp_path / "m.py"
    src.write_text('import importlib\n'
                   'def f():\n'
                   '    importlib.import_module("qbuild.api")\n'
                   '    __import__("qbuild.cli")\n'
                   '    return dict(runner="qbuild.results.report:render", name="qbuild.output is not a runner")\n')
    modules = {"qbuild.api", "qbuild.cli", "qbuild.results.report", "qbuild.output"}
    assert imports_of(src, modules) == {"qbuild.api", "qbuild.cli", "qbuild.results.report"}


def test_a_folder_outside_the_layers_is_refused():
    assert layer_of_path("newfolder/x.py") is None and layer_of_path("newfolder/") is None
    assert layer_of_path("serving/engines/vllm.py") == [n for n, _ in LAYERS].index("plugins")
    assert layer_of_path("serving/server.py") == [n for n, _ in LAYERS].index("services")


def test_cli_imports_only_the_api_and_output_helpers():
    assert G["qbuild.cli"] <= set(CLI_MAY_IMPORT), sorted(G["qbuild.cli"] - set(CLI_MAY_IMPORT))


@pytest.mark.parametrize("cycle_graph, expected", [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": set()}, False)])
def test_the_cycle_finder_finds_cycles(cycle_graph, expected):
    assert (find_cycle(cycle_graph) is not None) == expected


def test_the_package_api_is_not_shadowed_by_module_names():
    """`qbuild.plan(...)` is the API's function even after the pipeline's modules were imported (they live in
    qbuild.pipeline and qbuild.results, not beside the API's names)."""
    import importlib

    import qbuild

    for module in ("qbuild.pipeline.plan", "qbuild.results.report", "qbuild.results.selection"):
        importlib.import_module(module)
    for name in qbuild.__all__:
        assert not isinstance(getattr(qbuild, name), type(qbuild)), f"qbuild.{name} is a module"
    assert callable(qbuild.plan) and callable(qbuild.select) and callable(qbuild.report)


def test_the_protocol_module_is_self_contained():
    """The TensorRT-LLM shim loads a copy of contract/protocol.py in an interpreter without qbuild."""
    assert G["qbuild.contract.protocol"] == set()


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
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    missing = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            missing += [f"{path.relative_to(PACKAGE)}:{node.lineno} {n}" for n in names
                        if n.startswith("qbuild.") and n not in modules]
    assert not missing, "\n".join(missing)
