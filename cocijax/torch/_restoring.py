"""How ``cocijax.torch.CheckpointManager`` restores a step: DCP's load, RNG states, the policy.

These functions are the manager's own, kept apart for size: they take the manager first.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from cocijax._digest import DIGEST_KEY, check_digest
from cocijax.core._session import restore_order
from cocijax.torch._directory import METADATA_NAME, read_metadata
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
    ((step, _),) = restore_order(
        step, {"local": mngr.all_steps()}, fallback=False, where=str(mngr._dir)
    )
    path = mngr._dir / str(step)
    control = mngr._ranks.control
    meta = mngr._ranks.lead(lambda: read_metadata(mngr._dir, step), group=control)
    same_ranks = check_restorable(mngr, meta, step, objects)
    state_dict = to_state_dict(target)
    state_dict[RESERVED] = rank_template(meta["format"], mngr.rank, objects, rng=same_ranks)
    try:
        dcp.load(state_dict, checkpoint_id=path, **mngr._ranks.dcp_args(control))
    except (Exception, CheckpointException) as e:
        raise ValueError(f"cannot restore step {step} from {path}: {dcp_message(e)}") from e
    out = from_state_dict(target, state_dict)
    rng = loaded_rng(state_dict[RESERVED], mngr.rank)
    if rng is not None:
        set_rng_state(rng)
    if objects:
        load_extra(state_dict[RESERVED], mngr.rank, objects, step)
    load_policy_state(mngr, meta, step)
    mngr._driver.restart_timing()
    mngr._history.restored()
    return out if extra is None else (out, extra)


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
    mngr: CheckpointManager, meta: dict, step: int, *, history: bool = False
) -> None:
    """Adopts the policy state (and, when asked, the job history) saved with ``step``."""
    # A different policy than at save time cannot continue its schedule: said once.
    where = str(mngr._dir / str(step) / METADATA_NAME)
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
