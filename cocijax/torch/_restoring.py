"""How ``cocijax.torch.CheckpointManager`` restores a step: DCP's load, RNG states, the policy.

These functions are the manager's own, kept apart for size: they take the manager first.

With a memory tier, a step's memory copy is tried first, checked against its files' checksums
before DCP loads anything into the target: a copy that does not check out is skipped with a
warning for the next one (the older memory slot, then the directory's copy) and deleted. With
several ranks (each its own memory tier) the ranks agree first on the memory steps all of them
hold, then on each copy tried: a step restores from memory only when every rank's copy checks
out, else every rank skips it (and deletes its copy), so all restore the same step from the
same tier.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from cocijax._digest import DIGEST_KEY, check_digest
from cocijax.core._session import restore_order
from cocijax.torch._directory import METADATA_NAME, read_metadata
from cocijax.torch._memory import verify
from cocijax.torch._state import (
    RESERVED,
    check_extra,
    from_state_dict,
    load_extra,
    loaded_rng,
    rank_template,
    set_rng_state,
    to_state_dict,
)

if TYPE_CHECKING:
    from cocijax.torch._manager import CheckpointManager

__all__ = ["check_restorable", "dcp_message", "load_policy_state", "restore"]

log = logging.getLogger(__name__)


def restore(
    mngr: CheckpointManager,
    step: int | None,
    target: Mapping[str, Any] | None,
    extra: Mapping[str, Any] | None,
) -> Any:
    """:meth:`cocijax.torch.CheckpointManager.restore` (see there); no save is in flight."""
    if target is None:
        raise ValueError(
            "target is required: pass the dict given to save, e.g. "
            "{'model': model, 'optimizer': optimizer}"
        )
    objects = check_extra(extra)
    step, tier, meta = _first_intact(mngr, step)
    path = (mngr._dir if tier == "local" else mngr._memory.path) / str(step)
    # A memory copy is this rank's own checkpoint (see _memory): read by this process alone.
    own = tier == "memory" and mngr._ranks.world > 1
    dist_args = {"no_dist": True} if own else mngr._ranks.dcp_args(mngr._ranks.control)
    same_ranks = check_restorable(mngr, meta, step, objects)
    state_dict = to_state_dict(target)
    state_dict[RESERVED] = rank_template(meta["format"], mngr.rank, objects, rng=same_ranks)
    try:
        dcp.load(state_dict, checkpoint_id=path, **dist_args)
    except (Exception, CheckpointException) as e:
        raise ValueError(f"cannot restore step {step} from {path}: {dcp_message(e)}") from e
    out = from_state_dict(target, state_dict)
    rng = loaded_rng(state_dict[RESERVED], mngr.rank)
    if rng is not None:
        set_rng_state(rng)
    if objects:
        load_extra(state_dict[RESERVED], mngr.rank, objects, step)
    load_policy_state(mngr, meta, path)
    mngr._driver.restart_timing()
    mngr._history.restored()
    mngr._restored = (step, tier)
    log.info("restore: step %d restored from the %s tier", step, tier)
    return out if extra is None else (out, extra)


def _first_intact(mngr: CheckpointManager, step: int | None) -> tuple[int, str, dict]:
    """The copy to restore: ``(step, "memory" | "local", its metadata)``, the same on every rank.

    The memory copies of ``step`` (default: the newest step, then the older memory slot) come
    first, then the directory's copy. The memory steps tried are those every rank holds; a
    memory copy whose metadata or files do not check out on some rank is skipped on every rank
    with a warning naming the ranks, and deleted (it is newer than the step restored: left
    listed, the next save would have to come after it).
    """
    ranks, memory = mngr._ranks, mngr._memory
    held = ranks.gather([] if memory is None else sorted(memory.steps))
    common = sorted(set(held[0]).intersection(*held))
    tiers = {"memory": common, "local": list(mngr._steps)}
    where = str(mngr._dir) + (f" or {memory.path}" if common else "")
    copies = restore_order(step, tiers, fallback=bool(common), where=where)
    if step is not None:
        copies = [c for c in copies if c[0] == copies[0][0]]
    disk = [i for i, (_, tier) in enumerate(copies) if tier == "local"]
    copies = copies[: disk[0] + 1] if disk else copies
    for s, tier in copies:
        if tier == "local":  # rank 0 reads the record every rank loads by
            meta = ranks.lead(lambda: read_metadata(mngr._dir, s), group=ranks.control)  # noqa: B023
            return s, tier, meta
        meta, error = _check_memory_copy(memory.path, s)
        errors = ranks.gather(None if error is None else str(error))
        damaged = {r: e for r, e in enumerate(errors) if e is not None}
        if not damaged:
            return s, tier, meta
        if (s, tier) == copies[-1]:
            if error is not None:
                raise error
            raise ValueError(f"restore: step {s}'s memory copy is damaged: {_ranks_said(damaged)}")
        warnings.warn(
            f"restore: skipping damaged step {s} (memory copy): "
            + (str(error) if ranks.world == 1 else _ranks_said(damaged)),
            RuntimeWarning,
            stacklevel=4,  # the user's restore call
        )
        with mngr._lock:
            mngr._memory.delete(s)  # on every rank: no rank restores it from memory
    raise AssertionError("unreachable: the last copy returns or raises")


def _check_memory_copy(folder: Path, step: int) -> tuple[dict | None, Exception | None]:
    """This rank's memory copy of ``step``: ``(its metadata, None)`` when its files match
    their checksums, else ``(None, the error)``."""
    try:
        meta = read_metadata(folder, step)
        verify(folder / str(step), meta.get("checksums", {}))
    except (OSError, ValueError) as e:
        return None, e
    return meta, None


def _ranks_said(errors: dict[int, str]) -> str:
    return "; ".join(f"rank {rank}: {error}" for rank, error in errors.items())


def check_restorable(
    mngr: CheckpointManager, meta: dict, step: int, objects: Mapping[str, Any]
) -> bool:
    """Whether the step was saved by as many ranks as this job has; raises for extras."""
    saved_extra = meta.get("extra", [])
    missing = sorted(set(objects) - set(saved_extra))
    if missing:
        raise ValueError(
            f"restore: step {step} in {mngr._dir} has no extra item {missing[0]!r} "
            f"(it has {saved_extra})"
        )
    saved_world = int(meta.get("world_size", 1))
    if saved_world == mngr._ranks.world:
        return True
    if objects:
        raise ValueError(
            f"restore: extra items are per rank, and step {step} in {mngr._dir} was saved "
            f"by {saved_world} ranks, this job has {mngr._ranks.world}; restore without "
            "extra (the state itself reshards)"
        )
    warnings.warn(
        f"step {step} in {mngr._dir} was saved by {saved_world} ranks, this job has "
        f"{mngr._ranks.world}: the state is resharded, the RNG states are not restored",
        RuntimeWarning,
        stacklevel=4,
    )
    return False


def load_policy_state(
    mngr: CheckpointManager, meta: dict, step_dir: Path, *, history: bool = False
) -> None:
    """Adopts the policy state (and, when asked, the job history) saved with the step in
    ``step_dir``."""
    # A different policy than at save time cannot continue its schedule: said once.
    where = str(step_dir / METADATA_NAME)
    policy = meta.get("policy")
    if isinstance(policy, dict):  # its digest checked, then dropped (older ones had none)
        if not check_digest(policy):
            reason = f"{where}: the policy state does not match its digest (damaged)"
            mngr._driver.start_fresh(reason, stacklevel=3)  # the user's open or restore
            return
        policy = {k: v for k, v in policy.items() if k != DIGEST_KEY}
    mngr._driver.adopt(policy, where=where, stacklevel=3, history=history)


def dcp_message(e: BaseException) -> str:
    """The underlying errors of a DCP ``CheckpointException`` (without its tracebacks)."""
    if isinstance(e, CheckpointException):
        return "; ".join(str(exc) for exc, _ in e.failures.values())
    return str(e)
