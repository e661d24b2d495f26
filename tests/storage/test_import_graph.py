"""cocijax.storage's modules import each other without a cycle (type-only imports included).

A cycle makes a module's names depend on the order the package happens to be imported in, and
marks two modules that hold one concept between them. Read from the sources (no import).
"""

import ast
import pathlib

import cocijax.storage

PACKAGE = "cocijax.storage"


def storage_imports() -> dict[str, set[str]]:
    """Per module of the package, the modules of the package it imports (anywhere in it)."""
    folder = pathlib.Path(cocijax.storage.__file__).parent
    names = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
                found |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE + "."):
                        found.add(alias.name.removeprefix(PACKAGE + ".").split(".")[0])
        graph[path.stem] = found - {path.stem}
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


def test_storage_modules_import_each_other_without_a_cycle():
    graph = storage_imports()
    assert graph["_handler"]  # the graph was read: the handler imports the write path
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
