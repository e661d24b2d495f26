"""How :class:`cocijax.CheckpointManager` saves a step, waits for it, and collects garbage.

These functions are the manager's own, kept apart for size: they take the manager first.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from cocijax import storage
from cocijax._files import move_aside
from cocijax._orbax_compat import list_steps_lightly
from cocijax.core._policy_inputs import tree_nbytes
from cocijax.core._session import run_all
from cocijax.manager._directory import (
    METRICS_ITEM,
    POLICY_ITEM,
    STATE_ITEM,
    TRASH_DIR,
    check_steps,
    is_committed,
    list_committed,
)
from cocijax.manager._faults import naming, retry_deletions, wait
from cocijax.manager._gc import collect_garbage, quarantine
from cocijax.manager._items import check_custom_metadata, check_extra
from cocijax.manager._policy_item import PolicyStateSave
from cocijax.storage._tree import check_tree

if TYPE_CHECKING:
    from cocijax.manager._checkpoint_manager import CheckpointManager

__all__ = [
    "apply_retention",
    "check_deferred",
    "close",
    "collect",
    "delete_step",
    "local_steps",
    "release",
    "settle",
    "tidy",
    "wait_for_removals",
    "wait_for_save",
    "wait_until_finished",
    "write_step",
]

log = logging.getLogger(__name__)


def write_step(
    mngr: CheckpointManager,
    step: int,
    state: Any,
    loss: Any,
    extra: Any,
    metrics: Any,
    custom_metadata: Any,
    level: int = 2,
) -> None:
    """Saves ``step`` through Orbax: the state, the policy item, metrics and extra items.

    A level-2 (persisted) save goes to the memory tier, if any, and to the disk; a level-1
    save to the memory tier only, or to the disk (not drained) without one. The blocking part
    is timed as the save's cost (per level); the policy item is written with that cost once it
    is measured. Bad input is refused before Orbax starts any background work.
    """
    # Wait for the step's own computation first: that is training time, not checkpoint cost.
    jax.block_until_ready(state)
    # Before Orbax's retention counts the steps; what an opening left, not a save's cost.
    check_deferred(mngr)
    # Reject unsupported leaves and bad items before Orbax starts its background threads:
    # an error raised inside the handler's async_save leaves Orbax threads waiting up to
    # 300 s for signals that never come, which also blocks interpreter exit.
    check_tree(state)
    items = check_extra(extra, restoring=False)
    # Warns with the user's `save` call as its place (save -> write_step -> here).
    metrics = mngr._check_metrics(metrics, step=step, stacklevel=3)
    if metrics is not None:
        items[METRICS_ITEM] = ocp.args.JsonSave(metrics)
    custom_metadata = check_custom_metadata(custom_metadata)
    memory = mngr._memory if mngr._memory is not None and mngr._memory.enabled else None
    nbytes = tree_nbytes(state) if memory is not None else 0
    if memory is not None and not memory.check_fits(nbytes):
        memory = None  # memory=True and the state does not fit: the disk only (warned)
    snapshot = mngr._driver.snapshot(loss, level)
    # The policy item's commit future writes once the cost is measured (see _policy_item);
    # it is released whatever happens here, so that no future waits for ever.
    ready = threading.Event()
    try:
        with mngr._driver.saving(level) as measured:
            settle(mngr)  # a still-running save is a real stall: timed
            to_disk = level == 2 or memory is None
            if to_disk:
                with naming(mngr._step_dir(step), mngr._paths):
                    apply_retention(mngr)
                    collect(mngr)
            if not mngr._async:
                # A synchronous Orbax save waits for every item, the policy item included,
                # so that item records the cost measured so far; the policy itself is fed
                # the whole blocking time.
                measured["cost_s"] = mngr._clock() - measured["start"]
                ready.set()

            def args() -> ocp.args.Composite:  # one policy item per tier, written alike
                item = PolicyStateSave(
                    build=lambda: mngr._driver.to_json(snapshot, cost_s=measured["cost_s"]),
                    ready=ready,
                )
                return ocp.args.Composite(
                    **{STATE_ITEM: storage.StripedSave(state), POLICY_ITEM: item, **items}
                )

            if memory is not None:  # first: what a restart after a process failure reads
                memory.save(
                    step, args(), nbytes=nbytes, metrics=metrics, custom_metadata=custom_metadata
                )
            if to_disk:
                with naming(mngr._step_dir(step), mngr._paths):
                    mngr.orbax.save(
                        step,
                        args=args(),
                        # Orbax's retention ranks its steps by the metrics it is given here (a
                        # preservation_policy's BestN); the policy item is what it reads on open.
                        metrics=metrics,
                        custom_metadata=custom_metadata,
                        force=True,
                    )
                mngr._save_started = True  # until a wait says whether it committed
            mngr._latest_saved = step
    finally:
        ready.set()


def apply_retention(mngr: CheckpointManager) -> None:
    """Deletes the committed steps best-N does not keep (every process, same decision), and
    with ``orbax_retention`` the oldest steps Orbax wrote beyond ``max_to_keep``."""
    if mngr._orbax_retention is not None and mngr._lock is not None:
        over = len(mngr._local_steps()) + len(mngr._orbax_steps) - mngr._orbax_retention
        for step in sorted(mngr._orbax_steps)[: max(over, 0)]:
            log.info("%s: deleting step %d, written by Orbax", mngr._directory, step)
            drop_orbax_step(mngr, step)
    if mngr._best is None or mngr._read_only:
        return  # max_to_keep alone is Orbax's (with the drain's steps pinned)
    keep = {mngr._preemption.step} | (mngr._durable.pinned() if mngr._durable else set())
    for step in mngr._best.drop(mngr._local_steps(), mngr.orbax.metrics, keep=keep):
        mngr.orbax.delete(step)
        mngr._committed.discard(step)


def wait_for_save(mngr: CheckpointManager) -> None:
    """Waits for the running saves (the memory tier's, then the disk's); their errors (every
    one, once) name a path."""
    run_all(
        (lambda: None) if mngr._memory is None else mngr._memory.wait,
        lambda: _wait_for_disk(mngr),
    )


def _wait_for_disk(mngr: CheckpointManager) -> None:
    started, mngr._save_started = mngr._save_started, False
    try:
        wait(mngr.orbax, mngr._step_dir(mngr._latest_saved), mngr._paths)
    except BaseException as error:
        # Orbax unlists the steps a save is to delete when the save starts, and deletes
        # them once it commits: after a failed save they are committed and on disk but not
        # listed. List them again now, not only at the next save (_collect_garbage).
        if not mngr._read_only and mngr._primary:
            try:
                retry_deletions(mngr.orbax, mngr._directory)
            except Exception as also:
                error.add_note(f"also: {type(also).__name__}: {also}")
        raise
    if started:
        # A save of this run committed, with the job's failures (on the disk: a memory
        # snapshot is not a record, the machine's loss takes it).
        mngr._history.recorded()


def collect(mngr: CheckpointManager) -> None:
    """Finds what to remove (the trash, unreferenced stripes, failed saves) and hands it to
    the remover's thread; retries failed deletions of steps."""
    if not mngr._read_only and mngr._primary:
        mngr._remover.remove(collect_garbage(mngr._directory, mngr._stripe_roots))
        if not mngr._step_format.deferred:  # else no save yet: Orbax has forgotten none
            retry_deletions(mngr.orbax, mngr._directory)


def check_deferred(mngr: CheckpointManager) -> None:
    """Checks the steps the opening left unread (``check_layout(lazy=True)``), and lists them.

    They are treated as an opening treats its steps: damaged ones set aside (the writer is
    the only one that defers), Orbax's recorded, committed ones listed by Orbax's manager, so
    that its retention counts them. Runs before anything that needs every step: a save (Orbax's
    retention), ``all_steps``, a restore of a given step or with ``fallback``, a deletion.

    Raises:
      OSError: a step cannot be read now (then nothing is changed; tried again at next need).
    """
    step_format = mngr._step_format
    if not step_format.deferred:
        return
    layout = check_steps(step_format.deferred)
    for entry, problem in layout.damaged:
        quarantine(entry, problem)
    mngr._orbax_steps.update(layout.orbax)
    mngr._committed |= {int(path.name) for path in layout.committed}
    step_format.deferred.clear()
    list_steps_lightly(mngr.orbax, sorted(mngr._committed))


def wait_for_removals(mngr: CheckpointManager) -> None:
    """Waits for the removals in flight; on an object store for ``store_timeout_s`` at most
    (what is left is removed by the next opening)."""
    remote = any(isinstance(r, storage.KvPath) for r in mngr._roots)
    if not mngr._remover.wait(mngr._store_timeout_s if remote else None):
        log.warning(
            "%s: removals of garbage on the roots still running after %g s "
            "(store_timeout_s): left to the next opening",
            mngr._directory,
            mngr._store_timeout_s,
        )


def settle(mngr: CheckpointManager) -> None:
    """Waits for the save in flight, and tells the drain there is none now."""
    wait_for_save(mngr)
    if mngr._durable is not None:
        mngr._durable.settle()


def tidy(mngr: CheckpointManager) -> None:
    """Applies retention and collects garbage (no save in flight); errors name a path."""
    with naming(mngr.directory, mngr._paths):
        apply_retention(mngr)
        collect(mngr)


def local_steps(mngr: CheckpointManager, *, every: bool = True) -> list[int]:
    """Committed steps of the local tier (the disk), oldest first.

    Without ``every``, the steps older than the newest that the opening left unread are not
    read now (nor listed); with it, they are (:func:`check_deferred`).
    """
    if every:
        check_deferred(mngr)
    if mngr._read_only:
        mngr._committed = set(list_committed(mngr._directory, frozenset(mngr._committed)))
        return sorted(mngr._committed)
    # Orbax lists a step as soon as its save starts; committed means the manifest is there.
    # A manifest, once valid, stays so: each step directory is read once.
    steps = sorted(mngr.orbax.all_steps())
    mngr._committed &= set(steps)
    for step in steps:
        if step not in mngr._committed and is_committed(
            mngr._directory / mngr._name_format.build_name(step)
        ):
            mngr._committed.add(step)
    return [step for step in steps if step in mngr._committed]


def wait_until_finished(mngr: CheckpointManager, *, durable: bool) -> None:
    """:meth:`cocijax.CheckpointManager.wait_until_finished` (see there)."""
    settle(mngr)
    try:
        if durable and mngr._durable is not None:
            mngr._durable.wait(raise_errors=True)
    finally:
        tidy(mngr)  # after the drains: best-N no longer keeps the steps they pinned
        wait_for_removals(mngr)


def delete_step(mngr: CheckpointManager, step: int) -> None:
    """:meth:`cocijax.CheckpointManager.delete` of a committed ``step``, on every tier.

    Raises:
      FileNotFoundError: ``step`` is not a committed step.
    """
    if step not in mngr.all_steps():
        raise FileNotFoundError(
            f"delete: step {step} is not a committed step in {mngr._directory} "
            f"(committed: {mngr.all_steps()})."
        )
    settle(mngr)
    if mngr._durable is not None:
        mngr._durable.wait(raise_errors=False)  # a drain of this step ends first
        if step in mngr._durable.steps():
            mngr._durable.delete(step)
    if step in mngr._local_steps():
        mngr.orbax.delete(step)
    if step in mngr.memory_steps():
        mngr._memory.delete(step)
    if step in mngr._orbax_steps:
        drop_orbax_step(mngr, step)
    mngr._committed.discard(step)
    mngr._latest_saved = mngr.latest_step()
    collect(mngr)
    wait_for_removals(mngr)  # a deletion asked for is done when delete returns


def drop_orbax_step(mngr: CheckpointManager, step: int) -> None:
    """Moves a step Orbax wrote to the trash (emptied by the next garbage collection)."""
    if mngr._lock is not None:
        move_aside(mngr._orbax_steps[step].path, mngr.directory / TRASH_DIR)
    del mngr._orbax_steps[step]


def close(mngr: CheckpointManager) -> None:
    """:meth:`cocijax.CheckpointManager.close`: each part runs whatever the others raise."""

    def finish() -> None:
        wait_for_save(mngr)  # re-raises a failed save: close all the same
        tidy(mngr)

    def close_orbax() -> None:
        with naming(mngr.directory, mngr._paths):
            mngr.orbax.close()

    def close_durable() -> None:
        if mngr._durable is not None:
            mngr._durable.close()  # the last drain ends; its errors were logged

    run_all(
        finish,
        lambda: wait_for_removals(mngr),
        close_orbax,
        close_durable,
        (lambda: None) if mngr._memory is None else mngr._memory.close,
        mngr._preemption.watcher.uninstall,
        mngr._release,
    )


def release(mngr: CheckpointManager) -> None:
    """Removes the running marker (a clean end), then releases the lock, whatever fails.

    In this order: once the lock is free another writer may open and write its own marker.
    """
    history, lock = mngr._history, mngr._lock
    run_all(
        (lambda: None) if history is None else history.close,
        (lambda: None) if lock is None else lock.release,
    )
