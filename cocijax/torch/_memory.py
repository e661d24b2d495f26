"""The memory tier of ``cocijax.torch.CheckpointManager``: each save lands on tmpfs first.

A folder on a tmpfs (``/dev/shm``) outlives the training process, not the machine: a save there
costs a memory copy, and a restart after a process failure (SIGKILL, an OOM kill, a crash)
restores at memory speed. The rules shared with the JAX manager (the arguments, the folder's
lock and owner, the budget, the two slots) are :mod:`cocijax.core._memory`'s; this module keeps
the torch format.

The tier is a ``cocijax.torch`` checkpoint directory of its own (``_directory``'s layout and
atomic commit), ``<memory>/<namespace>`` with the namespace of the checkpoint directory's
identity (:mod:`cocijax.core._identity`). Its steps also record a CRC-32 of each of their files
(DCP writes none), checked before a memory copy is loaded: a corrupt copy is skipped, never
loaded into the user's modules. A save persisted to the disk is copied there from its memory
copy once that has committed, in the background (one host snapshot per save).
"""

from __future__ import annotations

import logging
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

from cocijax._files import fsync_dir, fsync_file
from cocijax.core._history import MARKER
from cocijax.core._memory import (
    MemoryOptions,
    check_budget,
    check_owner,
    lock_folder,
    remove_stale,
)
from cocijax.core._session import run_all
from cocijax.torch._directory import (
    METADATA_NAME,
    TMP_PREFIX,
    remove,
    remove_uncommitted,
    scan_steps,
)

__all__ = ["MemoryTier", "checksums", "copy_step", "verify"]

log = logging.getLogger(__name__)

_CHUNK = 16 << 20


class MemoryTier:
    """A torch job's folder in memory, locked by its writer (see the module).

    Args:
      options: the checked ``memory`` arguments.
      namespace: the checkpoint directory's namespace (``Identity.namespace``).
      directory: the checkpoint directory, recorded as the folder's owner.
      epoch: the directory's identity epoch, as this opening bumped it, and ``newest_on_disk``
        the directory's newest step: when another writer opened the directory since this
        folder's last, the snapshots not newer than that step are removed (``check_owner``).

    Attributes:
      path: the job's folder.
      marker: the writer's run marker in it (see ``cocijax.core._history``).
      steps: the steps it holds, oldest first (a save in flight included).
      enabled: False once a state did not fit with ``memory=True`` (the disk only).

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
        epoch: int,
        newest_on_disk: int | None,
    ):
        self.options = options
        self.path = options.root / namespace
        self.marker = self.path / MARKER
        self.enabled = True
        self._fits_checked = False
        self._lock = lock_folder(self.path)
        try:
            if not check_owner(self.path, directory, epoch):
                remove_stale(self.path, newest_on_disk)
            remove_uncommitted(self.path)  # a killed save's temporary directory, the trash
            _remove_torn(self.path)
            self.steps = scan_steps(self.path)
        except BaseException:
            self._lock.release()
            raise

    def check_fits(self, nbytes: Callable[[], int]) -> bool:
        """Whether two states of ``nbytes()`` bytes fit: checked at the first save (see
        :func:`cocijax.core._memory.check_budget`), the answer kept."""
        if not self._fits_checked and self.enabled:
            self._fits_checked = True
            # The user's save -> save_step -> _memory_target -> here -> check_budget.
            self.enabled = check_budget(self.path, self.options, nbytes(), stacklevel=5)
        return self.enabled

    def delete(self, step: int) -> None:
        """Deletes a committed step (renamed into the trash first: unlisted at once)."""
        if step in self.steps:
            self.steps.remove(step)
        remove(self.path / str(step))

    def close(self) -> None:
        """Releases the folder's lock."""
        run_all(self._lock.release)


def _remove_torn(path: Path) -> None:
    """Removes step directories without their ``cocijax.json`` (cut by hand, or by a tmpfs
    that lost files): a memory copy is a cache of the job's state, never its only record of
    something a user wrote there."""
    for entry in path.iterdir():
        if entry.name.isdigit() and entry.is_dir() and not (entry / METADATA_NAME).is_file():
            log.warning("%s: removing %s (no %s: torn)", path, entry.name, METADATA_NAME)
            remove(entry)


def checksums(step_dir: Path) -> dict[str, str]:
    """The CRC-32 of each file DCP wrote into ``step_dir`` (``cocijax.json`` aside)."""
    return {
        entry.name: _crc32(entry)
        for entry in sorted(step_dir.iterdir())
        if entry.is_file() and entry.name != METADATA_NAME
    }


def verify(step_dir: Path, expected: dict[str, str]) -> None:
    """Checks the files of ``step_dir`` against their recorded checksums.

    Raises:
      ValueError: a file is missing or does not match (names it).
    """
    for name, crc in expected.items():
        path = step_dir / name
        if not path.is_file():
            raise ValueError(f"{path} is missing")
        if _crc32(path) != crc:
            raise ValueError(f"{path} does not match its checksum (damaged)")


def copy_step(step_dir: Path, directory: Path, step: int, session: str) -> Path:
    """Copies the DCP files of a committed step into a new temporary directory of
    ``directory``, durably; the caller commits it (``_directory.commit``).

    Returns:
      The temporary directory.
    """
    tmp = directory / f"{TMP_PREFIX}{step}-{session}"
    tmp.mkdir()
    for entry in step_dir.iterdir():
        if entry.is_file() and entry.name != METADATA_NAME:
            shutil.copyfile(entry, tmp / entry.name)
            fsync_file(tmp / entry.name)
    fsync_dir(tmp)
    return tmp


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"
