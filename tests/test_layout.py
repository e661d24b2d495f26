"""How the package is laid out: no import cycle, a light PyTorch adapter, Orbax's internals in one
place, modules of a readable size. Read from the sources (no import), except the import check.

A cycle makes a module's names depend on the order the package happens to be imported in, and
marks two modules that hold one concept between them. ``import cocijax.torch`` must not import
Orbax or TensorStore: a PyTorch user needs neither (the managers share only the framework-neutral
core, ``cocijax.core``). Orbax's private modules (``orbax.checkpoint._src``) change without
notice: ``cocijax/_orbax_compat.py`` is the one module that imports them.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "cocijax"
ORBAX_PRIVATE = "orbax.checkpoint._src"
MAX_LINES = 500


def modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Per module, the modules of the package it imports when it is imported (its top level;
    imports inside functions or under ``if TYPE_CHECKING`` run later, or never)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        found = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cocijax"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in known else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("cocijax")}
        graph[name] = {m for m in found if m in known and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> list[str] | None:
        if module in trail:
            return [*trail[trail.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported, [*trail, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module, [])
        if cycle:
            return cycle
    return None


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_imports_without_a_cycle():
    graph = import_graph()
    assert "cocijax.storage._restore" in graph["cocijax.storage._handler"]  # the graph was read
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_pytorch_adapter_imports_neither_orbax_nor_tensorstore():
    code = (
        "import json, sys; import cocijax.torch; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('orbax', 'tensorstore', 'cocijax'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "cocijax.torch._manager" in loaded  # it did import the adapter
    heavy = [m for m in loaded if m.startswith(("orbax", "tensorstore", "cocijax.storage"))]
    assert heavy == [], heavy
    assert not [m for m in loaded if m.startswith("cocijax.manager")]  # only through the core


def orbax_private_imports() -> list[str]:
    """``file: module`` for every import of Orbax's private modules in the package's sources."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            found += [f"{path.relative_to(PACKAGE)}: {m}" for m in names if ORBAX_PRIVATE in m]
    return found


def test_only_the_compat_module_imports_orbax_private_modules():
    assert orbax_private_imports() == ["_orbax_compat.py: orbax.checkpoint._src.metadata"]
