"""Garbage collection of a JAX checkpoint directory, and the damaged steps it sets aside.

What a directory may hold besides its committed steps, and what becomes of it:

* **The trash** (``.cocijax-deleted/``): Orbax renames the steps it drops there instead of
  deleting them file by file, so a crash during a deletion never leaves a listed step with half
  its files. Emptied here; an entry that cannot be removed (an I/O error) is logged and tried
  again at the next collection, never ignored.
* **Failed saves** (``<step>.orbax-checkpoint-tmp-*``): a save that failed (a full disk) leaves
  its temporary directory; with the data inside the step directory that is a whole copy of the
  state. Moved to the trash at the next collection, so a disk that was full for a moment costs
  one save, not every later one.
* **Damaged steps** (a step directory whose manifest is missing or invalid, whose Orbax
  metadata cannot be read, or that a ``restore(fallback=True)`` found damaged): not listed,
  and *set aside* into ``.cocijax-quarantine/`` for inspection, with a note of why. The newest
  :data:`QUARANTINE_KEEP` stay there (and their stripes with them); older ones are deleted.
* **Stripes no step references**: with external roots, a step's data also lives in stripe
  directories on those roots, which deleting the step directory leaves behind. Which stripes a
  step references is the storage's knowledge (:func:`cocijax.storage.unreferenced_stripe_dirs`:
  by name, from each manifest's raw bytes, damaged ones included); this module decides when
  removing is safe and removes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from cocijax import _files, storage
from cocijax.manager._directory import STATE_ITEM, STEP_RE, TMP_MARK, TRASH_DIR

__all__ = ["QUARANTINE_DIR", "QUARANTINE_KEEP", "collect_garbage", "quarantine"]

log = logging.getLogger(__name__)

QUARANTINE_DIR = ".cocijax-quarantine"
# Damaged steps kept for inspection: enough to look at what went wrong, and bounded, since with
# the data inside the step directories each one holds a whole state.
QUARANTINE_KEEP = 2
_REASON = "cocijax-quarantine.txt"


def quarantine(step_dir: Path, reason: str) -> Path:
    """Sets a damaged step directory aside: unlisted, kept for inspection (see the module).

    Call on the primary writer only, with no save of that step in flight.

    Returns:
      Where it went.
    """
    target = _files.move_aside(step_dir, step_dir.parent / QUARANTINE_DIR, label="damaged")
    try:
        (target / _REASON).write_text(f"{step_dir}: {reason}\n")
    except OSError as e:  # the note is a courtesy: the step is set aside all the same
        log.warning("%s: cannot write why it was set aside (%s)", target, e)
    log.warning(
        "%s is damaged (%s): set aside as %s, not listed; the newest %d damaged steps are kept "
        "for inspection",
        step_dir,
        reason,
        target,
        QUARANTINE_KEEP,
    )
    return target


def collect_garbage(directory: Path, stripe_roots: Sequence[Path | storage.KvPath]) -> None:
    """Empties the trash, removes failed saves and old damaged steps, then unreferenced stripes.

    Call it only on the primary process and only while no save is in flight (the caller has
    waited), so that the only unreferenced stripes are those of deleted steps and of crashed or
    failed saves. Steps are read from disk, not from Orbax's cache, so a committed step's data
    is never removed even if another tool listed it differently; while the references of some
    step cannot be read now (an I/O error), no stripe is removed.

    Args:
      directory: the checkpoint directory.
      stripe_roots: this directory's stripe folders on the external roots (may be empty).
    """
    trash = directory / TRASH_DIR
    for entry in _entries(directory):
        if TMP_MARK in entry.name:
            log.info("removing %s, left by a save that did not commit", entry)
            _files.move_aside(entry, trash)
    quarantined = sorted(_entries(directory / QUARANTINE_DIR), key=os.path.getmtime)
    for entry in quarantined[: max(len(quarantined) - QUARANTINE_KEEP, 0)]:
        log.info("deleting %s: newer damaged steps are kept for inspection", entry)
        _files.move_aside(entry, trash)
    for entry in _entries(trash):
        try:
            _files.remove_tree(entry)
        except OSError as e:  # out of sight already: tried again at the next collection
            log.warning("cannot remove %s (%s); trying again at the next collection", entry, e)
    if not stripe_roots:
        return
    # The renames into the trash were not synced: make them durable before their stripes go,
    # or after a power loss a step could be listed again without its data (found by
    # tests/reliability/test_power_loss.py).
    _files.fsync_dir(directory)
    items = [e / STATE_ITEM for e in _entries(directory) if STEP_RE.match(e.name)]
    items += [e / STATE_ITEM for e in _entries(directory / QUARANTINE_DIR)]
    garbage = storage.unreferenced_stripe_dirs(stripe_roots, items)
    if garbage is None:
        return  # some step's references cannot be read now: removing any could lose its data
    for stripe_dir in garbage:
        log.info("removing unreferenced stripe directory %s", stripe_dir)
        if isinstance(stripe_dir, storage.KvPath):
            stripe_dir.delete_all()
        else:
            try:
                _files.remove_tree(stripe_dir)
            except OSError as e:  # unreferenced: nothing lost; tried again next time
                log.warning("cannot remove %s (%s); trying again later", stripe_dir, e)


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except FileNotFoundError:
        return []
