"""The writer's lock on a checkpoint directory, shared by the JAX and the PyTorch manager."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from cocijax.core._contract import DirectoryLockedError

__all__ = ["LOCK_FILE", "DirectoryLock"]

LOCK_FILE = ".cocijax.lock"


class DirectoryLock:
    """An exclusive, non-blocking ``flock`` on ``directory/.cocijax.lock``.

    The kernel drops the lock when the process dies, so a crashed writer never leaves the
    directory locked. Two managers in one process conflict too (each opens its own file).

    The holder writes who it is (process, host, since when) into the lock file once it has the
    lock, so that a refused writer can be told whom to look for. That record is information
    only: the ``flock`` alone decides, and a record left by a writer that died never blocks
    anyone (the next holder overwrites it).

    Example:
      >>> import tempfile
      >>> lock = DirectoryLock(Path(tempfile.mkdtemp()))
      >>> lock.acquire()
      >>> DirectoryLock(lock.path.parent).acquire()
      Traceback (most recent call last):
      ...
      cocijax.core._contract.DirectoryLockedError: directory: ... is open for writing by ...
      >>> lock.release()
    """

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock and records this process as its holder.

        Raises:
          DirectoryLockedError: another writer holds it (named when it recorded itself).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = _describe_holder(fd)
            finally:
                os.close(fd)
            raise DirectoryLockedError(
                f"directory: {self.path.parent} is open for writing by another "
                f"CheckpointManager: {holder} (lock {self.path}). Close that one first, or "
                "open this one with read_only options."
            ) from None
        self._fd = fd
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        # Information only: if it cannot be written, a refused writer is told so.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        """Releases the lock (no-op if not held); closing the descriptor releases it anyway."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # the record names a holder only while it holds the lock
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def _describe_holder(fd: int) -> str:
    """``process 1234 on host node7 since 2025-01-31T12:00:00+00:00``, from the record the
    holder wrote into the lock file open as ``fd``."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        pid, host = int(record["pid"]), str(record["host"])
        since = datetime.datetime.fromtimestamp(float(record["since"])).astimezone()
    except (OSError, ValueError, TypeError, KeyError, OverflowError):
        # Not yet written (the holder has just taken the lock), or written by an older cocijax.
        return "a process that did not record itself"
    when = since.isoformat(timespec="seconds")
    this = " (this process)" if pid == os.getpid() and host == socket.gethostname() else ""
    return f"process {pid}{this} on host {host} since {when}"
