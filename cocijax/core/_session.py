"""What a manager does around its backend, whatever writes the files: calls that must all run.

Both managers close in an order that must complete whatever fails on the way (a failed save's
error, an I/O error, a KeyboardInterrupt): the lock is always released and the previous signal
handlers are always back. :func:`run_all` is that order's one rule.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["run_all"]


def run_all(*calls: Callable[[], object]) -> None:
    """Calls every one of ``calls`` whatever the earlier ones raise; then raises the first error.

    Later errors are attached to the first as notes, so none is lost and none masks the first
    (a ``finally`` chain would raise the last). A ``KeyboardInterrupt`` does not stop the calls
    that follow it either: they release what must be released.
    """
    first: BaseException | None = None
    for call in calls:
        try:
            call()
        except BaseException as e:
            if first is None:
                first = e
            else:
                first.add_note(f"also: {type(e).__name__}: {e}")
    if first is not None:
        raise first
