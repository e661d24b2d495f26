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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from cocijax.core._contract import DirectoryLockedError
from cocijax.core._history import MARKER
from cocijax.core._lock import DirectoryLock
from cocijax.core._session import run_all
from cocijax.manager._directory import (
    TRASH_DIR,
    check_layout,
    is_committed,
    merge_options,
)
from cocijax.manager._faults import naming, wait

__all__ = ["MemoryOptions", "MemoryTier", "check_memory", "mount_of"]

log = logging.getLogger(__name__)

# The directory whose snapshots a memory folder holds (see MemoryTier._check_owner).
_OWNER_FILE = ".cocijax-owner"
# File systems whose files live in memory (what ``memory=`` is for).
_MEMORY_FS = ("tmpfs", "ramfs")


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """A manager's ``memory`` and ``memory_bytes``, checked.

    Attributes:
      root: the folder the job's namespace folder goes into.
      memory_bytes: the tier's budget in bytes (None: two states).
      automatic: ``memory=True``: a state that does not fit falls back to the disk (warned).
    """

    root: Path
    memory_bytes: int | None
    automatic: bool


def mount_of(path: Path) -> tuple[str, str]:
    """``(mount point, file system type)`` of the mount holding ``path`` (``("", "")``: unknown)."""
    best = ("", "")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best
    resolved = str(path.resolve())
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].encode().decode("unicode_escape")  # \040 is a space
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def _find_tmpfs() -> Path | None:
    """The tmpfs ``memory=True`` uses: POSIX shared memory's, where the system mounts one."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    points = [f.split()[1] for f in lines if len(f.split()) > 2 and f.split()[2] in _MEMORY_FS]
    shm = [p for p in points if p.endswith("/shm") and os.access(p, os.W_OK)]
    return Path(shm[0]) if shm else None


def check_memory(memory: Any, memory_bytes: Any, directory: Path) -> MemoryOptions | None:
    """The manager's ``memory`` and ``memory_bytes`` arguments, checked (see its docstring).

    Raises:
      TypeError: ``memory`` is not a bool or a path, or ``memory_bytes`` not an int.
      ValueError: ``memory_bytes`` is not positive, the folder overlaps ``directory``, or the
        job has several processes (not supported yet).
    """
    if memory_bytes is not None and (
        isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int)
    ):
        raise TypeError(f"memory_bytes: expected an int or None, got {memory_bytes!r}.")
    if memory_bytes is not None and memory_bytes <= 0:
        raise ValueError(f"memory_bytes: must be positive, got {memory_bytes}.")
    if memory is None or memory is False:
        if memory_bytes is not None:
            raise ValueError("memory_bytes: given without memory=; pass memory=True or a folder.")
        return None
    if memory is not True and not isinstance(memory, (str, os.PathLike)):
        raise TypeError(f"memory: expected True, a folder (str or path) or None, got {memory!r}.")
    if jax.process_count() > 1:
        raise ValueError(
            "memory=: the memory tier supports one process; this job has "
            f"{jax.process_count()}. Open without memory=."
        )
    if memory is True:
        found = _find_tmpfs()
        if found is None:
            warnings.warn(
                "memory=True: no writable tmpfs for shared memory on this machine; the "
                "manager saves to the disk only.",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        root = found / f"cocijax-{os.getuid()}"
    else:
        root = Path(memory).expanduser().absolute()
        _check_place(root, directory)
    return MemoryOptions(root=root, memory_bytes=memory_bytes, automatic=memory is True)


def _check_place(root: Path, directory: Path) -> None:
    real, real_dir = root.resolve(), directory.resolve()
    if real == real_dir or real_dir in real.parents or real in real_dir.parents:
        raise ValueError(
            f"memory={str(root)!r} overlaps the checkpoint directory {directory}: give a folder "
            "on a tmpfs apart from it (e.g. memory=True)."
        )
    existing = next((p for p in (root, *root.parents) if p.exists()), root)
    point, kind = mount_of(existing)
    if kind and kind not in _MEMORY_FS:
        warnings.warn(
            f"memory={str(root)!r} is on a disk ({kind} mounted at {point}), not in memory "
            "(tmpfs): its saves cost a disk write. Give a folder on a tmpfs, or memory=True.",
            RuntimeWarning,
            stacklevel=5,
        )


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
    ):
        self.options = options
        self.path = options.root / namespace
        self.marker = self.path / MARKER
        self.enabled = True  # False once a state did not fit (memory=True: the disk only)
        self._read_only = read_only
        self._lock: DirectoryLock | None = None
        self._fits_checked = False
        self._committed: set[int] = set()
        self._saving: int | None = None
        self._removal: threading.Thread | None = None  # deleted slots being removed
        if not read_only:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = DirectoryLock(self.path)
            try:
                self._lock.acquire()
            except DirectoryLockedError as e:
                self._lock = None
                holder = re.search(r"CheckpointManager: (.*) \(lock ", str(e))
                raise DirectoryLockedError(
                    f"memory: the memory folder {self.path} is in use by another "
                    f"CheckpointManager of the same job ({holder[1] if holder else 'unknown'}). "
                    "Two managers of one directory (or of copies of it) cannot share a memory "
                    "tier: close the other one, or give this one another memory= folder."
                ) from None
            self._check_owner(directory)
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

    def _check_owner(self, directory: Path) -> None:
        """Records ``directory`` as the folder's owner, unless another existing directory is.

        Raises:
          ValueError: the owner is another directory with this one's identity (a copy).
        """
        record = self.path / _OWNER_FILE
        try:
            owner = Path(json.loads(record.read_bytes())["directory"])
        except (OSError, ValueError, KeyError, TypeError):
            owner = None
        if owner is not None and owner.exists() and not _same(owner, directory):
            self.close()
            raise ValueError(
                f"memory: the memory folder {self.path} holds the snapshots of {owner}, whose "
                f"identity {directory} shares (a copy of it, made with cp -r or a volume "
                "snapshot): they are not this directory's steps. Give it another memory= folder."
            )
        if owner is None or not _same(owner, directory):
            tmp = record.with_name(_OWNER_FILE + ".tmp")
            tmp.write_text(json.dumps({"directory": str(directory)}))
            os.replace(tmp, record)

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
        need = 2 * nbytes
        stat = os.statvfs(self.path)
        free = stat.f_bavail * stat.f_frsize + _bytes_under(self.path)  # ours are replaced
        budget = min(free, self.options.memory_bytes or need)
        if need <= budget:
            return True
        message = (
            f"a state of {nbytes} bytes does not fit the memory tier {self.path}: its two "
            f"slots need {need} bytes, and "
            + (
                f"memory_bytes={self.options.memory_bytes}"
                if self.options.memory_bytes is not None and self.options.memory_bytes < need
                else f"the tmpfs holds {free} bytes free (with this job's snapshots)"
            )
        )
        if not self.options.automatic:
            raise ValueError(
                f"memory: {message}. Raise memory_bytes, free or grow the tmpfs, or open "
                "without memory=."
            )
        warnings.warn(
            f"memory=True: {message}; the manager saves to the disk only.",
            RuntimeWarning,
            stacklevel=5,
        )
        self.enabled = False
        return False

    def save(self, step: int, args: ocp.args.Composite, *, nbytes: int, **kwargs: Any) -> None:
        """Starts Orbax's save of ``step`` (a state of ``nbytes``) into memory, after freeing
        the older slot.

        Call once the previous save has been waited for (:meth:`wait`).
        """
        committed = self.steps()
        for old in committed[:-1]:  # the newest stays until this one commits
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


def _same(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _bytes_under(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(folder, name)).st_size
    return total
