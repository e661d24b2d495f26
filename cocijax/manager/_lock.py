"""The writer's lock on a checkpoint directory, shared by the JAX and the PyTorch manager."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from cocijax.manager._contract import DirectoryLockedError

__all__ = ["LOCK_FILE", "DirectoryLock"]

LOCK_FILE = ".cocijax.lock"


class DirectoryLock:
    """An exclusive, non-blocking ``flock`` on ``directory/.cocijax.lock``.

    The kernel drops the lock when the process dies, so a crashed writer never leaves the
    directory locked. Two managers in one process conflict too (each opens its own file).

    Example:
      >>> import tempfile
      >>> lock = DirectoryLock(Path(tempfile.mkdtemp()))
      >>> lock.acquire()
      >>> DirectoryLock(lock.path.parent).acquire()
      Traceback (most recent call last):
      ...
      cocijax.manager._contract.DirectoryLockedError: directory: ... is open for writing by ...
      >>> lock.release()
    """

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock.

        Raises:
          DirectoryLockedError: another writer holds it.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryLockedError(
                f"directory: {self.path.parent} is open for writing by another "
                f"CheckpointManager (lock {self.path}); close it first, or open this one with "
                "read_only options."
            ) from None
        self._fd = fd

    def release(self) -> None:
        """Releases the lock (no-op if not held); closing the descriptor releases it anyway."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
