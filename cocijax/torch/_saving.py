"""How ``cocijax.torch.CheckpointManager`` saves a step: DCP's write, the commit, retention.

With a memory tier, DCP writes into it (after freeing the older slot) and the step commits
there first; a persisted save (level 2) is then copied to the directory and committed there,
in the background like the write. A level-1 save stays in memory.

These functions are the manager's own, kept apart for size: they take the manager first.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

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
            if mngr._use_async:
                write = dcp.async_save(
                    state_dict, checkpoint_id=tmp, **mngr._ranks.dcp_args(writes)
                )
            else:
                dcp.save(state_dict, checkpoint_id=tmp, **mngr._ranks.dcp_args(writes))
                write = None
        meta = {"world_size": mngr._ranks.world, "extra": names, "metrics": recorded}
        args = (mngr, step, tmp, meta, snapshot, write, memory, to_disk)
        if write is None:
            _commit(*args)
        else:
            mngr._pending = mngr._executor.submit(_commit, *args)
    except BaseException:
        _abandon(mngr, step, tmp.name)
        raise


def _memory_target(mngr: CheckpointManager, state: Mapping[str, Any]) -> MemoryTier | None:
    """The memory tier this save writes to: None without one, or once a state did not fit
    with ``memory=True`` (warned; the budget is checked at the first save)."""
    memory = mngr._memory
    if memory is None or not memory.enabled:
        return None
    return memory if memory.check_fits(lambda: tree_nbytes(state)) else None


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
        if memory is not None:
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
