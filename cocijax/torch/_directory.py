"""The layout of a ``cocijax.torch`` checkpoint directory, and its atomic commit.

Layout of ``directory``::

    <step>/                 one committed checkpoint: DCP's files (``.metadata``, one
                            ``__<rank>_0.distcp`` per rank that wrote) and ``cocijax.json``
    .tmp-<step>-<session>/  a save still being written (removed when a manager opens)
    .cocijax.lock           the writer's lock (rank 0's)
    .cocijax-running        the running marker (see ``cocijax.manager._history``)

A step is committed by renaming its temporary directory to ``<step>`` once every rank's files
and ``cocijax.json`` are durable, so a listed step is always whole. Only rank 0 calls the
functions here that change the directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from cocijax.storage import fsync_dir

__all__ = [
    "FORMAT",
    "METADATA_NAME",
    "TMP_PREFIX",
    "commit",
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
_STEP_DIR = re.compile(r"^\d+$")


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


def remove_uncommitted(directory: Path) -> None:
    """Removes the temporary directories of saves that never committed (a crashed run's)."""
    for entry in directory.iterdir():
        if entry.is_dir() and entry.name.startswith(TMP_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)


def commit(directory: Path, tmp: Path, step: int, meta: dict[str, Any]) -> None:
    """Writes ``cocijax.json`` into ``tmp`` and renames it to ``<step>``, durably."""
    path = tmp / METADATA_NAME
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "step": step, "time": time.time(), **meta}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, directory / str(step))
    fsync_dir(directory)


def remove(path: Path) -> None:
    """Deletes a step directory (a dropped step, or an abandoned save's temporary one)."""
    shutil.rmtree(path, ignore_errors=True)


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
