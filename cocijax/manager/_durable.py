"""A durable commit for Orbax's step directories: fsyncs around the atomic rename.

Orbax commits a step by renaming its temporary directory to the step's name and fsyncs nothing:
after a power loss (unlike a killed process) the rename, the step's small files written through
the page cache (``_CHECKPOINT_METADATA``, the policy state's directory entry) and even the
checkpoint directory itself may be gone, although ``wait_until_finished`` had returned. Found by
``tests/reliability/test_power_loss.py``: in the crash states where only what was fsynced
survives, the newest step that had committed was not listed.

:class:`DurableRenameTemporaryPath` keeps Orbax's commit protocol and adds the syncs a rename
needs to be durable (the order of ALICE's "safe rename", Pillai et al., OSDI 2014): every file
and directory of the temporary directory before the rename, then the files Orbax rewrote
during its finalisation and the checkpoint directory, which holds the new name, after it.
The step's data on external roots was made durable by the handler before it wrote its manifest.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from orbax.checkpoint.path import atomicity

from cocijax._files import fsync_dir, fsync_file

__all__ = ["DurableRenameTemporaryPath", "fsync_tree"]


def fsync_tree(top: Path) -> None:
    """fsyncs every file and directory under ``top`` (``top`` included), files first."""
    # A directory os.walk cannot list would be skipped, left unsynced: raise instead.
    for dirpath, _, filenames in os.walk(top, topdown=False, onerror=_raise):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


class DurableRenameTemporaryPath(atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic-rename commit, made durable before it is reported done.

    A subclass, not a wrapper: Orbax builds temporary paths from the class itself
    (``from_final``/``from_temporary``) and recognises them by it, so only ``finalize`` changes.
    """

    async def finalize(self) -> None:
        tmp, final = Path(self.get()), Path(self.get_final())
        await asyncio.to_thread(fsync_tree, tmp)
        await super().finalize()
        await asyncio.to_thread(_after_rename, final)


def _raise(error: OSError) -> None:
    raise error


def _after_rename(final: Path) -> None:
    # Orbax rewrote its step metadata and wrote a commit marker in place during finalize: sync
    # the step's own files again (cheap: the data files are clean), then the new name.
    for entry in final.iterdir():
        if entry.is_file():
            fsync_file(entry)
    fsync_dir(final)
    fsync_dir(final.parent)
