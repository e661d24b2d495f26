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
from cocijax.core._contract import check_step, check_step_order
from cocijax.core._policy_inputs import stage_loss, tree_nbytes
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
from cocijax.manager._hosts import agree_listed
from cocijax.manager._items import check_custom_metadata, check_extra
from cocijax.manager._policy_item import PolicyStateSave
from cocijax.storage._tree import check_tree

if TYPE_CHECKING:
    from cocijax.manager._checkpoint_manager import CheckpointManager

__all__ = [
    "apply_retention",
    "check_deferred",
    "collect",
    "delete_step",
    "local_steps",
    "save_in_flight",
    "save_step",
    "settle",
    "tidy",
    "wait_for_removals",
    "wait_for_save",
    "wait_until_finished",
    "write_step",
]

log = logging.getLogger(__name__)


def save_step(
    mngr: CheckpointManager,
    step: Any,
    state: Any,
    loss: Any,
    force: bool,
    extra: dict[str, Any] | None,
    metrics: dict[str, Any] | None,
    custom_metadata: dict[str, Any] | None,
) -> bool:
    """:meth:`CheckpointManager.save` once the manager is known open (its contract)."""
    if mngr._read_only:
        raise ValueError(f"save: {mngr._directory} was opened with read_only options.")
    step = check_step(step)
    check_step_order(step, mngr._latest_saved, mngr._driver.step, mngr._directory)
    mngr._adopted = None  # the driver moves on from the state it adopted
    # A restart's policy compiles from here on, with the state it restored (open_directory).
    mngr._driver.compile_in_background()
    loss = stage_loss(loss)
    if mngr._driver.wants_state_size:  # once: the cost assumed until a save is timed
        mngr._driver.state_size(tree_nbytes(state))
    # The previous step's loss goes with this step; it is read only at the policy's next
    # check (that step is done by then), so a step that cannot save costs no device sync.
    previous_loss = mngr._driver.loss if mngr._pending_loss is None else mngr._pending_loss
    mngr._pending_loss = loss
    level = max(mngr._driver.decide_level(step, loss=previous_loss), 2 * force)
    saved = level > 0
    preempted = mngr._preemption.due(step, mngr._driver.step_time_s)
    if saved or preempted:
        level = 2 if preempted else level
        write_step(mngr, step, state, loss, extra, metrics, custom_metadata, level)
        if mngr._durable is not None and level == 2:
            mngr._durable.offer(step, force=preempted)  # drained once committed
    if preempted:
        mngr._preemption.taken(step, mngr.wait_until_finished)
    return saved or preempted


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
    # Warns with the user's `save` call as its place (save -> save_step -> write_step).
    metrics = mngr._check_metrics(metrics, step=step, stacklevel=4)
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
        # Held from before the garbage is found until Orbax's save is in flight (see Remover).
        with mngr._driver.saving(level) as measured, mngr._remover.starting_save():
            # A still-running save is a real stall: timed. So is the wait for a disk copy
            # this save cannot start beside (billed to this save: see _must_wait_for_copy).
            settle(mngr, copy=False)
            if _must_wait_for_copy(mngr, memory, level):
                settle(mngr)
            to_disk = memory is None  # with a memory tier, a persisted step is copied
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
            args = ocp.args.Composite(
                **{
                    STATE_ITEM: storage.StripedSave(state),
                    POLICY_ITEM: PolicyStateSave(
                        build=lambda: mngr._driver.to_json(snapshot, cost_s=measured["cost_s"]),
                        ready=ready,
                    ),
                    **items,
                }
            )
            if memory is not None:  # what a restart after a process failure reads
                if level == 2:
                    mngr._copy.mark(step)
                memory.save(
                    step, args, nbytes=nbytes, metrics=metrics, custom_metadata=custom_metadata
                )
                if level == 2:  # the disk's copy is made from it, off this thread
                    mngr._copy.start(step)
            else:
                with naming(mngr._step_dir(step), mngr._paths):
                    mngr.orbax.save(
                        step,
                        args=args,
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


def _must_wait_for_copy(mngr: CheckpointManager, memory: Any, level: int) -> bool:
    """Whether this save must wait for the disk copy in flight (the memory save waited for).

    A persisted save does (one copy at a time, in the order of the steps), and so does a
    memory save that would delete the step being copied (the tier's two slots: every committed
    step but the newest goes), or a save to the disk (garbage collection must not meet a copy).
    A level-1 save right after a persisted one does not: the step being copied is the newest.
    """
    copying = None if mngr._copy is None else mngr._copy.step
    if copying is None:
        return False
    return memory is None or level == 2 or copying != max(memory.steps(), default=None)


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


def save_in_flight(mngr: CheckpointManager) -> bool:
    """Whether a save has started and not yet committed (with a memory tier, a persisted
    step's copy to the disk too); safe from any thread."""
    copying = mngr._copy is not None and mngr._copy.step is not None
    return copying or mngr.orbax.is_saving_in_progress()


def wait_for_save(mngr: CheckpointManager, *, copy: bool = True) -> None:
    """Waits for the running saves (the memory tier's, then the disk's) and, with ``copy``,
    for the disk copy of a persisted memory step; their errors (every one, once, a copy's
    also without ``copy`` once it ended) name a path."""
    run_all(
        (lambda: None) if mngr._memory is None else lambda: _wait_for_memory(mngr),
        lambda: _wait_for_disk(mngr),
        (lambda: None) if mngr._copy is None else lambda: mngr._copy.wait(block=copy),
    )


def _wait_for_memory(mngr: CheckpointManager) -> None:
    try:
        mngr._memory.wait()
    finally:
        if mngr._copy is not None:
            mngr._copy.memory_settled()


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


def settle(mngr: CheckpointManager, *, copy: bool = True) -> None:
    """Waits for the save in flight (and, with ``copy``, for the disk copy in flight); takes
    the disk copies committed meanwhile; tells the drain when no local save is in flight."""
    wait_for_save(mngr, copy=copy)
    if mngr._copy is not None and mngr._copy.step is not None:
        return  # a step is still being copied to the disk: not settled
    _take_copies(mngr)
    if mngr._durable is not None:
        mngr._durable.settle()


def _take_copies(mngr: CheckpointManager) -> None:
    """Lists the steps copied to the disk since the last call, and applies retention to them
    as Orbax's save would have (no save or copy in flight)."""
    if mngr._copy is None or not mngr._copy.take_committed():
        return
    mngr.orbax.reload()  # committed by a rename, outside Orbax's save
    mngr._history.recorded()  # a disk save of this run committed (see _wait_for_disk)
    # Orbax applies max_to_keep (and keep_period, ...) when a save starts; Orbax 0.12 has no
    # public name for the steps it would remove.
    for old in mngr.orbax._get_old_steps_to_remove():
        mngr.orbax.delete(old)
        mngr._committed.discard(old)
    tidy(mngr)


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
    try:
        settle(mngr)
        try:
            if durable and mngr._durable is not None:
                mngr._durable.wait(raise_errors=True)
        finally:
            tidy(mngr)  # after the drains: best-N no longer keeps the steps they pinned
            wait_for_removals(mngr)
    finally:
        if mngr._host_local:  # a process whose save failed takes part too: others wait for it
            # A peer may wait up to store_timeout_s more for a drain making no progress.
            bound = mngr._store_timeout_s * (2 if durable else 1)
            agree_listed(mngr, bound, refresh=True)


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
