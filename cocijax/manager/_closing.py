"""How :class:`cocijax.CheckpointManager` closes: the order, each part whatever the others raise.

The running save is waited for (its error re-raised after the rest), the garbage collected,
Orbax's manager, the durable tier, the memory tier's copy and the memory tier closed, the
preemption handlers given back, and last the running marker removed and the lock released.
With a ``timeout_s``, the waits on Orbax end by then (a process of the job may have died).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cocijax.core._session import run_all
from cocijax.manager._faults import naming
from cocijax.manager._saving import settle, tidy, wait_for_removals

if TYPE_CHECKING:
    from cocijax.manager._checkpoint_manager import CheckpointManager

__all__ = ["close", "release"]


def close(mngr: CheckpointManager, timeout_s: float | None = None) -> None:
    """:meth:`cocijax.CheckpointManager.close`: each part runs whatever the others raise.

    With ``timeout_s``, the waits on Orbax (the running save, the removals, Orbax's close) end
    by then: what has not run by then is abandoned, with a ``TimeoutError`` naming the save.
    """

    def finish() -> None:
        settle(mngr)  # re-raises a failed save or disk copy: close all the same
        tidy(mngr)

    def close_orbax() -> None:
        with naming(mngr.directory, mngr._paths):
            mngr.orbax.close()

    def close_durable() -> None:
        if mngr._durable is not None:
            mngr._durable.close()  # the last drain ends; its errors were logged

    step = mngr._latest_saved if mngr._save_started else None
    run_all(
        lambda: _within(
            finish,
            lambda: wait_for_removals(mngr),
            close_orbax,
            timeout_s=timeout_s,
            why=lambda: _abandoned(step, timeout_s),
        ),
        close_durable,
        (lambda: None) if mngr._copy is None else mngr._copy.close,
        (lambda: None) if mngr._memory is None else mngr._memory.close,
        mngr._preemption.watcher.uninstall,
        lambda: release(mngr),
    )


def _within(*calls: Any, timeout_s: float | None, why: Callable[[], str]) -> None:
    """:func:`run_all` of ``calls``; with ``timeout_s``, in a thread, raising
    ``TimeoutError(why())`` if they have not all ended by then. The thread is left to itself
    and starts none of the calls that remain: the lock is released, it must not delete."""
    if timeout_s is None:
        run_all(*calls)
        return
    outcome: concurrent.futures.Future = concurrent.futures.Future()
    gave_up = threading.Event()

    def unless_given_up(call: Callable[[], object]) -> Callable[[], None]:
        return lambda: None if gave_up.is_set() else call()

    def run() -> None:
        try:
            run_all(*map(unless_given_up, calls))
        except BaseException as e:  # handed to the thread that waits for it
            outcome.set_exception(e)
        else:
            outcome.set_result(None)

    # A daemon: a thread held in Orbax's barrier by a dead process must not hold the exit.
    threading.Thread(target=run, name="cocijax-close", daemon=True).start()
    try:
        outcome.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        gave_up.set()
        raise TimeoutError(why()) from None


def _abandoned(step: int | None, timeout_s: float | None) -> str:
    """What a close that ran out of ``timeout_s`` leaves undone."""
    waiting = (
        "the garbage collection and Orbax's close"
        if step is None
        else f"the save of step {step}, which Orbax commits once every process has written "
        f"its part,"
    )
    abandoned = (
        ""
        if step is None
        else f"step {step} (not committed; after a process's death it never will be), "
    )
    return (
        f"close: {waiting} did not end within timeout_s={timeout_s:g} s: with several "
        f"processes another process may have died (JAX finds a dead process only at its "
        f"heartbeat timeout; look for an error there). Abandoned: {abandoned}the garbage "
        f"collection and Orbax's close (its threads are left waiting); the directory's lock is "
        f"released."
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
