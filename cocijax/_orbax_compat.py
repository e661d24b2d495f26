"""Every use cocijax makes of Orbax's private details, in one place.

Orbax's public API (``orbax.checkpoint`` and its ``args``, ``metadata``, ``future``, ``path``
modules) does not name everything a handler and a manager need. What cocijax takes from beyond
it is here, each with the Orbax version it was checked against and why it is needed, so that an
Orbax upgrade is checked in this one file; ``pyproject.toml`` pins orbax-checkpoint to that minor
version. Code elsewhere imports these names from here, never ``orbax.checkpoint._src``.

Example:
  >>> tree = build_tree_metadata({"w": 1}, custom_metadata={"run": "a"})
  >>> isinstance(tree, TreeMetadata), tree.custom_metadata
  (True, {'run': 'a'})
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterable, Iterator
from typing import Any

# Checked against orbax-checkpoint 0.12.8. A handler's ``metadata()`` must return Orbax's tree
# metadata: ``CheckpointManager.item_metadata(step)`` and ``metadata(step).item_metadata.tree``
# read the tree from it, and a restore may be given it back as its target (the striped
# handler's restore recognises it by this class). Orbax 0.12 exports neither the class
# (``orbax.checkpoint.metadata.tree`` names only ``ValueMetadataEntry``) nor its builder.
from orbax.checkpoint._src.metadata import tree as _tree_metadata
from orbax.checkpoint.checkpoint_manager import CheckpointInfo

__all__ = [
    "TreeMetadata",
    "build_tree_metadata",
    "list_steps_lightly",
    "manager_checkpointer",
    "orbax_reader_notice_dropped",
]

TreeMetadata = _tree_metadata.TreeMetadata
"""Orbax's tree metadata (a Protocol): what ``StandardCheckpointHandler.metadata`` returns."""


def build_tree_metadata(tree: Any, *, custom_metadata: Any = None) -> TreeMetadata:
    """Orbax's tree metadata of ``tree`` (leaves: Orbax's value metadata), as its handlers build it.

    Args:
      tree: the saved tree with ``ocp.metadata`` value metadata (``ArrayMetadata``,
        ``ScalarMetadata``, ``StringMetadata``) in place of its values.
      custom_metadata: the JSON value saved with the tree, or None.

    Returns:
      A ``TreeMetadata`` whose ``tree`` is ``tree`` and whose ``custom_metadata`` is
      ``custom_metadata`` (checked against orbax-checkpoint 0.12.8:
      ``build_default_tree_metadata``).
    """
    return _tree_metadata.build_default_tree_metadata(tree, custom_metadata=custom_metadata)


def manager_checkpointer(manager: Any) -> Any:
    """The ``AsyncCheckpointer`` an ``ocp.CheckpointManager`` saves with, or None.

    Checked against orbax-checkpoint 0.12.8 (the private attribute ``_checkpointer``). When
    Orbax's finalisation fails first, this checkpointer may still be writing, and its error
    would be raised later by an unrelated call; the manager waits for it too (``_faults.wait``).
    Orbax 0.12 has no public name for it.
    """
    return getattr(manager, "_checkpointer", None)


def list_steps_lightly(manager: Any, steps: Iterable[int]) -> None:
    """Adds ``steps`` to the listing of an ``ocp.CheckpointManager`` opened with
    ``lightweight_initialize``, as that opening lists a step: no commit time, no metrics.

    Checked against orbax-checkpoint 0.12.8 (the private ``_checkpoints``, Orbax's listing,
    which its retention counts). ``reload()`` would list them too, but it lists every step
    again and reads each one's metrics; a manager whose opening left older steps unread lists
    them once they are checked, without reading them again.
    """
    listed = {info.step: info for info in manager._checkpoints}
    for step in steps:
        listed.setdefault(step, CheckpointInfo(step=step, time=datetime.datetime.min, metrics=None))
    manager._checkpoints.set([listed[step] for step in sorted(listed)])


class _ReaderNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only=")


@contextlib.contextmanager
def orbax_reader_notice_dropped() -> Iterator[None]:
    """Drops Orbax's warning ``Given directory is read only=DIR`` while the block runs.

    Orbax's ``CheckpointManager`` logs it (through absl) whenever it opens a read-only manager:
    it describes what the user asked for and asks nothing of them. Only that message is dropped,
    only while a manager opens.
    """
    quiet = _ReaderNotice()
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)
