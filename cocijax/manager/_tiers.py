"""The durable tier of :class:`cocijax.CheckpointManager`: committed steps drained behind.

Multi-level checkpointing (LLNL's SCR; Orbax's emergency checkpoint manager): a save commits to
the fast local tier as before, then a background thread copies the committed step to durable
storage (an object store through TensorStore, ``s3://bucket/run``, ``gs://...``, or a path on a
shared file system), one prefix per step (``_tier_layout``).

Only what an object store promises is assumed: a PUT makes one whole object appear; there is
no rename, no fsync, no directory. So a step is committed on the durable tier when its state
manifest exists, and that object is written after every other object of the step was written
and the pieces' listing checked. Deleting a step removes its manifest first, so a step is never
listed without its data.

**One writer.** The drain thread holds the tier's lease (``_tier_lease``) before it writes or
deletes anything, and reads it again before each commit. Nothing is ever deleted that holds a
manifest, except by retention (``durable_max_to_keep``, the newest never) or ``delete``. A step
already committed by another writer is never replaced: its drain is skipped, logged at ERROR.
A drain that fails removes its own uncommitted prefix at once (a full store that empties
again costs that drain, not every later one); errors that may pass are retried with backoff.

**Host-local processes** (``DurableOptions.process``): every process drains its own shards and
its manifest part into the step's prefix; process 0 alone holds the lease, commits the step
once every part is there (``_tier_drain``) and deletes. Its garbage collection leaves the
uncommitted prefixes newer than the newest committed step: other processes may still drain.

**Unknown is not empty.** A tier that cannot be listed when the manager opens raises
:class:`DurableTierError`: its steps may be newer than the local ones. Afterwards a failed
listing keeps the last one (a bucket that is gone lists as empty), a drain that fails lists the
tier again, and a read of a step that is no longer there lists it again.

**Bounded waits.** Each request of the tier's own waits at most ``timeout_s``; ``close`` and
``wait`` give up on a drain that made no progress (no object written) for ``timeout_s``,
saying which step is abandoned (it stays on the local tier).

The drain never stalls training: ``save`` only hands the step over (:meth:`DurableTier.offer`).
One step is drained at a time; when more steps commit while a drain runs, only the newest is
drained next (the skipped ones are logged and counted in :attr:`DurableTier.skipped`). The step
being drained and the one waiting are *pinned*: local retention does not delete them.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from cocijax import storage
from cocijax.manager._directory import STATE_ITEM
from cocijax.manager._tier_drain import drain_with_retries
from cocijax.manager._tier_layout import (
    COMMIT_KEY,
    scan,
    scan_within,
)
from cocijax.manager._tier_lease import Lease, LeaseError
from cocijax.manager._tier_options import DurableOptions, DurableTierError, check_durable_args
from cocijax.manager._tier_read import restore_step
from cocijax.storage._kvpath import describe_error, is_missing_bucket
from cocijax.storage._records import MANIFEST_NAME

__all__ = ["DurableOptions", "DurableTier", "DurableTierError", "open_durable"]

log = logging.getLogger(__name__)

# How often the drain thread looks for the local commit of the step it waits for (one stat).
_POLL_S = 0.005


class DurableTier:
    """The durable copy of a checkpoint directory, and the thread that drains steps to it.

    Args:
      where: an object-store URL (``s3://bucket/run42``, ``gs://...``) or a path.
      options: how it is used (see :class:`DurableOptions`).
    """

    def __init__(self, where: str | os.PathLike, options: DurableOptions):
        self.root = storage.KvPath.parse(where, options.store_options)
        self.root = self.root.with_timeout(options.timeout_s)
        self.options = options
        self._lease = Lease(
            self.root,
            owner=options.owner,
            directory=str(options.local),
            duration_s=options.lease_duration_s,
        )
        self._cond = threading.Condition()
        self._steps: set[int] = set()  # committed durable steps, as last listed or drained
        self._offered: int | None = None  # the newest step waiting to be drained
        self._draining: int | None = None
        self._local_settled = True  # no local save in flight (the manager waited for it)
        self._since_offer = 0  # commits since the last offered one (durable_every)
        self._errors: list[DurableTierError] = []
        self._progress_at = time.monotonic()  # the drain's last sign of life
        self._abandoned = False  # close() gave up on the drain: it must commit nothing
        self.run = ""  # host-local: the job's run, which names each manifest part (share_run)
        self.skipped: list[int] = []
        self.drain_s = math.nan
        self._closed = False
        self._thread: threading.Thread | None = None
        # The drains' host buffers, kept from one drain to the next (see storage.BufferPool).
        self._buffers = storage.BufferPool(options.memory_bytes)

    @property
    def url(self) -> str:
        return self.root.url

    # -- listing ----------------------------------------------------------------------------

    def open(self, local_newest: int | None) -> None:
        """Lists the tier and, as the writer, drains the newest local step if it is newer.

        A previous run killed during a drain left the newest local step undrained (and maybe
        a prefix without a manifest, which that drain removes first).

        Raises:
          DurableTierError: the tier cannot be listed (or, as the writer, written) within
            ``timeout_s``: its steps may be newer than the local ones (names the URL, the
            cause and what to do).
        """
        self._steps = set(self._list_at_open(local_newest))
        if not self.options.writer:
            return
        self._thread = threading.Thread(target=self._run, name="cocijax-drain", daemon=True)
        self._thread.start()
        newest = max(self._steps, default=None)
        if local_newest is not None and (newest is None or local_newest > newest):
            log.info(
                "%s: step %d is not on the durable tier yet: draining it", self.url, local_newest
            )
            self.offer(local_newest, force=True)

    def share_run(self, run: str) -> None:
        """Host-local: takes the job's run, one name every process agreed on at opening. Each
        process's manifest part of a step is named by it, so process 0 commits a step from
        this run's parts only, never with a part an earlier run of the job left there (its
        process 0 killed before the commit, the leftovers not removed: see ``_tier_drain``)."""
        self.run = run

    def _list_at_open(self, local_newest: int | None) -> list[int]:
        timeout = self.options.timeout_s
        try:
            return scan_within(self.root, timeout, writable=self.options.writer)
        except (ValueError, OSError) as e:
            raise DurableTierError(
                f"durable={self.url!r}: the durable tier cannot be "
                f"{'listed or written' if self.options.writer else 'listed'} "
                f"({describe_error(e)}). Its steps may be newer than the local ones in "
                f"{self.options.local} (newest local step: {local_newest}), so the manager does "
                "not open on the local steps alone. Fix the endpoint, bucket or credentials "
                "(durable_options) and open again"
                + (f", or raise store_timeout_s (now {timeout:g} s)" if timeout else "")
                + "; to go on from the local steps only, open without durable=."
            ) from e

    def refresh(self) -> list[int]:
        """Lists the committed steps on the durable tier again (a LIST of its objects).

        A bucket that no longer exists lists as empty.

        Raises:
          ValueError, OSError: the tier cannot be listed (the last listing is kept).
        """
        try:
            committed = scan(self.root)[0]
        except (ValueError, OSError) as e:
            if not is_missing_bucket(e):
                raise
            log.error("%s: the bucket is gone: the durable tier holds no step now", self.url)
            committed = []
        with self._cond:
            self._steps = set(committed)
        return committed

    def _refresh_quietly(self, why: str) -> None:
        try:
            self.refresh()
        except (ValueError, OSError) as e:
            log.warning("%s: cannot list the durable tier after %s (%s)", self.url, why, e)

    def refreshed_steps(self) -> list[int]:
        """:meth:`steps` listed again (the last listing when the tier cannot be listed now)."""
        self._refresh_quietly("a step was asked for that it did not list")
        return self.steps()

    def steps(self) -> list[int]:
        """The steps committed on the durable tier, oldest first (as last listed or drained)."""
        with self._cond:
            return sorted(self._steps)

    def vanished(self, step: int) -> bool:
        """Whether a listed step is no longer committed (deleted by the writer, or the store
        lost it): then the tier is listed again. ``False`` when the store cannot tell."""
        try:
            gone = (self.root / str(step) / COMMIT_KEY).read_bytes() is None
        except (ValueError, OSError):
            return False
        if gone:
            self._refresh_quietly(f"step {step} vanished")
            with self._cond:
                self._steps.discard(step)
        return gone

    def pinned(self) -> set[int]:
        """Steps local retention must keep for now: the one being drained and the next."""
        with self._cond:
            return {s for s in (self._offered, self._draining) if s is not None}

    # -- draining ---------------------------------------------------------------------------

    def offer(self, step: int, *, force: bool = False) -> None:
        """Hands over a step whose local save has started; it is drained once committed.

        Every ``every``-th offered step is taken (``force``: this one whatever the count). A
        step still waiting when a newer one is taken is skipped: only the newest is drained.
        """
        if not self.options.writer:
            return
        with self._cond:
            self._local_settled = False
            self._since_offer += 1
            if not force and self._since_offer < self.options.every:
                return
            self._since_offer = 0
            if self._offered is not None:
                self.skipped.append(self._offered)
                log.info(
                    "%s: step %d skipped: step %d committed while a drain ran",
                    self.url,
                    self._offered,
                    step,
                )
            self._offered = step
            self._cond.notify_all()

    def settle(self) -> None:
        """The manager waited for its local save: a step not committed by now never will be."""
        with self._cond:
            self._local_settled = True
            self._cond.notify_all()

    def _touch(self) -> None:
        self._progress_at = time.monotonic()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._offered is None and not self._closed:
                    self._cond.wait()
                if self._offered is None or self._abandoned:
                    return
                step, self._offered, self._draining = self._offered, None, self._offered
                self._touch()
            try:
                if self._wait_for_local_commit(step):
                    drain_with_retries(self, step)
                    self._collect_after_drain()
            except Exception as e:  # any failure is this step's: reported, training goes on
                error = DurableTierError(
                    f"drain of step {step} to {self.root / str(step)} failed: {e}"
                )
                error.__cause__ = e
                log.error("%s", error)
                with self._cond:
                    self._errors.append(error)
                self._refresh_quietly("a failed drain")
            finally:
                with self._cond:
                    self._draining = None
                    self._cond.notify_all()

    def _local_step(self, step: int) -> Path:
        return self.options.local / self.options.step_name(step)

    def _wait_for_local_commit(self, step: int) -> bool:
        """Waits until Orbax renamed the step into place (its manifest is then there)."""
        manifest = self._local_step(step) / STATE_ITEM / MANIFEST_NAME
        while not manifest.exists():
            with self._cond:
                if self._local_settled and not manifest.exists():
                    log.info("%s: step %d never committed locally: not drained", self.url, step)
                    return False
                self._cond.wait(_POLL_S)
        return True

    def wait(self, *, raise_errors: bool) -> int | None:
        """Blocks until no step waits or drains, or the drain made no progress for
        ``timeout_s``; then raises the first drain error, if asked (otherwise the errors are
        kept for the next call that asks).

        Returns:
          The step whose drain stalled (``None``: every drain ended).

        Raises:
          DurableTierError: a drain failed since the errors were last raised (the others are
            in its notes), or, with ``raise_errors``, the drain stalled.
        """
        stalled = self._wait_idle()
        if stalled is not None:
            if raise_errors:
                raise DurableTierError(
                    f"{self.url}: the drain of step {stalled} made no progress for "
                    f"{self.options.timeout_s:g} s (store_timeout_s): the store does not "
                    "answer, or the drain waits for another writer's lease (see the log); it "
                    "goes on in the background."
                )
            return stalled
        if raise_errors:
            with self._cond:
                errors, self._errors = self._errors, []
            if errors:
                first = errors[0]
                for other in errors[1:]:
                    first.add_note(f"also: {other}")
                raise first
        return None

    def _wait_idle(self) -> int | None:
        timeout = self.options.timeout_s
        with self._cond:
            while self._offered is not None or self._draining is not None:
                if timeout is None:
                    self._cond.wait()
                    continue
                left = self._progress_at + timeout - time.monotonic()
                if left <= 0:
                    return self._draining if self._draining is not None else self._offered
                self._cond.wait(left)
        return None

    def close(self) -> None:
        """Finishes the drain in progress and the waiting one, then stops the thread.

        A drain that makes no progress for ``timeout_s`` is abandoned (logged, naming the
        steps not drained): it commits nothing, and the lease is left to expire.
        """
        if self._thread is None:
            return
        self.settle()
        stalled = self.wait(raise_errors=False)
        with self._cond:
            if stalled is not None:
                self._abandoned = True
                left = sorted({s for s in (self._draining, self._offered) if s is not None})
                self._offered = None
            self._closed = True
            self._cond.notify_all()
        if stalled is not None:
            log.warning(
                "%s: close(): abandoning the drain of step(s) %s: no progress for %g s "
                "(store_timeout_s). Not on the durable tier; still in %s.",
                self.url,
                left,
                self.options.timeout_s,
                self.options.local,
            )
            self._lease.release(delete=False)  # expires by itself: the drain may still write
            return
        self._thread.join()
        self._thread = None
        self._lease.release()
        self._buffers.clear()

    # -- garbage collection and deletion ------------------------------------------------------

    def _collect_after_drain(self) -> None:
        # A failed collection is not the drained step's failure: said, and tried again later.
        try:
            self.collect_garbage()
        except (ValueError, OSError, LeaseError) as e:
            log.warning("%s: garbage collection failed (%s); will try again", self.url, e)

    def collect_garbage(self) -> None:
        """Deletes committed steps beyond ``max_to_keep`` (never the newest) and the prefixes of
        drains that never committed (except the one in progress); only as the lease holder."""
        if not self.options.committer or not self._lease.held:
            return
        committed, incomplete = scan(self.root)
        with self._cond:
            busy = {self._draining, self._offered}
            self._steps = set(committed)
        if self.options.process is not None:
            # Host-local: the other processes may still drain their parts of newer steps.
            busy |= {s for s in incomplete if s > max(committed, default=-1)}
        for step in incomplete:
            if step not in busy:
                log.info(
                    "%s: removing step %d, never committed (an interrupted drain)", self.url, step
                )
                self._lease.check(margin_s=0)
                (self.root / str(step)).delete_all()
        if self.options.max_to_keep is not None:
            for step in committed[: -max(self.options.max_to_keep, 1)]:
                self.delete(step)

    def remove_unfinished(self, after: int) -> None:
        """Removes the objects of the steps newer than ``after`` that were never committed (the
        drains of a host-local job that some process never finished), as the committer.

        Call at opening, once every process agreed that the job resumes at step ``after``: no
        process drains such a step again before the job saves it again. A failure (the store,
        or another writer's lease) is logged, not raised: the drain of that step number keeps
        only this run's parts (see ``_tier_drain``).
        """
        if not self.options.committer:
            return
        try:
            unfinished = [s for s in scan(self.root)[1] if s > after]
            if unfinished:
                self._lease.acquire(0)
            for step in unfinished:
                log.info("%s: removing the uncommitted parts of step %d", self.url, step)
                (self.root / str(step)).delete_all()
        except (ValueError, OSError, LeaseError) as e:
            log.warning("%s: cannot remove uncommitted steps yet (%s)", self.url, e)

    def delete(self, step: int) -> None:
        """Deletes a durable step: its manifest first, so it is never listed without its data.

        Host-local, the shared step is deleted by process 0 only (every process of the job
        calls ``delete`` alike).

        Raises:
          DurableTierError: another writer holds the tier's lease.
        """
        if self.options.process not in (None, 0):
            return
        try:
            self._lease.acquire(0)
        except LeaseError as e:
            raise DurableTierError(f"cannot delete step {step}: {e}") from e
        prefix = self.root / str(step)
        (prefix / COMMIT_KEY).delete()
        with self._cond:
            self._steps.discard(step)
        prefix.delete_all()

    # -- restoring --------------------------------------------------------------------------

    def restore(self, step: int, items: dict[str, Any]) -> Any:
        """Orbax's restore of ``items`` (a ``Composite``'s args) from the durable copy of
        ``step`` (see :func:`~cocijax.manager._tier_read.restore_step`)."""
        return restore_step(
            self.root, step, items, self.options.store_options, process=self.options.process
        )


def open_durable(
    durable: str | os.PathLike | None,
    options: dict[str, Any] | None,
    *,
    every: int,
    max_to_keep: int | None,
    timeout_s: Any = 30.0,
    **kwargs: Any,
) -> DurableTier | None:
    """The durable tier of a manager (``None`` without one), its arguments checked.

    Args:
      durable: the manager's ``durable``; ``options`` its ``durable_options``, ``every`` its
        ``durable_every``, ``max_to_keep`` its ``durable_max_to_keep`` and ``timeout_s`` its
        ``store_timeout_s``.
      **kwargs: the other :class:`DurableOptions`.

    Raises:
      TypeError, ValueError: see :func:`~cocijax.manager._tier_options.check_durable_args`;
        ValueError also for an unsupported URL scheme or options TensorStore refuses.
    """
    timeout_s = check_durable_args(durable, options, every, max_to_keep, timeout_s)
    if durable is None:
        return None
    tier = DurableOptions(
        store_options=options,
        every=every,
        max_to_keep=max_to_keep,
        timeout_s=timeout_s,
        **kwargs,
    )
    try:
        return DurableTier(durable, tier)
    except (TypeError, ValueError) as e:
        raise type(e)(f"durable={str(durable)!r}: {e}") from e
