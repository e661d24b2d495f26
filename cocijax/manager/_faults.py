"""What the manager does after an I/O fault: report it once, and finish what it interrupted.

Two gaps in Orbax 0.12 after a failed asynchronous save, both found by injecting I/O errors with
libfiu (``tests/reliability/test_io_errors.py``):

* When Orbax's finalisation fails first (say, writing its step metadata), the item writers'
  own error stays behind in its ``AsyncCheckpointer`` and is raised later by an unrelated call,
  a ``restore`` of an intact step or the next ``save``. :func:`wait` raises every error of the
  save that failed at once, the first with the others as notes, so nothing is left behind.
* Many errors of a failed save say what failed but not where: an ``OSError`` from ``write``,
  ``fsync`` or ``close`` on a descriptor, Orbax's own errors. :func:`naming` makes every error
  a save raises name a path: the file when the error knows it, else the step directory.
* Orbax forgets the steps it meant to delete before it deletes them: a deletion that fails (or
  never runs, because the save that triggered it failed) is never tried again, and steps pile
  up beyond ``max_to_keep``. :func:`retry_deletions` notices committed steps on disk that
  Orbax no longer lists and reloads Orbax's view, so its next save applies retention to them;
  the manager calls it after a failed save too, so that until then they are still listed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from cocijax._orbax_compat import manager_checkpointer
from cocijax.core._session import run_all
from cocijax.manager._directory import STEP_RE, is_committed

__all__ = ["naming", "retry_deletions", "wait"]


@contextlib.contextmanager
def naming(where: Path, inside: Sequence[Path]) -> Iterator[None]:
    """Re-raises an error that names no path under ``inside`` as one that names ``where``.

    The new error has the same type (an ``OSError`` keeps its ``errno`` and gets ``where`` as
    its file name), the original's notes and the original as its cause; an error whose type
    cannot be rebuilt from a message gets ``where`` in a note only.
    """
    try:
        yield
    except Exception as e:
        if any(str(path) in str(e) for path in inside):
            raise
        try:
            if isinstance(e, OSError) and e.errno is not None:
                renamed = type(e)(e.errno, e.strerror, str(where))
            else:
                renamed = type(e)(f"{e} (while saving {where})")
        except Exception:
            e.add_note(f"while saving {where}")
            raise e from None
        for note in getattr(e, "__notes__", ()):
            renamed.add_note(note)
        raise renamed from e


def wait(orbax: ocp.CheckpointManager, where: Path, inside: Sequence[Path]) -> None:
    """Waits for Orbax's running save; raises each error it left, once, naming a path.

    Args:
      orbax: the manager.
      where: the path to name when an error names none (the step directory being saved).
      inside: an error naming any path under these is raised as it is.

    Raises:
      Exception: the first error of the failed save (later ones are attached as notes).
    """
    # When Orbax's finalisation fails first, its AsyncCheckpointer may still be writing, and
    # its error would be raised by a later restore: wait for it too. Orbax 0.12 has no public
    # name for the manager's checkpointer.
    checkpointer = manager_checkpointer(orbax)
    calls = [orbax.wait_until_finished, orbax.check_for_errors]
    if hasattr(checkpointer, "wait_until_finished"):
        calls.append(checkpointer.wait_until_finished)
    with naming(where, inside):
        run_all(*calls)


def retry_deletions(orbax: Any, directory: Path) -> None:
    """Makes Orbax see again the committed steps it forgot (failed deletions), for retention.

    Call only while no save is in flight (the caller waited).
    """
    known = set(orbax.all_steps())
    on_disk = [e for e in directory.iterdir() if STEP_RE.match(e.name) and int(e.name) not in known]
    if any(is_committed(e) for e in on_disk):
        orbax.reload()
