"""Where the commands print: tables to stdout, progress bars to a watched stderr."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def _stdout() -> Console:
    # Wide enough for the tables when output is piped (rich assumes 80 columns then).
    return Console(width=None if sys.stdout.isatty() else 120, highlight=False)


def _progress() -> Progress:
    """A progress bar on stderr, only where someone watches it (no stray output in logs)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
