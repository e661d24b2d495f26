"""The layout of a ``cocijax.torch`` checkpoint directory, and its atomic commit.

Layout of ``directory``::

    <step>/                 one committed checkpoint: DCP's files (``.metadata``, one
                            ``__<rank>_0.distcp`` per rank that wrote) and ``cocijax.json``
    .tmp-<step>-<session>/  a save still being written (removed when a manager opens)
    .cocijax-deleted/       the trash: deleted directories whose files are being removed
    .cocijax.lock           the writer's lock (rank 0's)
    .cocijax-running        the running marker (see ``cocijax.core._history``)

A step is committed by renaming its temporary directory to ``<step>`` once every rank's files
and ``cocijax.json`` are durable, and deleted by renaming it into the trash before any of its
files is removed (as the JAX manager does), so a listed step is always whole: a crash or an I/O
error in the middle of a deletion leaves the rest in the trash, which the next deletion or
opening empties. Only rank 0 calls the functions here that change the directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from cocijax._files import fsync_dir, remove_tree, replace_bytes
from cocijax.core._identity import Identity, bump_identity, read_identity
from cocijax.core._lock import DirectoryLock
from cocijax.core._memory import count_opening

__all__ = [
    "FORMAT",
    "METADATA_NAME",
    "TMP_PREFIX",
    "TRASH_DIR",
    "commit",
    "open_directory",
    "read_metadata",
    "remove",
    "remove_uncommitted",
    "scan_steps",
]

METADATA_NAME = "cocijax.json"
# /2: RNG states and extra items per rank (see _state); /1 (cocijax 0.1): one RNG state.
FORMAT = "cocijax.torch/2"
_FORMATS = ("cocijax.torch/1", FORMAT)
TMP_PREFIX = ".tmp-"
TRASH_DIR = ".cocijax-deleted"  # the JAX manager's name for its trash too
_STEP_DIR = re.compile(r"^\d+$")

log = logging.getLogger(__name__)


def scan_steps(directory: Path) -> list[int]:
    """The committed steps in ``directory``, oldest first.

    Raises:
      ValueError: a step directory has no ``cocijax.json`` (it was not written here).
    """
    steps = []
    for entry in directory.iterdir():
        if not (entry.is_dir() and _STEP_DIR.match(entry.name)):
            continue
        if not (entry / METADATA_NAME).is_file():
            raise ValueError(
                f"{entry} has no {METADATA_NAME}: {directory} holds checkpoints not written "
                "by cocijax.torch (a JAX cocijax.CheckpointManager directory? use that "
                "manager or another directory)"
            )
        steps.append(int(entry.name))
    return sorted(steps)


def open_directory(
    directory: Path, lock: DirectoryLock
) -> tuple[list[int], str, Identity, int, str]:
    """Rank 0, at opening: makes and locks ``directory``, removes what a crashed run left, lists
    the steps, reads (or makes) the directory's identity and counts the opening.

    Returns:
      The committed steps; the run's session (it names the run's temporary directories); the
      directory's identity (it names the memory tier's folder); this opening's count
      (``core._memory.count_opening``); the run's token (it marks the memory tiers and the
      directory).

    Raises:
      DirectoryLockedError: another manager writes to ``directory``.
      ValueError: as :func:`scan_steps`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    # Before anything is cleaned up: a second writer would remove the first's save in flight.
    lock.acquire()
    remove_uncommitted(directory)
    steps = scan_steps(directory)
    identity = read_identity(directory) or bump_identity(directory)
    # Every writer's opening counts: a memory tier's snapshots saved before an opening without
    # it are not restored (check_owner).
    opening = count_opening(directory)
    return steps, uuid.uuid4().hex[:12], identity, opening, os.urandom(8).hex()


def remove_uncommitted(directory: Path) -> None:
    """Removes what a crashed run left: the temporary directories of saves that never
    committed, and the trash of deletions it did not finish."""
    for entry in directory.iterdir():
        if entry.is_dir() and entry.name.startswith(TMP_PREFIX):
            remove(entry)
    empty_trash(directory)


def commit(directory: Path, tmp: Path, step: int, meta: dict[str, Any]) -> None:
    """Writes ``cocijax.json`` into ``tmp`` and renames it to ``<step>``, durably."""
    record = {"format": FORMAT, "step": step, "time": time.time(), **meta}
    replace_bytes(tmp / METADATA_NAME, json.dumps(record).encode(), fsync=True)
    os.rename(tmp, directory / str(step))
    fsync_dir(directory)


def remove(path: Path) -> None:
    """Deletes a directory of the checkpoint directory (a dropped step, or a save's temporary
    one): renames it into the trash, then empties the trash.

    The rename is atomic: ``path`` is listed whole or not at all, whatever interrupts the
    deletion. Errors are logged, not raised (a deletion follows a committed save or a failed
    one, whose outcome it must not change): a failed rename leaves ``path`` whole where it is;
    a failed removal leaves it in the trash for the next deletion or opening. A missing
    ``path`` (a save that failed before writing anything) is nothing to do.
    """
    try:
        (path.parent / TRASH_DIR).mkdir(exist_ok=True)
        # A unique name: an earlier deletion of the same step may still be in the trash.
        os.rename(path, path.parent / TRASH_DIR / f"{path.name}.{uuid.uuid4().hex[:8]}")
    except OSError as e:
        if not (isinstance(e, FileNotFoundError) and not path.exists()):
            log.warning("could not delete %s (it stays whole): %s", path, e)
        return
    empty_trash(path.parent)


def empty_trash(directory: Path) -> None:
    """Removes what the trash of ``directory`` holds; what cannot be removed is logged and
    stays there for the next call (each deletion and each opening)."""
    trash = directory / TRASH_DIR
    if not trash.is_dir():
        return
    try:
        # The renames into the trash durable before any file goes: after a power loss a step
        # must not be listed again without its files.
        fsync_dir(directory)
        entries = list(trash.iterdir())
    except OSError as e:
        log.warning("could not empty %s (retried at the next deletion or opening): %s", trash, e)
        return
    for entry in entries:
        try:
            remove_tree(entry)
        except OSError as e:
            log.warning(
                "could not remove %s, a deleted step or save (retried at the next deletion or "
                "opening): %s",
                entry,
                e,
            )


def read_metadata(directory: Path, step: int) -> dict[str, Any]:
    """The ``cocijax.json`` of a committed step.

    Raises:
      ValueError: it is missing, not JSON, or not a cocijax.torch file (naming it).
    """
    path = directory / str(step) / METADATA_NAME
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read cocijax.torch metadata {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") not in _FORMATS:
        raise ValueError(f"{path} is not cocijax.torch metadata (expected format {FORMAT!r})")
    return meta
