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
  by name, from each manifest's raw bytes, damaged ones included).

Finding the garbage is quick and happens while no save is in flight (:func:`collect_garbage`);
removing it is slow and happens in a thread of its own (:class:`Remover`) once the save that
followed has committed, so neither training nor the next save waits for a deletion.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, final

from cocijax import _files, storage
from cocijax.manager._directory import STATE_ITEM, STEP_RE, TMP_MARK, TRASH_DIR

__all__ = [
    "QUARANTINE_DIR",
    "QUARANTINE_KEEP",
    "WAITING_BATCHES",
    "Remover",
    "collect_garbage",
    "quarantine",
]

log = logging.getLogger(__name__)

QUARANTINE_DIR = ".cocijax-quarantine"
# Damaged steps kept for inspection: enough to look at what went wrong, and bounded, since with
# the data inside the step directories each one holds a whole state.
QUARANTINE_KEEP = 2
_REASON = "cocijax-quarantine.txt"

# How many collections' garbage (the newest) may wait for the save in flight. Each may hold a
# dropped step: with saves back to back, the disk holds this many dropped steps besides what
# retention keeps, and a removal still runs beside each write.
WAITING_BATCHES = 1

# How often a deferred removal asks whether the save in flight has committed: the question
# takes a lock and reads a flag, and a removal starting this late still has the time
# between saves.
_POLL_S = 0.02


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


def collect_garbage(directory: Path, stripe_roots: Sequence[Path | storage.KvPath]) -> list[Any]:
    """Sets aside what the directory no longer needs and says what to remove (see the module).

    This part is quick (renames, a listing, the manifests' bytes); the removal itself, the
    slow part (a whole state per dropped step, every object of a prefix on an object store),
    is the caller's, off the training thread (:class:`Remover`).

    Call it only on the primary process and only while no save is in flight (the caller has
    waited), so that the only unreferenced stripes are those of deleted steps and of crashed or
    failed saves. Steps are read from disk, not from Orbax's cache, so a committed step's data
    is never removed even if another tool listed it differently; while the references of some
    step cannot be read now (an I/O error), no stripe is removed.

    Args:
      directory: the checkpoint directory.
      stripe_roots: this directory's stripe folders on the external roots (may be empty).

    Returns:
      What to remove: entries of the trash, and unreferenced stripe directories. All of them
      are out of sight already (no listed step references them) and are never reused.
    """
    trash = directory / TRASH_DIR
    # Names, not paths: with thousands of steps kept, sorting every entry's path cost more
    # than the rest of the collection.
    for name in sorted(name for name in _names(directory) if TMP_MARK in name):
        log.info("removing %s, left by a save that did not commit", directory / name)
        _files.move_aside(directory / name, trash)
    quarantined = sorted(_entries(directory / QUARANTINE_DIR), key=os.path.getmtime)
    for entry in quarantined[: max(len(quarantined) - QUARANTINE_KEEP, 0)]:
        log.info("deleting %s: newer damaged steps are kept for inspection", entry)
        _files.move_aside(entry, trash)
    garbage: list[Any] = _entries(trash)
    if not stripe_roots:
        return garbage
    # The renames into the trash were not synced: make them durable before their stripes go,
    # or after a power loss a step could be listed again without its data (found by
    # tests/reliability/test_power_loss.py).
    _files.fsync_dir(directory)
    steps, quarantined = _listing(directory), _listing(directory / QUARANTINE_DIR)
    if steps is None or quarantined is None:
        return garbage  # which steps exist is unknown now: every stripe may be referenced
    items = [e / STATE_ITEM for e in steps if STEP_RE.match(e.name)]
    items += [e / STATE_ITEM for e in quarantined]
    stripes = storage.unreferenced_stripe_dirs(stripe_roots, items)
    if stripes is None:
        return garbage  # some step's references cannot be read now: removing any could lose
    return garbage + stripes


@final
class Remover:
    """Removes what :func:`collect_garbage` found, in a thread of its own, between saves.

    Training does not wait for a deletion (a dropped step of the data inside its directory
    is a whole state; on an object store, a request per object). What it is given is out of
    sight already, so removing it races nothing; a crash in the middle leaves it where the
    next collection finds it again. A removal that fails is logged and tried again then.

    Nor does the next save, where it can be helped: garbage is found when a save starts (no
    other save is in flight then), and removing it while that save wrote slowed the write,
    which the following save waits for (the file system's share of a deletion runs in kernel
    threads, beyond this thread's nice value; an object store serves the deletions beside the
    write's requests). So the newest batches (one :meth:`remove` call each, see
    :data:`WAITING_BATCHES`) wait while ``writing()`` says a save is in flight, or while one
    starts (:meth:`starting_save`), and are removed once it has committed, in the time between
    saves; a local tree stops between two files when a write starts. The wait is bounded:
    older batches (saves back to back, never a moment between them) are removed at once, and
    so is everything once :meth:`wait` is called.
    """

    def __init__(self, writing: Callable[[], bool] = lambda: False) -> None:
        """Args:
        writing: whether a save is in flight now (called from the remover's thread; it must
          be cheap and thread-safe). The default never defers.
        """
        self._writing = writing
        self._cond = threading.Condition()
        self._queue: list[tuple[Any, int]] = []  # (path, batch)
        self._batch = 0  # the newest batch; it and the WAITING_BATCHES - 1 before it yield
        self._waiters = 0  # callers of wait(): then nothing yields
        self._starting = 0  # saves starting (starting_save): the newest batches wait
        self._busy = False
        self._thread: threading.Thread | None = None

    def remove(self, paths: Sequence[Any]) -> None:
        """Queues ``paths`` (local directories or object-store prefixes) for removal."""
        with self._cond:
            queued = [p for p, _ in self._queue]
            paths = [p for p in paths if p not in queued]
            if not paths:
                return
            self._batch += 1
            self._queue.extend((p, self._batch) for p in paths)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="cocijax-remover", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    @contextlib.contextmanager
    def starting_save(self) -> Iterator[None]:
        """Holds the newest batches while a save starts: its garbage is found (no save in
        flight then) before its write is, and nothing of it is removed in between."""
        with self._cond:
            self._starting += 1
        try:
            yield
        finally:
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Removes everything queued now (nothing yields to a save) and blocks until it is
        removed; False if ``timeout_s`` ran out first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._waiters += 1
            self._cond.notify_all()
            try:
                while self._queue or self._busy:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._waiters -= 1
        return True

    def _run(self) -> None:
        _yield_to_training()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                (path, batch), self._busy = self._queue.pop(0), True
            try:
                _remove(path, functools.partial(self._yield_to_save, batch))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _yield_to_save(self, batch: int) -> None:
        """Returns once no save is in flight, or once ``batch`` may not wait any more (newer
        batches came, or someone waits for the removals)."""
        while True:
            with self._cond:
                if self._batch - batch >= WAITING_BATCHES or self._waiters:
                    return
                starting = self._starting > 0
            # Asked without the lock: the answer takes the manager's own locks.
            if not starting and not self._save_in_flight():
                return
            with self._cond:
                self._cond.wait(_POLL_S)  # remove() and wait() wake it early

    def _save_in_flight(self) -> bool:
        try:
            return bool(self._writing())
        except Exception as e:  # a closed manager, say: removing cannot wait on it
            log.debug("cannot tell whether a save is in flight (%s): removing", e)
            return False


def _yield_to_training() -> None:
    """Lowers the calling thread's CPU priority to the lowest (nice 19), where the OS can.

    Removing a dropped step (unlinking its files, or the object store's requests) needs some
    CPU, which training and a save need more on a small machine. Linux keeps a nice value per
    thread, so only this thread yields; elsewhere nothing changes.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _remove(path: Any, pause: Callable[[], None]) -> None:
    """Removes ``path``, calling ``pause`` first (and, for a local tree, before each file and
    before the fsync of the folder that held it)."""
    try:
        pause()
        if isinstance(path, storage.KvPath):
            path.delete_all()
        else:
            _remove_local(Path(path), pause)
    except (OSError, ValueError) as e:  # out of sight: nothing lost; found again next time
        log.warning("cannot remove %s (%s); trying again at the next collection", path, e)
        return
    log.debug("removed %s", path)
    if not isinstance(path, storage.KvPath):
        # The file system's share of the deletion (its journal commit, and the discards of the
        # freed blocks on a file system mounted with ``discard``) waits for the next fsync,
        # which was the next save's: paid here instead, while no save is in flight.
        pause()
        try:
            _files.fsync_dir(Path(path).parent)
        except OSError as e:  # removed all the same; durable with the next commit
            log.debug("cannot fsync %s after a removal (%s)", Path(path).parent, e)


def _remove_local(path: Path, pause: Callable[[], None]) -> None:
    """Removes a local tree file by file, deepest first, with ``pause`` before each file.

    Raises:
      OSError: an entry could not be removed (names it); one already gone is fine.
    """
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for folder, dirs, files in os.walk(path, topdown=False, onerror=_raise_unless_gone):
        for name in files:
            pause()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))
        for name in dirs:  # empty by now, or a symbolic link (never followed)
            entry = os.path.join(folder, name)
            with contextlib.suppress(FileNotFoundError):
                if os.path.islink(entry):
                    os.unlink(entry)
                else:
                    os.rmdir(entry)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def _raise_unless_gone(error: OSError) -> None:
    if not isinstance(error, FileNotFoundError):
        raise error


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except FileNotFoundError:
        return []


def _listing(folder: Path) -> list[Path] | None:
    """The entries of ``folder`` ([] when it does not exist), or None when it cannot be listed.

    A listing that fails with ENOENT although the folder is there (an I/O fault; libfiu injects
    it) is not an empty folder: taken for one, every stripe of the steps in it was garbage.
    """
    try:
        return sorted(folder.iterdir())
    except FileNotFoundError:
        if not os.path.lexists(folder):
            return []
        log.warning("cannot list %s: keeping every stripe for now", folder)
    except OSError as e:
        log.warning("cannot list %s (%s): keeping every stripe for now", folder, e)
    return None
