"""How ``cocijax.torch.CheckpointManager`` saves a step: DCP's write, the commit, retention.

With a memory tier, DCP writes into it (after freeing the older slot) and the step commits
there first; a persisted save (level 2) is then copied to the directory and committed there,
in the background like the write. A level-1 save stays in memory.

With several ranks and a memory tier, each rank writes its own state into its own tier (DCP in
this process alone), and every rank commits its copy; a persisted save is then written to the
directory by a collective DCP write of the same staged state (one snapshot: the memory copies
are per rank, the directory's step is one checkpoint of every rank's shards), committed by
rank 0.

These functions are the manager's own, kept apart for size: they take the manager first.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from cocijax._digest import with_digest
from cocijax.core._memory import older_slots
from cocijax.torch._directory import TMP_PREFIX, commit, read_metadata, remove
from cocijax.torch._memory import MemoryTier, checksums, copy_step
from cocijax.torch._restoring import dcp_message
from cocijax.torch._state import RESERVED, check_extra, own_entry, to_state_dict, tree_nbytes

if TYPE_CHECKING:
    from cocijax.torch._manager import CheckpointManager

__all__ = ["save_step"]


def save_step(
    mngr: CheckpointManager,
    step: int,
    state: Mapping[str, Any],
    loss: float,
    extra: Any,
    metrics: Any,
    level: int = 2,
) -> None:
    """Saves ``step`` with DCP (asynchronously by default); rank 0 commits it once written.

    Args:
      level: 2 (persisted: the directory, and the memory tier first if any) or 1 (the memory
        tier only; the directory without one).
    """
    memory = _memory_target(mngr, state)
    to_disk = level == 2 or memory is None
    tmp = (mngr._dir if memory is None else memory.path) / f"{TMP_PREFIX}{step}-{mngr._session}"
    control, writes = mngr._ranks.control, mngr._ranks.writes
    per_rank = memory is not None and mngr._ranks.world > 1

    def stage() -> tuple[dict[str, Any], list[str], dict[str, Any] | None]:
        objects = check_extra(extra)
        # Warns with the user's call as its place (save -> save_step -> agree -> stage -> here).
        recorded = mngr._check_metrics(metrics, step=step, stacklevel=5)
        own = own_entry(step, mngr.rank, objects)
        return {**to_state_dict(state), RESERVED: own}, sorted(objects), recorded

    try:
        # The stall this save costs the loop: waiting for the previous save plus staging.
        with mngr._driver.saving(level):
            mngr._wait_pending()
            with mngr._lock:
                if memory is not None:  # the newest stays until this one commits
                    for old in older_slots(sorted(memory.steps)):
                        memory.delete(old)
                    memory.steps.append(step)
                if to_disk:
                    mngr._steps.append(step)
            # One rank's failure here (bad input, a state_dict that raises) stops every
            # rank before any of them starts DCP's collective write.
            state_dict, names, recorded = mngr._ranks.agree(stage, group=control)
            snapshot = mngr._driver.snapshot(loss, level)
            if per_rank:
                write, staged = _write_own(mngr, state_dict, tmp)
            elif mngr._use_async:
                write = dcp.async_save(
                    state_dict, checkpoint_id=tmp, **mngr._ranks.dcp_args(writes)
                )
            else:
                dcp.save(state_dict, checkpoint_id=tmp, **mngr._ranks.dcp_args(writes))
                write = None
        meta = {"world_size": mngr._ranks.world, "extra": names, "metrics": recorded}
        if per_rank:
            commit_fn, args = _commit_per_rank, (mngr, step, tmp, meta, snapshot, write, staged)
            args += (to_disk,)
        else:
            commit_fn, args = _commit, (mngr, step, tmp, meta, snapshot, write, memory, to_disk)
        if write is None:
            commit_fn(*args)
        else:
            mngr._pending = mngr._executor.submit(commit_fn, *args)
    except BaseException:
        _abandon(mngr, step, tmp.name)
        raise


def _memory_target(mngr: CheckpointManager, state: Mapping[str, Any]) -> MemoryTier | None:
    """The memory tier this save writes to: None without one, or once a state did not fit
    with ``memory=True`` (warned; the budget is checked at the first save). With several
    ranks, one rank's tier that does not fit takes every rank's out (an error on one rank is
    raised on every rank)."""
    memory, ranks = mngr._memory, mngr._ranks
    if memory is None or not memory.enabled:
        return None
    if ranks.world == 1:
        return memory if memory.check_fits(lambda: tree_nbytes(state)) else None
    if not memory.fits_checked:  # the first save, on every rank at once
        # The user's save -> save_step -> here -> agree -> the lambda -> check_fits.
        check = lambda: memory.check_fits(lambda: tree_nbytes(state), stacklevel=7)
        fits = ranks.agree(check, group=ranks.control)
        memory.enabled = bool(ranks.allgather(np.array([fits])).all())
    return memory if memory.enabled else None


class _KeepStaged(DefaultStager):
    """DCP's default staging (a host copy of the state, as ``async_save`` makes), which keeps
    the staged copy: a persisted save writes it to the directory after its memory copy."""

    staged: Any = None

    def __init__(self) -> None:
        super().__init__(StagingOptions(False, False, False, False))

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        self.staged = super().stage(state_dict, **kwargs)
        return self.staged


def _write_own(
    mngr: CheckpointManager, state_dict: dict[str, Any], tmp: Path
) -> tuple[concurrent.futures.Future | None, Callable[[], Any]]:
    """Several ranks: starts this rank's write of its own state into its memory tier; returns
    the write (None: done) and what a persisted save writes to the directory."""
    if not mngr._use_async:
        dcp.save(state_dict, checkpoint_id=tmp, no_dist=True)
        return None, lambda: state_dict
    stager = _KeepStaged()
    write = dcp.async_save(state_dict, checkpoint_id=tmp, no_dist=True, async_stager=stager)
    write.add_done_callback(lambda _: stager.close())
    return write, lambda: stager.staged


def _commit(
    mngr: CheckpointManager,
    step: int,
    tmp: Path,
    meta: dict,
    snapshot: dict,
    write: Any,
    memory: MemoryTier | None,
    to_disk: bool,
) -> None:
    """Waits for every rank's DCP write, then rank 0 publishes ``tmp`` as ``<step>`` (in the
    memory tier, then copied to the directory when ``to_disk``)."""
    writes = mngr._ranks.writes
    try:
        if write is not None:
            mngr._ranks.agree(lambda: _dcp_result(write, step, tmp), group=writes)

        def publish() -> None:
            # With a digest, as the JAX manager's policy item: a damaged one is refused.
            policy = with_digest(mngr._driver.to_json(snapshot, cost_s=mngr._driver.cost_s))
            record = {**meta, "policy": policy}
            if memory is None:
                commit(mngr._dir, tmp, step, record)
                return
            # DCP writes no checksums: a restore checks the memory copy's files against these.
            record["checksums"] = checksums(tmp)
            commit(memory.path, tmp, step, record)
            if to_disk:
                copied = copy_step(memory.path / str(step), mngr._dir, step, mngr._session)
                commit(mngr._dir, copied, step, record)

        mngr._ranks.lead(publish, group=writes)
        if to_disk:
            mngr._history.recorded()  # the job's failures are on record with this step
    except BaseException:
        _abandon(mngr, step, tmp.name)
        raise
    if to_disk:
        _retire(mngr)


def _commit_per_rank(
    mngr: CheckpointManager,
    step: int,
    tmp: Path,
    meta: dict,
    snapshot: dict,
    write: Any,
    staged: Callable[[], Any],
    to_disk: bool,
) -> None:
    """Several ranks with memory tiers: waits for every rank's memory write, then every rank
    commits its copy (rank 0's record, its own checksums); a persisted save is then written to
    the directory from the same staged state (collective) and committed by rank 0."""
    ranks, memory = mngr._ranks, mngr._memory
    everywhere = False  # every rank's memory copy committed
    try:
        if write is not None:
            ranks.agree(lambda: _dcp_result(write, step, tmp), group=ranks.writes)

        def record() -> dict:
            policy = with_digest(mngr._driver.to_json(snapshot, cost_s=mngr._driver.cost_s))
            return {**meta, "policy": policy}

        shared = ranks.lead(record, group=ranks.writes)  # rank 0's metrics and history

        def commit_own() -> None:
            own = {**shared, "rank": ranks.rank, "checksums": checksums(tmp)}
            commit(memory.path, tmp, step, own)

        ranks.agree(commit_own, group=ranks.writes)
        everywhere = True
        if to_disk:
            disk = mngr._dir / tmp.name
            try:
                dcp.save(staged(), checkpoint_id=disk, **ranks.dcp_args(ranks.writes))
            except CheckpointException as e:
                raise RuntimeError(f"saving step {step} to {disk} failed: {dcp_message(e)}") from e
            ranks.lead(lambda: commit(mngr._dir, disk, step, shared), group=ranks.writes)
            mngr._history.recorded()
    except BaseException:
        if not everywhere:  # a copy some rank lacks cannot restore: none keeps it
            with mngr._lock:
                memory.delete(step)
        _abandon(mngr, step, tmp.name)
        raise
    if to_disk:
        _retire(mngr)


def _abandon(mngr: CheckpointManager, step: int, tmp_name: str) -> None:
    """Forgets a save that failed (on every rank) where it did not commit, and removes what it
    wrote (rank 0): a persisted save whose memory copy committed keeps it."""
    memory = mngr._memory
    with mngr._lock:
        if step in mngr._steps and not (mngr._dir / str(step)).is_dir():
            mngr._steps.remove(step)
        if memory is not None and step in memory.steps and not (memory.path / str(step)).is_dir():
            memory.steps.remove(step)
    if mngr._ranks.leader:
        remove(mngr._dir / tmp_name)
    if memory is not None:  # each rank's own tier with several ranks
        remove(memory.path / tmp_name)


def _retire(mngr: CheckpointManager) -> None:
    """Drops the steps that retention no longer keeps: rank 0 decides and deletes them."""
    if not mngr._retention.active:
        return  # everything is kept: no collective needed
    doomed = mngr._ranks.lead(lambda: _doomed(mngr), group=mngr._ranks.writes)
    with mngr._lock:
        mngr._steps = [s for s in mngr._steps if s not in doomed]
    if mngr._ranks.leader:
        for s in doomed:
            remove(mngr._dir / str(s))


def _doomed(mngr: CheckpointManager) -> list[int]:
    """Rank 0: the committed steps retention drops (ranked by the metrics in their
    ``cocijax.json`` with best-N), never the preemption save."""
    with mngr._lock:
        steps = list(mngr._steps)  # the directory's (the memory tier keeps its two slots)
    return mngr._retention.drop(
        steps,
        lambda s: read_metadata(mngr._dir, s).get("metrics"),
        keep={mngr._preemption.step},
    )


def _dcp_result(write: concurrent.futures.Future, step: int, tmp: Path) -> None:
    """Waits for a DCP ``async_save``; its error as an ordinary ``RuntimeError``."""
    try:
        write.result()
    except CheckpointException as e:
        # DCP's error is a BaseException carrying per-rank tracebacks: make it ordinary.
        raise RuntimeError(f"saving step {step} to {tmp} failed: {dcp_message(e)}") from e
