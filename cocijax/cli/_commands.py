"""The commands behind ``cocijax`` (see :mod:`cocijax.cli`); they import JAX when they run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from cocijax.cli._errors import EXIT_BAD_INPUT, CliError
from cocijax.cli._inspect import ls, verify
from cocijax.cli._plan import plan

__all__ = ["bench", "ls", "plan", "verify"]


def _find_write_bench() -> Path | None:
    # The benchmark lives in the source tree next to the package, not inside it.
    candidate = Path(__file__).resolve().parents[2] / "benchmarks" / "write_bench.py"
    return candidate if candidate.is_file() else None


def bench(argv: list[str]) -> int:
    path = _find_write_bench()
    if path is None:
        raise CliError(
            "the write benchmark is not available: it ships in the source tree "
            "(benchmarks/write_bench.py); run from a git checkout installed with pip install -e",
            code=EXIT_BAD_INPUT,
        )
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # for the benchmarks' shared _report module
    spec = importlib.util.spec_from_file_location("cocijax_write_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The benchmark's argparse takes its program name from argv[0]: show how it was invoked.
    saved, sys.argv[0] = sys.argv[0], "cocijax bench"
    try:
        status = module.main(argv)
    finally:
        sys.argv[0] = saved
    return int(status or 0)
