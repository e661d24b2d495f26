"""How the package is laid out: no import cycle, a light PyTorch adapter, Orbax's internals in one
place, modules of a readable size. Read from the sources (no import), except the import check.

A cycle makes a module's names depend on the order the package happens to be imported in, and
marks two modules that hold one concept between them. ``import cocijax.torch`` must not import
Orbax or TensorStore: a PyTorch user needs neither (the managers share only the framework-neutral
core, ``cocijax.core``). Orbax's private modules (``orbax.checkpoint._src``) change without
notice: ``cocijax/_orbax_compat.py`` is the one module that imports them. A module of the package
or of ``benchmarks/`` has at most ``MAX_LINES`` lines, and a function of the package at most
``MAX_FUNCTION_LINES`` lines of code (its docstring left out): past that, split it by concept.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "cocijax"
BENCHMARKS = PACKAGE.parent / "benchmarks"
ORBAX_PRIVATE = "orbax.checkpoint._src"
MAX_LINES = 500
MAX_FUNCTION_LINES = 80


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


def long_modules(*roots: pathlib.Path, limit: int = MAX_LINES) -> list[str]:
    """``file: n lines`` for every module under ``roots`` longer than ``limit`` lines."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root.parent)}: {lines} lines (at most {limit})")
    return found


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``function`` from its first statement after the docstring to its end."""
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    return function.end_lineno - body[0].lineno + 1 if body else 0


def long_functions(root: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file: function: n lines`` for every function under ``root`` with more than ``limit``
    lines of code (:func:`code_lines`; a nested function counts in its own and its outer's)."""
    found = []

    def visit(node: ast.AST, path: pathlib.Path, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}."
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = code_lines(child)
                if lines > limit:
                    where = path.relative_to(root.parent)
                    found.append(f"{where}: {name[:-1]}: {lines} lines of code (at most {limit})")
            visit(child, path, name)

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text()), path, "")
    return found


def test_the_size_checks_find_a_long_module_and_a_long_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    statements = "".join(f"        x{i} = {i}\n" for i in range(81))
    (package / "a.py").write_text(
        'class A:\n    def method(self):\n        """Doc."""\n' + statements
        + 'def short():\n    """Doc.\n\n    A docstring does not count.\n    """\n    return 1\n'
    )  # fmt: skip
    (package / "b.py").write_text("pass\n" * 120)
    assert long_functions(package) == [f"pkg{os.sep}a.py: A.method: 81 lines of code (at most 80)"]
    assert long_functions(package, limit=81) == []
    assert long_modules(package, limit=100) == [f"pkg{os.sep}b.py: 120 lines (at most 100)"]
    assert long_modules(package, limit=120) == []


def test_modules_are_at_most_500_lines_and_functions_at_most_80_lines_of_code():
    too_long = long_modules(PACKAGE, BENCHMARKS) + long_functions(PACKAGE)
    assert not too_long, "split by concept:\n" + "\n".join(too_long)


def test_every_benchmark_module_imports():
    """A benchmark that cannot even import fails only when someone runs it, often much later
    (a split of write_bench once broke three that imported its helpers)."""
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert "write_bench" in names
    code = f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=BENCHMARKS, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
