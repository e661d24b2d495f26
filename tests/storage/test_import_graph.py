"""How cocijax.storage's modules import: no cycle, and Orbax's private modules only via compat.

A cycle makes a module's names depend on the order the package happens to be imported in, and
marks two modules that hold one concept between them. Orbax's private modules
(``orbax.checkpoint._src``) change without notice: ``cocijax/_orbax_compat.py`` is the one
module that imports them. Read from the sources (no import).
"""

import ast
import pathlib

import cocijax.storage

PACKAGE = "cocijax.storage"
ORBAX_PRIVATE = "orbax.checkpoint._src"


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


def orbax_private_imports(folder: pathlib.Path) -> list[str]:
    """``file: module`` for every import of Orbax's private modules in ``folder``'s sources."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            found += [f"{path.relative_to(folder)}: {m}" for m in modules if ORBAX_PRIVATE in m]
    return found


def test_only_the_compat_module_imports_orbax_private_modules():
    folder = pathlib.Path(cocijax.storage.__file__).parent.parent
    assert orbax_private_imports(folder) == ["_orbax_compat.py: orbax.checkpoint._src.metadata"]
