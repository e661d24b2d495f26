"""The disk copy of a persisted save with a memory tier: one host snapshot per save.

With ``memory=``, a persisted save (level 2) is saved into the memory tier only, which costs
the training thread one host snapshot of the device arrays. Once that memory step commits, a
thread of this module copies it to the disk directory in the disk's format (the state item
through :func:`cocijax.storage.copy_item`, every checksum verified, as the durable tier drains,
its pieces striped over the external roots as a save stripes them; the other files byte for
byte), then commits it as Orbax does: the copy is written under a temporary name of its own
(with Orbax's ``.orbax-checkpoint-tmp`` mark, which garbage collection removes), fsynced, and
renamed into place, so a step is listed on the disk only once its copy is whole and durable.

**Nothing lost.** Before the copy starts, a marker ``.cocijax-to-disk-<step>`` is written in
the memory folder; it is removed once the disk copy committed. A process killed during the copy
leaves the memory copy (restorable) and the marker: the next opening copies the step again (the
temporary folder is garbage). The copy only reads the memory step, so a failed copy (a full
disk, a root failing) leaves it intact; its error is raised by the manager's next wait.

**Kept until copied.** A persisted step whose copy failed stays in the memory tier (beyond its
two slots) until its copy commits: the copy of the next persisted step copies it first, and an
opening copies what is left.

**One at a time.** The manager waits for the copy in flight before it starts another one, and
before a memory save that would delete the step being copied (the memory tier's two slots);
that wait is billed to the save that waits (see ``_saving.write_step``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cocijax import storage
from cocijax._files import fsync_dir, fsync_file, remove_tree
from cocijax.manager._directory import STATE_ITEM, TMP_MARK, is_committed
from cocijax.manager._faults import naming
from cocijax.storage._records import MANIFEST_NAME, STRIPE_PREFIX

__all__ = ["PENDING_PREFIX", "DiskCopy", "DiskCopyStalledError"]

log = logging.getLogger(__name__)

# ``<memory folder>/.cocijax-to-disk-<step>``: a persisted step whose disk copy has not
# committed (a hidden name: the tier's listing skips it).
PENDING_PREFIX = ".cocijax-to-disk-"
# How often the copy looks for the memory commit of its step (one stat).
_POLL_S = 0.005


class DiskCopyStalledError(TimeoutError):
    """The disk copy of a persisted step made no progress within the manager's bound."""


class DiskCopy:
    """Copies persisted steps from the memory tier to the disk, in a thread, one at a time.

    Args:
      memory: the memory tier's folder (the job's namespace folder).
      directory: the checkpoint directory.
      step_name: the name of a step's directory (Orbax's step name format).
      roots: the directory's stripe folders on its external roots, where the state's pieces
        go as a save stripes them (none: inside the step directory).
      timeout_s: :meth:`wait` gives up on a copy that made no progress for this long
        (``None``: waits for ever).
      memory_bytes: host buffers kept between copies (see :class:`cocijax.storage.BufferPool`).
    """

    def __init__(
        self,
        memory: Path,
        directory: Path,
        step_name: Callable[[int], str],
        *,
        roots: Sequence[Path | storage.KvPath] = (),
        timeout_s: float | None,
        memory_bytes: int = 512 << 20,
    ):
        self._memory = memory
        self._directory = directory
        self._step_name = step_name
        self._roots = tuple(roots)
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._step: int | None = None  # handed over and not finished
        self._memory_settled = True  # the manager waited for the memory save of _step
        self._committed: list[int] = []  # copies committed, not yet taken by the manager
        self._error: BaseException | None = None
        self._abandoned = False  # close() gave up on the copy: it must commit nothing
        self._progress_at = time.monotonic()
        self._buffers = storage.BufferPool(memory_bytes)

    @property
    def step(self) -> int | None:
        """The step being copied (or waiting for its memory commit), or None."""
        with self._cond:
            return self._step

    def pending(self) -> list[int]:
        """Steps whose disk copy has not committed (a marker in the memory folder), oldest first."""
        names = [p.name[len(PENDING_PREFIX) :] for p in self._memory.glob(f"{PENDING_PREFIX}*")]
        return sorted(int(n) for n in names if n.isdigit())

    def mark(self, step: int) -> None:
        """Records that ``step`` is to be copied: call before its memory save starts, so that
        no kill can leave it committed in memory and not known to be persisted."""
        self._marker(step).touch()

    def start(self, step: int) -> None:
        """Copies ``step`` (marked by :meth:`mark`) once its memory save commits (call after
        that save started, and after :meth:`wait` for the previous copy)."""
        with self._cond:
            assert self._step is None, "a disk copy is still in flight"
            self._step, self._memory_settled = step, False
            self._touch()
        threading.Thread(
            target=self._run, args=(step,), name=f"cocijax-disk-copy-{step}", daemon=True
        ).start()

    def memory_settled(self) -> None:
        """The manager waited for the memory save: a step not committed by now never will be."""
        with self._cond:
            self._memory_settled = True
            self._touch()
            self._cond.notify_all()

    def take_committed(self) -> list[int]:
        """The steps whose copy committed since the last call."""
        with self._cond:
            steps, self._committed = self._committed, []
        return steps

    def wait(self, *, block: bool = True) -> None:
        """Waits for the copy in flight (``block``), then raises the error of a copy that
        failed, once.

        Raises:
          DiskCopyStalledError: the copy made no progress for ``timeout_s`` (it goes on).
          Exception: the copy failed (its error, naming a path; the memory copy is intact).
        """
        with self._cond:
            while block and self._step is not None:
                left = None
                if self._timeout_s is not None:
                    left = self._progress_at + self._timeout_s - time.monotonic()
                    if left <= 0:
                        raise DiskCopyStalledError(
                            f"the disk copy of step {self._step} from {self._memory} to "
                            f"{self._directory} made no progress for {self._timeout_s:g} s "
                            "(store_timeout_s): the disk does not answer. The memory copy of "
                            "the step is intact and restorable; the copy goes on in the "
                            "background, and a later opening finishes it."
                        )
                self._cond.wait(left)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def finish_pending(self) -> None:
        """Copies, now, the persisted steps a previous run left uncopied (the opening).

        A step whose memory copy is gone or never committed is forgotten (its marker removed);
        a copy that fails is logged: the memory copy stays, and the next opening tries again.
        """
        for step in self.pending():
            if not is_committed(self._memory / str(step)):
                self._marker(step).unlink(missing_ok=True)
                continue
            log.info("%s: step %d persisted, not on disk yet: copying it", self._directory, step)
            try:
                self._copy(step)
            except Exception as e:
                log.error(
                    "%s: the disk copy of step %d failed (%s): in memory only, tried again "
                    "at the next opening",
                    self._directory,
                    step,
                    e,
                )
            else:
                with self._cond:
                    self._committed.append(step)

    def close(self) -> None:
        """Waits for the copy in flight (bounded as :meth:`wait`); a stalled one is abandoned
        (it commits nothing; the next opening copies the step again).

        Raises:
          Exception: as :meth:`wait`.
        """
        try:
            self.wait()
        except DiskCopyStalledError:
            with self._cond:
                self._abandoned = True
            raise
        finally:
            self._buffers.clear()

    # -- the copy thread ----------------------------------------------------------------------

    def _marker(self, step: int) -> Path:
        return self._memory / f"{PENDING_PREFIX}{step}"

    def _touch(self) -> None:
        self._progress_at = time.monotonic()

    def _run(self, step: int) -> None:
        try:
            if self._wait_for_memory_commit(step):
                # First the older persisted steps whose copy failed (kept in memory for it).
                for older in [s for s in self.pending() if s < step]:
                    if is_committed(self._memory / str(older)):
                        self._copy(older)
                        with self._cond:
                            self._committed.append(older)
                self._copy(step)
                with self._cond:
                    self._committed.append(step)
            else:
                log.info("%s: step %d never committed in memory: not copied", self._memory, step)
                self._marker(step).unlink(missing_ok=True)
        except BaseException as e:  # the manager's next wait raises it
            e.add_note(
                f"while copying step {step} from the memory tier {self._memory} to "
                f"{self._directory}; the memory copy is intact"
            )
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._step = None
                self._cond.notify_all()

    def _wait_for_memory_commit(self, step: int) -> bool:
        manifest = self._memory / str(step) / STATE_ITEM / MANIFEST_NAME
        with self._cond:
            while not manifest.exists():
                if self._memory_settled and not manifest.exists():
                    return False
                self._cond.wait(_POLL_S)
        return True

    def _copy(self, step: int) -> None:
        """Copies the committed memory ``step`` to the disk and commits it there (a rename)."""
        source = self._memory / str(step)
        final = self._directory / self._step_name(step)
        # A step directory appears whole (a rename); not is_committed, which the opening
        # caches: this one's answer changes below.
        if not final.exists():
            # A name of this copy's own: an abandoned copy may still write to its own.
            tmp = final.with_name(f"{final.name}{TMP_MARK}-copy-{os.urandom(4).hex()}")
            try:
                with naming(final, (self._directory, self._memory)):
                    self._copy_into(source, tmp)
                    if self._abandoned:
                        raise DiskCopyStalledError(f"step {step}: abandoned by close()")
                    os.rename(tmp, final)
                    fsync_dir(self._directory)
            except BaseException:
                with contextlib.suppress(OSError):
                    remove_tree(tmp)
                raise
        self._marker(step).unlink(missing_ok=True)

    def _copy_into(self, source: Path, dest: Path) -> None:
        copied = []
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(source)
            if rel.parts[0] == STATE_ITEM and (
                rel.parts[1].startswith(STRIPE_PREFIX) or rel.name == MANIFEST_NAME
            ):
                continue  # the state's pieces and manifest: copy_item's, manifest last
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / rel)
            copied.append(dest / rel)
        # Durable before the commit, as Orbax's save makes them (copy_item syncs the pieces).
        for path in copied:
            fsync_file(path)
        for folder in {p.parent for p in copied} | {dest}:
            fsync_dir(folder)
        self._touch()
        storage.copy_item(
            source / STATE_ITEM,
            dest / STATE_ITEM,
            buffers=self._buffers,
            progress=self._touch,
            dest_roots=self._roots or None,
        )
