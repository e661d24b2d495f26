"""How :class:`cocijax.CheckpointManager` restores: which copy, damage, deletions under a reader.

A step may have several copies: the memory tier's, the local one (cocijax's format, or a step
Orbax's own manager wrote) and the durable tier's. :func:`restore` tries them in the order of
:func:`cocijax.core._session.restore_order` (memory first) and returns the first that restores;
with ``fallback`` a damaged copy is skipped (warned) for the next, and a writer then sets the
damaged local steps aside. A memory copy that does not restore (torn, corrupt, gone with the
tmpfs) is always skipped for the next copy: the newest step intact in any tier wins. A copy
deleted while it is read (the writer's retention, seen by a reader) makes ``restore()`` start
again with the newest step, and ``restore(step)`` raise :class:`StepDeletedError`.

These functions are the manager's own, kept apart for size: they take the manager first.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from cocijax import storage
from cocijax.core._contract import StepDeletedError
from cocijax.core._session import restore_order
from cocijax.manager._directory import POLICY_ITEM, STATE_ITEM, checked_once
from cocijax.manager._gc import quarantine
from cocijax.manager._hosts import restore_together
from cocijax.manager._items import check_extra
from cocijax.manager._orbax_steps import restore_orbax_step
from cocijax.manager._policy_item import PolicyStateHandler, PolicyStateRestore
from cocijax.manager._saving import wait_for_save

if TYPE_CHECKING:
    from cocijax.manager._checkpoint_manager import CheckpointManager

__all__ = ["load_policy", "restore", "restore_items"]

log = logging.getLogger(__name__)

_DAMAGE = (storage.CorruptCheckpointError, storage.CheckpointFormatError)
# How often ``restore()`` retries with the newest step when the one it reads is deleted.
_DELETED_RETRIES = 8


class _Deleted(Exception):
    """A step vanished while it was restored (internal: becomes a retry or StepDeletedError)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def restore(
    mngr: CheckpointManager,
    step: int | None,
    target: Any,
    *,
    fallback: bool,
    extra: dict[str, Any] | None,
    partial: bool,
    tier: str | None,
) -> Any:
    """:meth:`cocijax.CheckpointManager.restore` (see there).

    Host-local with memory tiers, the newest step is restored together: a process that could
    not restore it from any of its copies (its memory copy damaged, a level-1 step) makes every
    process restore the next newest step instead (``_hosts.restore_together``).
    """
    here = functools.partial(
        _restore_here, mngr, step, target,
        fallback=fallback, extra=extra, partial=partial, tier=tier,
    )  # fmt: skip
    if step is None and mngr._host_local and mngr._memory is not None:
        return restore_together(mngr, here, damage=(*_DAMAGE, OSError))
    return here()


def _restore_here(
    mngr: CheckpointManager,
    step: int | None,
    target: Any,
    *,
    fallback: bool,
    extra: dict[str, Any] | None,
    partial: bool,
    tier: str | None,
) -> Any:
    """This process's restore (see :func:`restore`)."""
    items = check_extra(extra, restoring=True)
    if partial and target is None:
        raise ValueError(
            "restore: partial=True needs a target, the sub-tree of the saved state to read."
        )
    args = {STATE_ITEM: storage.StripedRestore(target, partial=partial), **items}
    newest = step is None
    for attempt in range(_DELETED_RETRIES + 1):
        try:
            with checked_once():  # one check of each step's manifest per attempt
                copies = _copies(mngr, step, tier, fallback=fallback)
                (restored_step, where), restored = _restore_first(mngr, copies, args, fallback)
                if mngr._adopted != (restored_step, where):  # the opening's adoption holds
                    load_policy(mngr, restored_step, where=where, stacklevel=4)
        except _Deleted as deleted:
            if newest and attempt < _DELETED_RETRIES:
                log.info(
                    "restore: step %d was deleted while it was read; retrying with the newest step",
                    deleted.step,
                )
                continue
            raise StepDeletedError(
                f"restore: step {deleted.step} in {mngr.directory} was deleted while it was "
                "read (the writer's retention or delete)"
                + (
                    f", {attempt + 1} times in a row: the writer deletes steps faster than "
                    "this reader reads them."
                    if newest
                    else f"; committed now: {mngr.all_steps()}."
                )
            ) from deleted.__cause__
        tier_name = "local" if where == "orbax" else where
        log.info("restore: step %d restored from the %s tier", restored_step, tier_name)
        mngr._restored(restored_step, tier_name)
        if extra is None:
            return restored[STATE_ITEM]
        return restored[STATE_ITEM], {name: restored[name] for name in items}
    raise AssertionError("unreachable: the last attempt returns or raises")


def _copies(
    mngr: CheckpointManager, step: int | None, tier: str | None, *, fallback: bool
) -> list[tuple[int, str]]:
    """The copies ``restore`` tries in turn: ``(step, "memory" | "local" | "orbax" | "durable")``.

    Without ``fallback``, the memory copies of the newest step and of older ones are tried
    before the first copy of another tier (which is the last): a memory copy may be torn.
    Host-local, every copy of the step is tried in turn (memory, local, durable), never an
    older step's: a process's own copies hold its shards only, the durable one every shard.
    """
    if tier not in (None, "memory", "local", "durable"):
        raise ValueError(
            f"restore: tier must be None, 'memory', 'local' or 'durable', got {tier!r}."
        )
    durable_tier = mngr._durable
    for name, present in (("durable", durable_tier), ("memory", mngr._memory)):
        if tier == name and present is None:
            raise ValueError(f"restore: tier={name!r}, but this manager has no {name} tier.")
    memory = mngr.memory_steps() if tier in (None, "memory") else []
    # The newest step alone needs no older one read (the opening may have left them).
    every = fallback or step is not None
    local = mngr._local_steps(every=every) if tier in (None, "local") else []
    orbax = list(mngr._orbax_steps) if tier in (None, "local") else []
    durable = durable_tier.steps() if durable_tier is not None and tier in (None, "durable") else []
    if durable_tier is not None and tier in (None, "durable") and step not in (
        None, *local, *durable, *memory
    ):  # fmt: skip
        durable = durable_tier.refreshed_steps()  # drained since the last listing?
    where = f"{mngr.directory}" + (f" or {durable_tier.url}" if durable else "")
    where += f" or {mngr._memory.path}" if memory else ""
    tiers = {"memory": memory, "local": local, "orbax": orbax, "durable": durable}
    # Host-local: a step some process cannot serve is not restored by any (see _hosts).
    tiers = {name: [s for s in steps if s not in mngr._hidden] for name, steps in tiers.items()}
    # A memory copy may be torn, a host-local copy may lack a region another topology needs
    # (read by a job of another process count too, host-local or not): then the step's next
    # copy is tried.
    several = bool(memory) or mngr._host_local or durable_tier is not None
    copies = restore_order(step, tiers, fallback=fallback or several, where=where)
    if fallback or not several:
        return copies
    # Host-local, every process restores the agreed step: a damaged memory copy on one of them
    # must not take it to an older step than the others.
    if step is not None or not memory or mngr._host_local:  # that step's copies only
        return [c for c in copies if c[0] == copies[0][0]]
    others = [i for i, (_, name) in enumerate(copies) if name != "memory"]
    return copies[: others[0] + 1] if others else copies


def _restore_first(
    mngr: CheckpointManager, copies: list[tuple[int, str]], args: dict[str, Any], fallback: bool
) -> tuple[tuple[int, str], Any]:
    """Restores the first copy that is intact (with ``fallback``) or the first one.

    Raises:
      _Deleted: a copy vanished while it was read (a writer deleted it).
    """
    skipped: list[tuple[int, str]] = []
    for step, where in copies:
        try:
            restored = restore_items(mngr, step, where, args)
        except storage.RegionNotHeldError as e:
            if (step, where) == copies[-1]:
                e.add_note(_not_held_hint(mngr, step, copies, fallback))
                raise
            # Not damage (nothing is set aside): this process's copy holds its own shards only.
            log.info("restore: step %d: the %s copy does not serve: %s", step, where, e)
            continue
        except Exception as e:
            # A writer renames a step out of the directory before it removes any of its data,
            # so data missing under a step directory that is still there is damage.
            if where == "local" and not mngr.item_directory(step).parent.exists():
                raise _Deleted(step) from e
            # The durable writer deletes a step's manifest before its data; a store that lost
            # the step does too: either way it is no longer committed.
            if where == "durable" and mngr._durable.vanished(step):
                raise _Deleted(step) from e
            memory = where == "memory" and isinstance(e, (*_DAMAGE, OSError, ValueError))
            last = (step, where) == copies[-1]
            if last or not (memory or (fallback and isinstance(e, _DAMAGE))):
                if skipped:
                    names = ", ".join(_copy_name(mngr, *c) for c in skipped)
                    e.add_note(f"restore: also damaged, skipped: {names}")
                if isinstance(e, _DAMAGE):
                    e.add_note(_damage_hint(mngr, fallback))
                raise
            warnings.warn(
                f"restore: skipping damaged {_copy_name(mngr, step, where)}: {e}",
                RuntimeWarning,
                stacklevel=4,  # the user's restore call
            )
            skipped.append((step, where))
        else:
            _set_aside(mngr, skipped)
            return (step, where), restored
    raise AssertionError("unreachable: the last copy returns or raises")


def _copy_name(mngr: CheckpointManager, step: int, where: str) -> str:
    several = mngr._durable is not None or mngr._memory is not None
    return f"step {step}" + (f" ({where} copy)" if several else "")


def _not_held_hint(
    mngr: CheckpointManager, step: int, copies: list[tuple[int, str]], fallback: bool
) -> str:
    tried = ", ".join(where for s, where in copies if s == step)
    said = (
        f"restore: no copy of step {step} holds that region for process "
        f"{jax.process_index()} (tried: {tried})."
    )
    if fallback:
        return f"{said} No older step is complete in any tier either."
    return (
        f"{said} restore(fallback=True) restores the newest older step some tier holds "
        "whole (e.g. the durable tier's)."
    )


def _damage_hint(mngr: CheckpointManager, fallback: bool) -> str:
    verify = f"`cocijax verify {mngr.directory}` names every damaged step and file."
    if fallback:
        return f"restore: no intact older step to fall back to. {verify}"
    return (
        "restore(fallback=True) restores the newest intact older step instead (and sets the "
        f"damaged ones aside); {verify}"
    )


def _set_aside(mngr: CheckpointManager, skipped: list[tuple[int, str]]) -> None:
    """Sets damaged local copies aside after a restore skipped them (a writer's), and deletes
    damaged memory copies.

    They are newer than the step restored: left listed, the next save would have to come
    after them. Local ones are kept in the quarantine for inspection (see ``_gc``), not listed.
    """
    if not skipped or mngr._lock is None:
        return
    wait_for_save(mngr)
    for step in [s for s, where in skipped if where == "memory"]:
        if step in mngr.memory_steps():
            mngr._memory.delete(step)
    steps = [s for s, where in skipped if where == "local"]
    for step in steps:
        step_dir = mngr._step_dir(step)
        if step_dir.exists():
            quarantine(step_dir, "damaged, skipped by restore(fallback=True)")
        mngr._committed.discard(step)
    mngr.orbax.reload()
    mngr._latest_saved = mngr.latest_step()


def restore_items(mngr: CheckpointManager, step: int, where: str, items: dict[str, Any]) -> Any:
    """Orbax's restore of ``items`` from the local, Orbax-written or durable copy of ``step``."""
    if where == "local":
        return mngr.orbax.restore(step, args=ocp.args.Composite(**items))
    if where == "memory":
        return mngr._memory.restore(step, items)
    if where == "orbax":
        state = items.get(STATE_ITEM, storage.StripedRestore())
        extra = {k: v for k, v in items.items() if k != STATE_ITEM}
        return restore_orbax_step(mngr._orbax_steps[step], state.item, extra, partial=state.partial)
    return mngr._durable.restore(step, items)


def load_policy(
    mngr: CheckpointManager, step: int, *, where: str, stacklevel: int, history: bool = False
) -> None:
    """Adopts the policy state saved with ``step`` (and, when asked, the job history).

    A policy state saved by another policy cannot be continued: the policy starts fresh, said
    once per manager (a warning, ``stacklevel`` counted from this function's caller).
    """
    if mngr._read_only:
        return  # a reader never saves: the schedule is of no use to it
    driver = mngr._driver
    if where == "orbax":
        log.info("step %d was written by Orbax: the policy starts its schedule there", step)
        driver.step = step  # the next call must be after it
        return
    if where == "durable":
        path = mngr._durable.root / str(step) / POLICY_ITEM
    elif where == "memory":
        path = mngr._memory.path / str(step) / POLICY_ITEM
    else:
        path = mngr._step_dir(step) / POLICY_ITEM
    try:
        if where in ("local", "memory"):  # its own reader: Orbax's would find the step again
            data = PolicyStateHandler().restore(path)
        else:
            data = restore_items(mngr, step, where, {POLICY_ITEM: PolicyStateRestore()})
            data = data[POLICY_ITEM]
    except (ValueError, OSError, KeyError, storage.CorruptCheckpointError) as e:
        reason = f"the policy state of step {step} cannot be read ({e})"
        driver.start_fresh(reason, stacklevel=stacklevel)
        return
    if driver.adopt(data, where=str(path), stacklevel=stacklevel, history=history):
        driver.step = step  # the saved step counts as seen: the next call must be after it
        # Until the driver is fed again (save), restoring this copy adopts nothing new.
        mngr._adopted = (step, where)
