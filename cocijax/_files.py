"""File primitives every part of cocijax uses: durable writes, renames and removals.

One place for what a crash-safe checkpoint needs from a POSIX file system: a file or a rename is
durable only once it and its directory are fsynced (the order of ALICE's "safe rename", Pillai et
al., OSDI 2014), and a tree is removed by renaming it out of sight first, so that a crash during
the removal never leaves a listed checkpoint with half its files. Errors of ``fsync(2)`` and
``write(2)`` do not name a file: the ones raised here do. Pure Python, no JAX: the PyTorch
manager and the command line use it too.

Example:
  >>> import pathlib, tempfile
  >>> d = make_dirs(pathlib.Path(tempfile.mkdtemp()) / "a" / "b")
  >>> replace_bytes(d / "x.json", b"{}", fsync=True); fsync_dir(d)
  >>> (d / "x.json").read_bytes()
  b'{}'
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import time

__all__ = [
    "fsync_dir",
    "fsync_file",
    "make_dirs",
    "move_aside",
    "remove_tree",
    "replace_bytes",
]


def fsync_file(path: os.PathLike | str) -> None:
    """fsyncs one file; an error names it."""
    _fsync(path, os.O_RDONLY)


def fsync_dir(path: os.PathLike | str) -> None:
    """Makes the entries of directory ``path`` durable (new files, renames); errors name it."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: os.PathLike | str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, os.fspath(path)) from e
    finally:
        os.close(fd)


def make_dirs(path: os.PathLike | str) -> pathlib.Path:
    """Creates directory ``path`` and its missing parents durably; returns it.

    ``mkdir(parents=True)`` alone leaves each new name in a directory that was never synced, so
    a power loss may lose the whole tree (and everything later made durable inside it): each
    parent that gained an entry is fsynced here, deepest first.
    """
    path = pathlib.Path(path)
    created = []
    missing = path
    while not missing.exists():
        created.append(missing)
        missing = missing.parent
    path.mkdir(parents=True, exist_ok=True)
    for new in created:
        fsync_dir(new.parent)
    return path


def replace_bytes(path: pathlib.Path, data: bytes, *, fsync: bool) -> None:
    """Replaces ``path`` by ``data`` atomically (tmp file, rename): readers see all or nothing.

    ``fsync`` makes the data durable before the rename; the rename itself is durable once the
    directory is fsynced (:func:`fsync_dir`, left to the caller, who may batch it). A file that
    a later durable write supersedes needs neither.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:  # write(2) and fsync(2) errors do not name the file
        raise OSError(e.errno, e.strerror, str(tmp)) from e
    os.replace(tmp, path)


def move_aside(path: pathlib.Path, folder: pathlib.Path, *, label: str = "") -> pathlib.Path:
    """Renames ``path`` into ``folder`` (created if missing) under a name never used before.

    The rename is atomic: whoever lists ``path``'s directory sees it whole or not at all. The
    new name is ``<name>[-<label>]-<ns>``, unique even when the same name is moved twice.

    Returns:
      The new path.
    """
    folder.mkdir(exist_ok=True)
    suffix = f"-{label}" if label else ""
    target = folder / f"{path.name}{suffix}-{time.time_ns()}"
    os.rename(path, target)
    return target


def remove_tree(path: os.PathLike | str) -> None:
    """Removes a directory tree (or a file); a missing one is fine, any other error is raised.

    Meant for trees already out of sight (moved aside first): a failure leaves them there, to
    be removed again later, never a listed checkpoint with half its files.

    Raises:
      OSError: a file or directory could not be removed (names it).
    """
    path = pathlib.Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    if not path.exists():
        return

    def _raise(function, name, excinfo):
        error = excinfo if isinstance(excinfo, BaseException) else excinfo[1]
        if isinstance(error, FileNotFoundError):
            return  # removed meanwhile (another remover, or it vanished): nothing to do
        raise error

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_raise)
    else:
        shutil.rmtree(path, onerror=_raise)
