"""The one error type of the command line, and what its exit statuses mean."""

from __future__ import annotations

__all__ = ["EXIT_BAD_INPUT", "EXIT_DAMAGED", "EXIT_OK", "CliError"]

EXIT_OK = 0
"""The command did what was asked (a listing, an intact checkpoint, a plan)."""
EXIT_DAMAGED = 1
"""Damage was found: a piece fails its checksum, is missing or cannot be read."""
EXIT_BAD_INPUT = 2
"""Bad arguments, or an input that is not what the command needs (a missing file, a directory
that is not a cocijax checkpoint directory, a CSV that cannot be read)."""


class CliError(Exception):
    """A failure reported as one line ``cocijax ...: error: ...`` with exit status ``code``."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.code = code
