"""The memory tier's rules, whatever writes its files: where it lives, whose it is, its budget.

Both managers (:class:`cocijax.CheckpointManager`, ``cocijax.torch.CheckpointManager``) may keep
a *memory tier*: a checkpoint directory of their own format on a tmpfs (``/dev/shm``), which
outlives the training process, not the machine. What does not depend on the format is here:

* the ``memory``/``memory_bytes`` arguments (:func:`check_memory`): ``memory=True`` finds the
  shared-memory tmpfs at run time (:func:`find_tmpfs`); a folder given that is on a disk is
  warned about (:func:`mount_of`);
* the job's folder in it (``<memory>/<namespace>``, the namespace of the directory's identity):
  locked by its writer (:func:`lock_folder`) and owned by one directory (:func:`check_owner`),
  so that neither two jobs nor a copy of a directory take each other's snapshots;
* the budget (:func:`check_budget`): two states, checked at the first save, naming the sizes;
* the two slots (:func:`older_slots`): before a save starts, every committed step but the newest
  is deleted, so the newest committed snapshot is never overwritten by the one being written.

The writer's run marker in the folder (``<folder>/.cocijax-running``) tells a process failure
from a machine failure (:class:`cocijax.core._history.RunHistory`'s ``memory_marker``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

from cocijax.core._contract import DirectoryLockedError
from cocijax.core._lock import DirectoryLock

__all__ = [
    "MemoryOptions",
    "check_budget",
    "check_memory",
    "check_owner",
    "claim_folder",
    "count_opening",
    "find_tmpfs",
    "lock_folder",
    "mount_of",
    "older_slots",
    "remove_stale",
]

log = logging.getLogger(__name__)

# The directory whose snapshots a memory folder holds (see check_owner).
_OWNER_FILE = ".cocijax-owner"
# In a checkpoint directory: how many times a writer opened it (see count_opening).
OPENINGS_FILE = ".cocijax-openings"
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


def find_tmpfs() -> Path | None:
    """The tmpfs ``memory=True`` uses: POSIX shared memory's, where the system mounts one."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    points = [f.split()[1] for f in lines if len(f.split()) > 2 and f.split()[2] in _MEMORY_FS]
    shm = [p for p in points if p.endswith("/shm") and os.access(p, os.W_OK)]
    return Path(shm[0]) if shm else None


def check_memory(
    memory: Any,
    memory_bytes: Any,
    directory: Path,
    *,
    processes: int,
    hint: str = "Open without memory=.",
    stacklevel: int = 4,
) -> MemoryOptions | None:
    """A manager's ``memory`` and ``memory_bytes`` arguments, checked (see its docstring).

    Args:
      memory: ``True``, a folder, or None/False (no memory tier).
      memory_bytes: the budget in bytes, or None.
      directory: the checkpoint directory (the folder may not overlap it).
      processes: how many processes save together (the tier supports one).
      hint: what the error with several processes tells to do.
      stacklevel: as for ``warnings.warn``: the user's call to the manager.

    Returns:
      The checked options, or None without a memory tier (or with ``memory=True`` and no tmpfs:
      warned).

    Raises:
      TypeError: ``memory`` is not a bool or a path, or ``memory_bytes`` not an int.
      ValueError: ``memory_bytes`` is not positive, the folder overlaps ``directory``, or the
        job has several processes saving into one directory.
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
    if processes > 1:
        raise ValueError(
            f"memory=: the memory tier supports one process; this job has {processes}. {hint}"
        )
    if memory is True:
        found = find_tmpfs()
        if found is None:
            warnings.warn(
                "memory=True: no writable tmpfs for shared memory on this machine; the "
                "manager saves to the disk only.",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
            return None
        root = found / f"cocijax-{os.getuid()}"
    else:
        root = Path(memory).expanduser().absolute()
        _check_place(root, directory, stacklevel=stacklevel + 1)
    return MemoryOptions(root=root, memory_bytes=memory_bytes, automatic=memory is True)


def _check_place(root: Path, directory: Path, *, stacklevel: int) -> None:
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
            stacklevel=stacklevel,
        )


def lock_folder(path: Path) -> DirectoryLock:
    """Makes the job's memory folder and locks it for this writer.

    Raises:
      DirectoryLockedError: another manager of the same job (or of a copy of its directory)
        writes to it.
    """
    path.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(path)
    try:
        lock.acquire()
    except DirectoryLockedError as e:
        holder = re.search(r"CheckpointManager: (.*) \(lock ", str(e))
        raise DirectoryLockedError(
            f"memory: the memory folder {path} is in use by another "
            f"CheckpointManager of the same job ({holder[1] if holder else 'unknown'}). "
            "Two managers of one directory (or of copies of it) cannot share a memory "
            "tier: close the other one, or give this one another memory= folder."
        ) from None
    return lock


def count_opening(directory: Path) -> int:
    """Counts a writer's opening of ``directory`` (both managers, with a memory tier or
    without): the number of openings, this one included.

    The count orders a memory folder's snapshots against the runs that opened the directory
    since (:func:`check_owner`). It is not the identity's epoch, which orders a directory
    against its records on the roots and is bumped only with them. Not synced: a machine
    failure, which may lose the write, empties the memory tier as well; an unreadable count
    starts again from 0, which makes the snapshots stale (removed), never current.
    """
    path = directory / OPENINGS_FILE
    try:
        count = int(path.read_text())
    except (OSError, ValueError):
        count = 0
    tmp = path.with_name(OPENINGS_FILE + ".tmp")
    tmp.write_text(str(count + 1))
    os.replace(tmp, path)
    return count + 1


def check_owner(path: Path, directory: Path, opening: int | None) -> bool:
    """Records ``directory``, at its ``opening``-th opening, as the owner of the memory folder
    ``path``, unless another existing directory is: a copy of a directory (the same identity,
    another place) must not take the original's snapshots for its own. A moved directory (the
    recorded owner is gone) takes its folder over.

    Args:
      path: the job's memory folder.
      directory: the checkpoint directory.
      opening: this writer's opening of the directory, as :func:`count_opening` counted it
        (None: unknown, the snapshots are taken as current).

    Returns:
      Whether the folder's snapshots are current: no writer opened the directory since the
      one that last used this folder (its recorded opening is the one before ``opening``, or
      unknown). Otherwise a run without this memory tier may have resumed from an older step
      and saved the snapshots' step numbers again (see :func:`remove_stale`).

    Raises:
      ValueError: the owner is another directory with this one's identity (a copy).
    """
    record = path / _OWNER_FILE
    try:
        data = json.loads(record.read_bytes())
        owner, last = Path(data["directory"]), data.get("opening")
    except (OSError, ValueError, KeyError, TypeError):
        owner, last = None, None
    if owner is not None and owner.exists() and not _same(owner, directory):
        raise ValueError(
            f"memory: the memory folder {path} holds the snapshots of {owner}, whose "
            f"identity {directory} shares (a copy of it, made with cp -r or a volume "
            "snapshot): they are not this directory's steps. Give it another memory= folder."
        )
    tmp = record.with_name(_OWNER_FILE + ".tmp")
    tmp.write_text(json.dumps({"directory": str(directory), "opening": opening}))
    os.replace(tmp, record)
    return opening is None or not isinstance(last, int) or last == opening - 1


def claim_folder(
    path: Path, directory: Path, opening: int | None, newest_on_disk: int | None
) -> DirectoryLock:
    """A writer's claim on the job's memory folder ``path``, for both managers: locked
    (:func:`lock_folder`), ``directory`` recorded as its owner (:func:`check_owner`), and the
    snapshots a run in between may have saved again removed (:func:`remove_stale`).

    Returns:
      The folder's lock (released on any error here).

    Raises:
      DirectoryLockedError: as :func:`lock_folder`.
      ValueError: as :func:`check_owner`.
    """
    lock = lock_folder(path)
    try:
        if not check_owner(path, directory, opening):
            remove_stale(path, newest_on_disk)
    except BaseException:
        lock.release()
        raise
    return lock


def remove_stale(path: Path, newest_on_disk: int | None) -> None:
    """Removes the snapshots of the memory folder ``path`` that another writer may have saved
    again since (call when :func:`check_owner` says they are not current): those not newer
    than the newest step on the disk, ``newest_on_disk``. A newer one is the only save of its
    step number, whatever opened the directory in between (an opening that failed, a run that
    saved nothing): it stays.
    """
    if newest_on_disk is None:
        return
    stale = sorted(
        int(p.name) for p in path.iterdir() if p.name.isdigit() and int(p.name) <= newest_on_disk
    )
    if stale:
        log.warning(
            "%s: removing the memory snapshots of step(s) %s: the checkpoint directory was "
            "opened without this memory tier since they were saved, and holds step %d: that run "
            "may have saved these step numbers again, and the disk's copies are the ones to read",
            path,
            stale,
            newest_on_disk,
        )
    for step in stale:
        shutil.rmtree(path / str(step), ignore_errors=True)


def check_budget(path: Path, options: MemoryOptions, nbytes: int, *, stacklevel: int) -> bool:
    """Whether two states of ``nbytes`` fit the budget and the tmpfs holding ``path``.

    The tmpfs's free space counts this job's snapshots already there (they are replaced).

    Returns:
      True, or False with ``memory=True`` (warned: the manager saves to the disk only).

    Raises:
      ValueError: they do not fit a ``memory=`` folder given (names the sizes).
    """
    need = 2 * nbytes
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize + _bytes_under(path)  # ours are replaced
    budget = min(free, options.memory_bytes or need)
    if need <= budget:
        return True
    message = (
        f"a state of {nbytes} bytes does not fit the memory tier {path}: its two "
        f"slots need {need} bytes, and "
        + (
            f"memory_bytes={options.memory_bytes}"
            if options.memory_bytes is not None and options.memory_bytes < need
            else f"the tmpfs holds {free} bytes free (with this job's snapshots)"
        )
    )
    if not options.automatic:
        raise ValueError(
            f"memory: {message}. Raise memory_bytes, free or grow the tmpfs, or open "
            "without memory=."
        )
    warnings.warn(
        f"memory=True: {message}; the manager saves to the disk only.",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
    return False


def older_slots(committed: list[int], keep: Collection[int] = ()) -> list[int]:
    """The committed memory steps (oldest first) to delete before a new memory save starts:
    all but the newest, which stays until the new one commits (two slots), and but ``keep``:
    persisted steps whose disk copy has not committed, which would otherwise be lost (they
    stay beyond the budget until it commits; a full tmpfs then fails the memory save)."""
    return [step for step in committed[:-1] if step not in keep]


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
