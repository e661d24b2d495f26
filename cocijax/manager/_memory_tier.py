"""The memory tier of :class:`cocijax.CheckpointManager`: each save lands on tmpfs first.

Most failures of a training job (a process killed, an out-of-memory kill, a crash) leave the
machine and its memory intact (Gemini, SOSP 2023; Orbax's emergency checkpoint manager). A
folder on a tmpfs (``/dev/shm``) outlives the process that wrote it, not the machine: a save
there costs a memory copy, and a restart after a process failure restores at memory speed.

The tier is a checkpoint directory of its own, in the format of the disk tier (manifest and
checksums, Orbax's atomic commit of the step directory, the policy item), one folder per job:
``<memory>/<namespace>`` with the namespace of the directory's identity (``_identity``), locked
by its writer like the directory. It holds two *slots*: before a save starts, every committed
step but the newest is deleted, so the newest committed snapshot is never overwritten by the
one being written, and a save that fails (the tmpfs full) or is killed leaves it listed.

A save that is not persisted (a two-level policy's level 1) goes to this tier only; a persisted
save goes here and to the disk (and from there to the durable tier, ``_tiers``).

The rules both managers share (the ``memory`` arguments, the folder's lock and owner, the
budget, the slot rule) are :mod:`cocijax.core._memory`'s; this module keeps Orbax's side.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from cocijax.core._history import MARKER
from cocijax.core._lock import DirectoryLock
from cocijax.core._memory import (
    MemoryOptions,
    check_budget,
    claim_folder,
    older_slots,
)
from cocijax.core._session import run_all
from cocijax.manager._directory import (
    TRASH_DIR,
    check_layout,
    is_committed,
    merge_options,
)
from cocijax.manager._disk_copy import PENDING_PREFIX
from cocijax.manager._faults import naming, wait

__all__ = ["MemoryTier"]

log = logging.getLogger(__name__)


class MemoryTier:
    """A job's folder in memory and the Orbax manager that saves into it (see the module).

    Args:
      options: the checked ``memory`` arguments.
      namespace: the directory's namespace (``Identity.namespace``).
      directory: the checkpoint directory, recorded as the folder's owner: a copy of it (the
        same identity, another directory) must not take the original's snapshots for its own.
      make_manager: builds Orbax's manager of a folder from Orbax's options (the directory's
        handlers, data inside the step directories).
      read_only: a reader: nothing is locked, cleaned or written.
      enable_async: Orbax's ``enable_async_checkpointing``.
      opening: this writer's opening of the directory (``core._memory.count_opening``), and
        ``newest_on_disk`` the directory's newest step: when another writer opened the
        directory since this folder's last, the snapshots not newer than that step are removed
        (``check_owner``, ``remove_stale``).

    Raises:
      DirectoryLockedError: another manager writes to this memory folder.
      ValueError: the folder belongs to another directory that shares this one's identity.
    """

    def __init__(
        self,
        options: MemoryOptions,
        namespace: str,
        *,
        directory: Path,
        make_manager: Callable[[Path, ocp.CheckpointManagerOptions], ocp.CheckpointManager],
        read_only: bool,
        enable_async: bool,
        opening: int | None = None,
        newest_on_disk: int | None = None,
    ):
        self.options = options
        self.path = options.root / namespace
        self.marker = self.path / MARKER
        self.enabled = True  # False once a state did not fit (memory=True: the disk only)
        self._read_only = read_only
        self._lock: DirectoryLock | None = None
        self._fits_checked = False
        self._committed: set[int] = set()
        # Several processes (host-local): committed steps some process lacks (``_hosts``).
        self.unshared: set[int] = set()
        self._saving: int | None = None
        self._removal: threading.Thread | None = None  # deleted slots being removed
        if not read_only:
            self._lock = claim_folder(self.path, directory, opening, newest_on_disk)
            self._remove_uncommitted()
        elif not self.path.is_dir():
            self.enabled = False
            self.orbax = None
            return
        orbax_options = merge_options(
            ocp.CheckpointManagerOptions(
                enable_async_checkpointing=enable_async, read_only=read_only
            )
        )
        try:
            self.orbax = make_manager(self.path, orbax_options)
        except BaseException:
            self.close()
            raise
        self._committed = {int(p.name) for p in check_layout(self.path).committed}

    # -- listing ----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps in memory, oldest first (a save in flight is not listed)."""
        if self.orbax is None:
            return []
        if self._read_only:
            self.orbax.reload()
        steps = sorted(self.orbax.all_steps())
        self._committed &= set(steps)
        for step in steps:
            if step not in self._committed and is_committed(self.path / str(step)):
                self._committed.add(step)
        return [s for s in steps if s in self._committed]

    def to_disk(self) -> set[int]:
        """The persisted steps whose disk copy has not committed (``_disk_copy``'s markers)."""
        names = [p.name[len(PENDING_PREFIX) :] for p in self.path.glob(f"{PENDING_PREFIX}*")]
        return {int(n) for n in names if n.isdigit()}

    def listed(self) -> list[int]:
        """The committed steps in memory the job restores from memory, oldest first: with
        several processes, those every process holds (as last agreed)."""
        return [s for s in self.steps() if s not in self.unshared]

    # -- saving -----------------------------------------------------------------------------

    def check_fits(self, nbytes: int) -> bool:
        """Whether two states of ``nbytes`` fit the budget and the tmpfs (at the first save).

        Returns:
          True, or False with ``memory=True`` (warned: the manager saves to the disk only).

        Raises:
          ValueError: they do not fit a ``memory=`` folder given (names the sizes).
        """
        if self._fits_checked or not self.enabled:
            return self.enabled
        self._fits_checked = True
        self.enabled = check_budget(self.path, self.options, nbytes, stacklevel=6)
        return self.enabled

    def save(self, step: int, args: ocp.args.Composite, *, nbytes: int, **kwargs: Any) -> None:
        """Starts Orbax's save of ``step`` (a state of ``nbytes``) into memory, after freeing
        the older slot.

        Call once the previous save has been waited for (:meth:`wait`).
        """
        committed = self.steps()
        if step in committed:
            # Several processes: a step not every process held (hidden), which the job resumed
            # before; it is saved anew.
            self.orbax.delete(step)
            committed.remove(step)
        # The newest stays until this one commits; a persisted step not yet on the disk stays
        # until its copy commits (_disk_copy).
        for old in older_slots(committed, keep=self.to_disk()):
            self.orbax.delete(old)  # renamed into the trash: unlisted at once
            self._committed.discard(old)
        self._empty_trash(room_for=nbytes)
        self._saving = step
        with naming(self.path / str(step), (self.path,)):
            self.orbax.save(step, args=args, force=True, **kwargs)

    def _empty_trash(self, room_for: int) -> None:
        """Removes the deleted slots: in a thread of its own when the tmpfs has room for the
        new state beside them (their removal then overlaps its write, off the training
        thread), else at once (the budget holds two slots, not three).
        """
        if self._removal is not None:
            self._removal.join()
            self._removal = None
        trash = self.path / TRASH_DIR
        if not trash.exists():
            return
        stat = os.statvfs(self.path)
        if stat.f_bavail * stat.f_frsize < room_for:
            shutil.rmtree(trash, ignore_errors=True)
            return
        removing = trash.with_name(f"{TRASH_DIR}-{os.urandom(4).hex()}")
        os.replace(trash, removing)  # Orbax makes a new trash; a kill leaves it to the opening
        self._removal = threading.Thread(
            target=shutil.rmtree, args=(removing,), kwargs={"ignore_errors": True}, daemon=True
        )
        self._removal.start()

    def wait(self) -> None:
        """Waits for the save in flight; a failed one's leftovers are removed (its error raised,
        naming a path), and the older slot stays listed."""
        step, self._saving = self._saving, None
        if step is None:
            return
        try:
            wait(self.orbax, self.path / str(step), (self.path,))
        except BaseException:
            self._remove_uncommitted()
            self.orbax.reload()
            raise

    def _remove_uncommitted(self) -> None:
        """Removes what is not a committed step (a killed or failed save's, the trash)."""
        with os.scandir(self.path) as entries:
            names = [e.name for e in entries]
        for name in names:
            path = self.path / name
            # Files are the tier's own (lock, markers, owner); a folder is a step or leftovers.
            if path.is_dir() and not (name.isdigit() and is_committed(path)):
                log.info("%s: removing %s (never committed)", self.path, name)
                shutil.rmtree(path, ignore_errors=True)

    # -- restoring, deleting, closing -------------------------------------------------------

    def restore(self, step: int, items: dict[str, Any]) -> Any:
        """Orbax's restore of ``items`` from the memory copy of ``step``."""
        return self.orbax.restore(step, args=ocp.args.Composite(**items))

    def delete(self, step: int) -> None:
        """Deletes a committed step from memory."""
        self.orbax.delete(step)
        self._committed.discard(step)
        shutil.rmtree(self.path / TRASH_DIR, ignore_errors=True)

    def close(self) -> None:
        """Waits for the save in flight, closes Orbax's manager and releases the lock."""
        orbax = getattr(self, "orbax", None)
        lock, self._lock = self._lock, None
        removal, self._removal = self._removal, None
        run_all(
            self.wait if orbax is not None else (lambda: None),
            removal.join if removal is not None else (lambda: None),
            orbax.close if orbax is not None else (lambda: None),
            lock.release if lock is not None else (lambda: None),
        )
