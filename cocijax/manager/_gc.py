"""Garbage collection of a JAX checkpoint directory: the trash, and stripes no step references.

Orbax renames the steps it drops into the trash (``.cocijax-deleted/``); with external roots a
step's data also lives in stripe directories on those roots, which deleting the step directory
leaves behind. Which stripes are still referenced is the storage's knowledge
(:func:`cocijax.storage.unreferenced_stripe_dirs`, with its rule for manifests it cannot read);
this module only decides when removing is safe and removes.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from cocijax import storage
from cocijax.manager._directory import STATE_ITEM, STEP_RE, TRASH_DIR

__all__ = ["collect_garbage"]

log = logging.getLogger(__name__)


def collect_garbage(directory: Path, stripe_roots: Sequence[Path | storage.KvPath]) -> None:
    """Empties the trash and removes the stripe directories no step directory references.

    Call it only on the primary process and only while no save is in flight (the caller has
    waited), so that the only unreferenced stripes are those of deleted steps and of crashed
    saves. Steps are read from disk, not from Orbax's cache, so a committed step's data is
    never removed even if another tool listed it differently; while any step's references are
    unknown, nothing is removed.

    Args:
      directory: the checkpoint directory.
      stripe_roots: this directory's stripe folders on the external roots (may be empty).
    """
    trash = directory / TRASH_DIR
    if trash.is_dir():
        for entry in trash.iterdir():
            shutil.rmtree(entry, ignore_errors=True)
    if not stripe_roots:
        return
    # Orbax renamed the dropped steps into the trash without syncing: make that durable before
    # their stripes go, or after a power loss a step could be listed again without its data
    # (found by tests/reliability/test_power_loss.py).
    storage.fsync_dir(directory)
    items = [e / STATE_ITEM for e in directory.iterdir() if STEP_RE.match(e.name)]
    garbage = storage.unreferenced_stripe_dirs(stripe_roots, items)
    if garbage is None:
        return  # a step whose stripes are unknown: removing any could lose its data
    for stripe_dir in garbage:
        log.info("removing unreferenced stripe directory %s", stripe_dir)
        storage.remove_tree(stripe_dir)  # a local directory, or every object of an S3 prefix
