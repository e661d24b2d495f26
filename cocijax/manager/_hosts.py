"""Several processes with local folders of their own (``CheckpointManager(host_local=True)``).

Each process of a ``jax.distributed`` job saves its own copy of what its devices hold into its
own directory and roots, which the other processes need not see (a machine's NVMe). Each one's
Orbax manager is then a manager of one process (``primary_host=None``, only itself active, as
the local managers of Orbax's emergency checkpointing): it commits, lists and deletes its own
steps. The durable tier is shared: every process drains its own shards there, and process 0
commits the step once every process's part is there (``_tier_drain``).

What the processes must agree on, they exchange through JAX's distributed key-value store with
a bound (:func:`exchange`): which steps every process can serve (from its own folders or from
the durable tier), so that a job whose host was replaced restores the newest step all of them
can read, the replaced one from the durable tier (:func:`agree_steps`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from cocijax.manager._cross_read import record_folder
from cocijax.manager._gc import quarantine

if TYPE_CHECKING:
    from cocijax.manager._checkpoint_manager import CheckpointManager

__all__ = [
    "HostsError",
    "agree_at_open",
    "agree_listed",
    "agree_memory",
    "agree_steps",
    "check_host_local",
    "drop_unagreed",
    "exchange",
    "own_process",
    "restore_together",
]

log = logging.getLogger(__name__)

# Exchanges are numbered in the order a process makes them: every process of a job opens its
# managers and waits for them in the same order, so the n-th exchange of each meets the
# others' n-th.
_EXCHANGES = itertools.count()


class HostsError(RuntimeError):
    """The processes of a job did not agree within the bound (names the processes)."""


def check_host_local(
    host_local: bool, options: ocp.CheckpointManagerOptions
) -> tuple[ocp.CheckpointManagerOptions, bool]:
    """The Orbax options of a manager with ``host_local``, and whether it is host-local (asked
    for, with several processes).

    With several processes each process's Orbax manager is its own primary, and alone (as the
    local managers of Orbax's emergency checkpointing).

    Raises:
      ValueError: ``host_local`` with ``options.multiprocessing_options`` set (which processes
        write is what ``host_local`` decides).
    """
    if not host_local:
        return options, False
    given = options.multiprocessing_options
    if given != ocp.options.MultiprocessingOptions():
        raise ValueError(
            "host_local=True: options.multiprocessing_options must be left unset (got "
            f"{given}): with host_local each process is the only writer of its own directory."
        )
    if jax.process_count() == 1:
        return options, False
    me = jax.process_index()
    mine = ocp.options.MultiprocessingOptions(
        primary_host=None,
        active_processes={me},
        barrier_sync_key_prefix=f"cocijax-host-{me}",
    )
    # Orbax signals "directories created" under a key of the job's distributed key-value store
    # that names the operation, not the process: one process would take another's signal and
    # write before its own directory exists (FileExistsError, seen under load). Made in
    # ``save`` itself instead (a few mkdirs), no signal is needed.
    sync_dirs = dataclasses.replace(
        options.async_options or ocp.options.AsyncOptions(),
        create_directories_asynchronously=False,
    )
    # The manager makes its directory itself (Orbax refuses to with ``active_processes``).
    local = dataclasses.replace(
        options, multiprocessing_options=mine, create=False, async_options=sync_dirs
    )
    return local, True


def own_process(
    options: ocp.CheckpointManagerOptions, directory: ocp.CheckpointManagerOptions
) -> ocp.CheckpointManagerOptions:
    """The memory tier's Orbax ``options`` made this process's own, as the host-local
    directory's ``directory`` options are (:func:`check_host_local`), with barrier keys of
    its own."""
    processes = directory.multiprocessing_options
    return dataclasses.replace(
        options,
        multiprocessing_options=dataclasses.replace(
            processes, barrier_sync_key_prefix=f"{processes.barrier_sync_key_prefix}-memory"
        ),
        async_options=directory.async_options,
        create=False,
    )


def exchange(what: str, payload: Any, *, timeout_s: float) -> list[Any]:
    """Every process's JSON ``payload``, by process index: an all-gather with a bound.

    Through JAX's distributed key-value store (not a device collective), so a process that
    never arrives makes the others fail within ``timeout_s`` rather than wait for JAX's
    heartbeat.

    Raises:
      HostsError: some process gave nothing within ``timeout_s`` (names them and ``what``).
    """
    client = ocp.multihost.get_jax_distributed_client()
    prefix = f"cocijax/hosts/{next(_EXCHANGES)}/"
    client.key_value_set(prefix + str(jax.process_index()), json.dumps(payload))
    answers: list[Any] = []
    missing = []
    for process in range(jax.process_count()):
        try:
            raw = client.blocking_key_value_get(prefix + str(process), int(timeout_s * 1000))
        except Exception as e:  # XlaRuntimeError: DEADLINE_EXCEEDED, or the service is gone
            missing.append(f"{process} ({type(e).__name__})")
            answers.append(None)
            continue
        answers.append(json.loads(raw))
    if missing:
        raise HostsError(
            f"{what}: process(es) {', '.join(missing)} gave no answer within {timeout_s:g} s "
            f"(store_timeout_s); this is process {jax.process_index()} of "
            f"{jax.process_count()}. Every process must open its managers and call "
            "wait_until_finished in the same order; a process that died or hangs must be "
            "restarted with the job."
        )
    return answers


def agree_steps(
    local: Sequence[int], durable: Sequence[int], *, directory: os.PathLike, timeout_s: float
) -> set[int]:
    """The steps every process can serve (from its own folders or the durable tier).

    Args:
      local: this process's committed local steps; ``durable``: the durable tier's.

    Returns:
      The steps every process can serve; the newest step some process lacks is logged.

    Raises:
      HostsError: a process did not answer within ``timeout_s``.
    """
    mine = sorted(set(local) | set(durable))
    answers = exchange(f"agreeing on the steps of {directory}", mine, timeout_s=timeout_s)
    each = [set(a) for a in answers]
    agreed = set.intersection(*each) if each else set()
    newest = max(set.union(*each), default=None)
    if newest is not None and newest not in agreed:
        log.warning(
            "%s: step %d is not servable by every process (per process: %s): the job resumes "
            "from step %s, the newest all of them can read",
            directory,
            newest,
            {p: max(s, default=None) for p, s in enumerate(each)},
            max(agreed, default=None),
        )
    return agreed


def agree_listed(mngr: CheckpointManager, timeout_s: float, *, refresh: bool) -> set[int]:
    """Hides from ``mngr``'s listing the steps some process cannot serve, so that every process
    lists the same steps and ``restore()`` resumes all of them from the same one.

    Collective: every process of the job calls it (at opening, and in
    ``wait_until_finished``). ``refresh`` lists the durable tier again first (another process
    may have committed or deleted steps there).

    Returns:
      The steps every process can serve.

    Raises:
      HostsError: a process did not answer within ``timeout_s``.
    """
    if mngr._memory is not None:
        agree_memory(mngr, timeout_s)
    # A memory step counts only where every process holds it (agree_memory).
    mine = set(mngr._local_steps()) | set(mngr._orbax_steps) | set(mngr.memory_steps())
    durable: list[int] = []
    if mngr._durable is not None:
        durable = mngr._durable.refreshed_steps() if refresh else mngr._durable.steps()
    agreed = agree_steps(mine, durable, directory=mngr._directory, timeout_s=timeout_s)
    mngr._hidden = (mine | set(durable)) - agreed
    return agreed


def agree_at_open(mngr: CheckpointManager, timeout_s: float) -> None:
    """Host-local: the processes agree on the steps all of them can serve (``_hosts``), then
    the durable tier drains the newest agreed local step if it lacks it (every process its own
    shards); nothing is drained before they agree. Each writer records its folder in the
    durable tier, for a job on another topology to read its copies (``_cross_read``)."""
    if mngr._durable is not None:
        # Process 0's name for this run of the job names every process's manifest parts.
        runs = exchange(
            f"agreeing on the run of {mngr._durable.url}",
            uuid.uuid4().hex[:16],
            timeout_s=timeout_s,
        )
        mngr._durable.share_run(runs[0])
        mngr._durable.open(None)
        if not mngr._read_only:
            record_folder(mngr)
    agreed = agree_listed(mngr, timeout_s, refresh=False)
    drop_unagreed(mngr, agreed)
    durable = mngr._durable.steps() if mngr._durable is not None else []
    newest = max(agreed & set(mngr._local_steps()), default=None)
    if mngr._durable is not None and newest is not None and newest > max(durable, default=-1):
        mngr._durable.offer(newest, force=True)


def drop_unagreed(mngr: CheckpointManager, agreed: set[int], *, durable: bool = True) -> None:
    """Removes what is left of the saves some process never finished: the steps newer than
    the newest step every process can serve (a process killed mid-save, a replaced host).

    The job resumes before them and saves those step numbers again, which must meet no stale
    part: this process's committed copies of them go (set aside instead, for inspection, when
    the processes agree on no step at all: then a process's folders may simply be missing),
    and process 0 removes their uncommitted prefixes from the durable tier. Called at opening,
    once every process answered: no process drains such a step before the job's next save,
    whose decision waits for process 0. Without ``durable`` (after the opening, when a drain
    may be writing those prefixes) the durable tier is left to its collection.
    """
    if mngr._read_only:
        return
    newest = max(agreed, default=None)
    after = -1 if newest is None else newest
    stale = [s for s in mngr._local_steps() if s in mngr._hidden and s > after]
    for step in stale:
        if newest is None:
            quarantine(mngr._step_dir(step), "no other process of the job holds this step")
        else:
            log.warning(
                "%s: deleting step %d, which not every process of the job committed (one was "
                "killed or replaced mid-save); the job resumes from step %d and saves it again",
                mngr._directory,
                step,
                newest,
            )
            mngr.orbax.delete(step)
        mngr._committed.discard(step)
        mngr._hidden.discard(step)
    if stale:
        mngr.orbax.reload()
    if durable and mngr._durable is not None:
        mngr._durable.remove_unfinished(after)


def agree_memory(mngr: CheckpointManager, timeout_s: float) -> set[int]:
    """Hides from ``mngr``'s memory listing the memory steps some process lacks, so that a
    step is restored from memory by every process or by none (a process whose host was
    rebooted or replaced lost its memory tier: the job then reads that step's disk or durable
    copy, every process alike).

    Collective (called by :func:`agree_listed`). A memory step committed after the agreement
    is listed as this process's own until the next one, as a local step is.

    Returns:
      The memory steps every process holds committed.

    Raises:
      HostsError: a process did not answer within ``timeout_s``.
    """
    held = mngr._memory.steps()
    answers = exchange(
        f"agreeing on the memory steps of {mngr._directory}", held, timeout_s=timeout_s
    )
    each = [set(a) for a in answers]
    everywhere = set.intersection(*each)
    lacking = {p: sorted(set(held) - s) for p, s in enumerate(each) if set(held) - s}
    if lacking:
        log.warning(
            "%s: memory step(s) %s are not in every process's memory tier (process(es) %s "
            "lack them: a rebooted or replaced host); they are restored from the disk or the "
            "durable tier, if at all",
            mngr._directory,
            sorted(set(held) - everywhere),
            sorted(lacking),
        )
    mngr._memory.unshared = set.union(*each) - everywhere
    return everywhere


def restore_together(
    mngr: CheckpointManager, restore_newest: Callable[[], Any], *, damage: tuple[type, ...]
) -> Any:
    """Restores the newest step every process can restore, on every process (collective).

    Each process restores the newest listed step from its own copies (memory, then local, then
    durable; with ``fallback``, older steps too), then they exchange the step each restored.
    A memory copy is checked only as it is read (its checksums), so a process may find its
    only copy of that step damaged (a level-1 step, in memory only): every process then hides
    that step and tries the next newest one. Likewise when they restored different steps
    (with ``fallback``, one process's copies of the newest step were damaged or lacked
    regions): every process hides the steps newer than the oldest of those and restores
    again, until all of them restore the same step.

    Args:
      restore_newest: this process's restore of the newest listed step (the manager's
        ``restored_step`` then says which step it restored).
      damage: the errors that make a step unservable here (any other ends the restore).

    Returns:
      What ``restore_newest`` returned for the step every process restored.

    Raises:
      HostsError: a process did not answer within ``store_timeout_s``, or another process
        failed otherwise than by damage (named, with its error), or no step is left.
      Exception: this process's own error, when it was not damage.
    """
    kept: tuple[int, Any] | None = None  # this process's restore of the step they go back to
    while True:
        tried = mngr.latest_step()
        restored, error, fatal = None, None, None
        try:
            # A step this process restored already is not read again (restored_step says it).
            restored = kept[1] if kept is not None and kept[0] == tried else restore_newest()
        except damage as e:
            error = e
        except Exception as e:
            error, fatal = e, f"{type(e).__name__}: {e}"
        step = mngr.restored_step if error is None else None
        verdict = {"tried": tried, "restored": step, "fatal": fatal}
        answers = exchange(f"restoring {mngr._directory}", verdict, timeout_s=mngr._store_timeout_s)
        if fatal is not None:
            raise error
        for process, answer in enumerate(answers):
            if answer["fatal"] is not None:
                raise HostsError(
                    f"restore: process {process} failed to restore step {answer['tried']} of "
                    f"its {mngr._directory}: {answer['fatal']}"
                )
        failed = {a["tried"] for a in answers if a["restored"] is None}
        steps = {a["restored"] for a in answers} - {None}
        if not failed and len(steps) == 1:
            return restored
        if not failed:  # every process restored a step, not the same: the oldest of them
            failed = {s for s in mngr.all_steps() if s > min(steps)}
            kept = (step, restored) if step == min(steps) else None
        mngr._hidden |= failed
        mngr._latest_saved = mngr.latest_step()  # the job resumes before them
        log.warning(
            "%s: step(s) %s could not be restored by every process (restored per process: "
            "%s): every process restores an older step",
            mngr._directory,
            sorted(failed),
            [a["restored"] for a in answers],
        )
        if mngr._latest_saved is None:
            if error is not None:
                raise error
            raise HostsError(
                f"restore: no step of {mngr._directory} is restorable by every process "
                f"(damaged on another: {sorted(failed)})."
            )
