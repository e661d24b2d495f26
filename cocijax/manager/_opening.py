"""How :class:`cocijax.CheckpointManager` opens: its arguments checked, then Orbax's manager built.

:func:`check_arguments` checks every argument before anything is touched (no directory made, no
lock taken, no store asked), so that bad input changes nothing. :func:`orbax_manager` builds the
``ocp.CheckpointManager`` the JAX manager composes: the striped handler for the ``state`` item,
the policy item's handler, and Orbax's options with cocijax's commit, listing and trash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from cocijax import storage
from cocijax._files import make_dirs
from cocijax._orbax_compat import orbax_reader_notice_dropped
from cocijax.core._collectives import from_primary
from cocijax.core._driver import manager_driver
from cocijax.core._history import RunHistory
from cocijax.core._identity import read_identity
from cocijax.core._lock import DirectoryLock
from cocijax.core._memory import MemoryOptions, check_memory, count_opening
from cocijax.core._preemption import PreemptionWatcher, check_signals
from cocijax.core._retention import BestN, MetricsCheck, Retention
from cocijax.core._session import run_all
from cocijax.manager import _closing
from cocijax.manager._directory import (
    POLICY_ITEM,
    STATE_ITEM,
    CommittedStepFormat,
    Layout,
    check_layout,
    merge_options,
    split_best,
)
from cocijax.manager._disk_copy import DiskCopy
from cocijax.manager._gc import Remover, quarantine
from cocijax.manager._hosts import agree_at_open, check_host_local, own_process
from cocijax.manager._identity import (
    check_directory,
    check_locations,
    open_identity,
)
from cocijax.manager._memory_tier import MemoryTier
from cocijax.manager._orbax_steps import OrbaxStep
from cocijax.manager._policy_item import PolicyStateHandler, PolicyStateRestore, PolicyStateSave
from cocijax.manager._restoring import load_policy
from cocijax.manager._saving import collect, save_in_flight
from cocijax.manager._tier_options import (
    check_roots_writable,
    check_timeout,
    manager_root,
    pin_steps,
)
from cocijax.manager._tiers import DurableTier, open_durable

if TYPE_CHECKING:
    from cocijax.manager._checkpoint_manager import CheckpointManager

__all__ = [
    "Opening",
    "check_arguments",
    "open_directory",
    "open_manager",
    "orbax_manager",
    "watcher",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Opening:
    """A manager's arguments, checked: what it opens with.

    Attributes:
      directory: the checkpoint directory, absolute.
      roots: the external roots (absolute paths, or ``KvPath`` on object stores).
      handler_options: keyword arguments of the striped handler (``store_timeout_s`` set).
      options: Orbax's options (best-N taken out, the drain's steps pinned).
      best: best-N retention, applied by the manager (None: ``max_to_keep`` is Orbax's).
      orbax_retention: with ``orbax_retention``, how many steps to keep counting those Orbax
        wrote; None: Orbax's steps are never deleted.
      signals: the preemption signals.
      exit_on_preemption: end the process after the preemption save (see ``_preemption``).
      make_driver: makes the policy driver once the history is open.
      durable: the durable tier (not opened yet), or None.
      store_timeout_s: the bound on waits for an object store.
      clock: the manager's monotonic clock.
      memory: the memory tier's options (not opened yet), or None.
      host_local: each process has its own directory and roots (``_hosts``).
    """

    directory: Path
    roots: tuple[Path | storage.KvPath, ...]
    handler_options: dict[str, Any]
    options: ocp.CheckpointManagerOptions
    best: Retention | None
    orbax_retention: int | None
    signals: tuple[signal.Signals, ...]
    exit_on_preemption: bool
    make_driver: Callable[..., Any]
    durable: DurableTier | None
    store_timeout_s: float
    clock: Callable[[], float]
    memory: MemoryOptions | None = None
    host_local: bool = False

    @property
    def primary_host(self) -> int | None:
        return self.options.multiprocessing_options.primary_host

    @property
    def primary(self) -> bool:
        """This process deletes and marks (Orbax's primary host; host-local: every process, in
        its own directory)."""
        return self.host_local or jax.process_index() == (self.primary_host or 0)


def check_arguments(
    directory: Any,
    *,
    roots: Sequence[str | os.PathLike[str]] | None,
    policy: Any,
    max_to_keep: int | None,
    keep_period: int | None,
    preservation_policy: Any,
    best_fn: Callable[[Any], Any] | None,
    best_mode: str,
    keep_latest: int,
    preemption_signals: Any,
    exit_on_preemption: bool,
    options: ocp.CheckpointManagerOptions | None,
    handler_options: dict[str, Any] | None,
    prior_mtbf_s: float | None,
    clock: Callable[[], float],
    durable: Any,
    durable_every: int,
    durable_max_to_keep: int | None,
    durable_options: dict[str, Any] | None,
    orbax_retention: bool,
    store_timeout_s: float,
    memory: Any = None,
    memory_bytes: Any = None,
    host_local: bool = False,
) -> Opening:
    """Checks a :class:`cocijax.CheckpointManager`'s arguments (see its docstring).

    Raises:
      TypeError, ValueError: as the manager's docstring says, naming the argument.
    """
    path = check_directory(directory)
    handler_options = {"store_timeout_s": check_timeout(store_timeout_s), **(handler_options or {})}
    root_options = handler_options.get("root_options")
    timeout_s = handler_options["store_timeout_s"]
    manager_roots = tuple(manager_root(r, root_options, timeout_s=timeout_s) for r in roots or ())
    for name, value in (
        ("exit_on_preemption", exit_on_preemption),
        ("orbax_retention", orbax_retention),
        ("host_local", host_local),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}.")
    merged = merge_options(
        options, max_to_keep=max_to_keep, keep_period=keep_period,
        preservation_policy=preservation_policy,
    )  # fmt: skip
    orbax_options, best = split_best(merged, best_fn=best_fn, best_mode=best_mode)
    retention = None
    if best is not None:
        rule = BestN(
            best[0],
            best_mode=best[1],
            max_to_keep=merged.max_to_keep,
            keep_latest=keep_latest,
            keep_period=merged.keep_period,
        )
        retention = Retention(rule, max_to_keep=None)
    signals = check_signals(preemption_signals)
    make_driver = manager_driver(policy, prior_mtbf_s, clock=clock)
    # Host-local only: one shared directory's step is one Orbax commit (docs/manager.md, Limits).
    hint = "Pass host_local=True (a memory tier per process) with a durable= tier, or no memory=."
    processes = 1 if host_local else jax.process_count()
    memory_options = check_memory(memory, memory_bytes, path, processes=processes, hint=hint)
    orbax_options, several = check_host_local(host_local, orbax_options)
    if several:
        handler_options["host_local"] = True
    primary = several or jax.process_index() == (
        orbax_options.multiprocessing_options.primary_host or 0
    )
    tier = open_durable(
        durable,
        durable_options,
        every=durable_every,
        max_to_keep=durable_max_to_keep,
        local=path,
        step_name=orbax_options.step_name_format.build_name,
        source_options=root_options,
        writer=not orbax_options.read_only and primary,
        clock=clock,
        timeout_s=store_timeout_s,
        process=jax.process_index() if several else None,
        processes=jax.process_count(),
    )
    memory_root = None if memory_options is None else memory_options.root
    check_locations(path, manager_roots, None if tier is None else tier.root, memory_root)
    if not orbax_options.read_only:
        # Before the directory is opened: its identity is read from and written to each root.
        check_roots_writable(manager_roots, timeout_s)
    if tier is not None:
        orbax_options = pin_steps(orbax_options, tier.pinned)  # the drain's steps are kept
    return Opening(
        directory=path,
        roots=manager_roots,
        handler_options=handler_options,
        options=orbax_options,
        best=retention,
        orbax_retention=merged.max_to_keep if orbax_retention else None,
        signals=signals,
        exit_on_preemption=exit_on_preemption,
        make_driver=make_driver,
        durable=tier,
        store_timeout_s=store_timeout_s,
        clock=clock,
        memory=memory_options,
        host_local=several,
    )


def orbax_manager(
    opening: Opening,
    stripe_roots: Sequence[Path | storage.KvPath],
    layout: Layout,
    step_format: CommittedStepFormat | None = None,
) -> ocp.CheckpointManager:
    """Orbax's manager of the directory, with the striped handler writing ``stripe_roots``;
    its first listing takes the steps ``layout`` found committed (through ``step_format``,
    made from ``layout`` when not given)."""
    read_only = opening.options.read_only
    handler = storage.StripedCheckpointHandler(
        # A reader needs no roots (the manifest names them) and must not create them.
        roots=[] if read_only else list(stripe_roots),
        **opening.handler_options,
    )
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, storage.StripedSave, handler)
    registry.add(STATE_ITEM, storage.StripedRestore, handler)
    policy_handler = PolicyStateHandler(primary_host=opening.primary_host)
    registry.add(POLICY_ITEM, PolicyStateSave, policy_handler)
    registry.add(POLICY_ITEM, PolicyStateRestore, policy_handler)
    if step_format is None:
        step_format = CommittedStepFormat(checked=dict(layout.committed))
    options = dataclasses.replace(opening.options, step_name_format=step_format)
    with orbax_reader_notice_dropped():
        return ocp.CheckpointManager(opening.directory, options=options, handler_registry=registry)


def watcher(opening: Opening) -> PreemptionWatcher:
    """The preemption watcher of a JAX job: flags exchanged, or JAX's service, across processes.

    A reader takes no preemption save: it watches no signal.
    """
    allgather = service = None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        allgather = multihost_utils.process_allgather
        if jax.config.jax_enable_preemption_service:
            service = ocp.multihost.reached_preemption
    return PreemptionWatcher(
        () if opening.options.read_only else opening.signals,
        owner=str(opening.directory),
        allgather=allgather,
        service=service,
        exit_on_preemption=opening.exit_on_preemption,
    )


def open_directory(mngr: CheckpointManager, opening: Opening, age: float | None) -> None:
    """What opening does once the directory exists (and is locked, for the writer).

    The writer reads the steps down to the newest committed one only; the older ones are
    checked (set aside if damaged) when every step is first needed (``check_deferred``).
    """
    # Only where Orbax's own opening reads no step either (``lightweight_initialize``): its
    # retention by time or by a preservation policy needs every step's time and metrics.
    lazy = mngr._lock is not None and opening.options.lightweight_initialize
    layout = check_layout(mngr._directory, lazy=lazy)
    mngr._step_format = CommittedStepFormat(
        checked=dict(layout.committed), deferred=layout.deferred
    )
    for entry, problem in layout.damaged:
        if mngr._lock is not None:
            quarantine(entry, problem)
        else:
            log.warning("%s is not listed: %s", entry, problem)
    mngr._orbax_steps = layout.orbax
    mngr._committed = {int(path.name) for path in layout.committed}  # checked: not again
    if mngr._orbax_steps:
        log.info(
            "%s holds steps written by Orbax's CheckpointManager (%s): listed and restored "
            "through Orbax's handlers; new steps are saved in cocijax's format",
            mngr._directory,
            sorted(mngr._orbax_steps),
        )
    namespace = _namespace(mngr)
    # Every writer's opening counts: a memory tier's snapshots saved before an opening without
    # it are not restored (check_owner).
    count = None if mngr._lock is None else count_opening(mngr._directory)
    if namespace is not None:
        mngr._stripe_roots = tuple(root / namespace for root in mngr._roots)
        if opening.memory is not None:
            newest = max(mngr._committed | set(mngr._orbax_steps), default=None)
            mngr._memory = _open_memory(opening, namespace, mngr._directory, count, newest)
    # Only the primary writer marks the directory; every process reads the history saved
    # with the checkpoints (process 0's measurements reach the policy anyway).
    writer = mngr._lock is not None
    mngr._history = RunHistory(
        mngr._directory,
        clock=mngr._clock,
        writer=writer,
        opened_at_age_s=age,
        memory_marker=mngr._memory.marker if writer and mngr._memory is not None else None,
    )
    mngr._driver = opening.make_driver(
        history=mngr._history,
        # Compiled from the first save on (below); never by a reader, which never decides: a
        # compile per opening cost a reader opening managers in a loop seconds of CPU each.
        compile_now=False,
        drain_s=None if mngr._durable is None else (lambda: mngr._durable.drain_s),
    )
    mngr.orbax = orbax_manager(opening, mngr._stripe_roots, layout, mngr._step_format)
    collect(mngr)  # before the copies below: it removes a killed copy's folder
    if mngr._memory is not None and writer:
        mngr._copy = DiskCopy(
            mngr._memory.path,
            mngr._directory,
            mngr._name_format.build_name,
            roots=mngr._stripe_roots,
            timeout_s=mngr._store_timeout_s,
        )
        mngr._copy.finish_pending()  # persisted steps a killed run left in memory only
        if mngr._copy.take_committed():
            mngr.orbax.reload()
    if mngr._host_local:
        agree_at_open(mngr, opening.store_timeout_s)
    elif mngr._durable is not None:
        mngr._durable.open(max(mngr._local_steps(every=False), default=None))
    latest = mngr.latest_step()
    mngr._history.adopt(None)
    if latest is None and mngr._lock is not None:
        log.info("no checkpoint in %s: starting at step 1", mngr._directory)
    if latest is not None:
        where = "local" if latest in mngr._local_steps(every=False) else "durable"
        where = "orbax" if latest in mngr._orbax_steps else where
        where = "memory" if latest in mngr.memory_steps() else where
        load_policy(mngr, latest, where=where, stacklevel=3, history=True)
    elif not mngr._read_only:  # else the first save: a restart's restore and own compile
        mngr._driver.compile_in_background()  # waited for its GIL and core (resume_bench)
    mngr._latest_saved = latest


def _open_memory(
    opening: Opening, namespace: str, directory: Path, count: int | None, newest: int | None
) -> MemoryTier:
    """The memory tier, its Orbax manager built as the directory's (data in its steps)."""

    def make_manager(path: Path, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
        if opening.host_local:  # this process's own manager, as the directory's
            options = own_process(options, opening.options)
        return orbax_manager(
            dataclasses.replace(opening, directory=path, options=options), (), check_layout(path)
        )

    return MemoryTier(
        opening.memory,
        namespace,
        directory=directory,
        make_manager=make_manager,
        read_only=opening.options.read_only,
        enable_async=opening.options.enable_async_checkpointing,
        opening=count,
        newest_on_disk=newest,
    )


def _namespace(mngr: CheckpointManager) -> str | None:
    """The name of this directory's folder on each root (None for a reader without one).

    The primary writer reads or makes the directory's identity (``_identity``); the other
    processes of a job take it from the primary, which holds the lock meanwhile.
    """
    namespace = None
    if mngr._lock is not None:
        namespace = open_identity(mngr._directory, mngr._roots).namespace
    elif mngr._read_only:
        identity = read_identity(mngr._directory)
        namespace = None if identity is None else identity.namespace
    if jax.process_count() > 1 and not mngr._read_only and not mngr._host_local:
        namespace = from_primary(namespace, is_source=mngr._primary)
    return namespace


def open_manager(mngr: CheckpointManager, opening: Opening, age: float | None) -> None:
    """Sets up ``mngr`` from its checked arguments: its directory made and locked (a writer),
    then opened (:func:`open_directory`); on any error, what was opened is closed again and
    the lock released, and the error of the opening is the one raised."""
    mngr._directory = opening.directory
    mngr._roots = opening.roots
    mngr._paths = (opening.directory, *opening.roots)  # what an error names a path under
    mngr._stripe_roots: tuple[Path | storage.KvPath, ...] = ()  # once the identity is known
    mngr._clock = opening.clock
    mngr._closed = False
    mngr._lock: DirectoryLock | None = None
    mngr._history: RunHistory | None = None
    mngr._committed: set[int] = set()
    mngr._step_format = CommittedStepFormat()  # Orbax's, with what the opening left unread
    # (step, tier) whose saved policy state the driver holds, as adopted (load_policy).
    mngr._adopted: tuple[int, str] | None = None
    mngr._orbax_steps: dict[int, OrbaxStep] = {}  # steps Orbax's own manager wrote
    # Deletions run off the training thread, between saves (see Remover).
    mngr._remover = Remover(writing=lambda: save_in_flight(mngr))
    mngr._store_timeout_s = opening.store_timeout_s
    mngr._save_started = False
    mngr._best = opening.best
    mngr._orbax_retention = opening.orbax_retention
    # A step saved without metrics is said once per manager.
    mngr._check_metrics = MetricsCheck(mngr._best and mngr._best.best)
    mngr._read_only = opening.options.read_only
    mngr._async = opening.options.enable_async_checkpointing
    mngr._name_format = opening.options.step_name_format
    mngr._primary = opening.primary
    mngr._host_local = opening.host_local
    mngr._hidden: set[int] = set()  # host-local: steps not every process can serve
    mngr._durable = opening.durable  # None without one; opened below
    mngr._memory: MemoryTier | None = None  # opened once the identity is known
    mngr._copy: DiskCopy | None = None  # the memory tier's persisted steps to the disk
    if not mngr._read_only:
        make_dirs(mngr._directory)  # durably: a power loss must not lose it
    elif not mngr._directory.is_dir():
        raise FileNotFoundError(f"directory: {mngr._directory} does not exist.")
    if not mngr._read_only and mngr._primary:
        mngr._lock = DirectoryLock(mngr._directory)
        mngr._lock.acquire()
    try:
        open_directory(mngr, opening, age)
    except BaseException:
        # The lock is released even when closing Orbax or the drain fails too; the error
        # of the open is the one raised.
        with contextlib.suppress(Exception):
            orbax, tier, memory = getattr(mngr, "orbax", None), mngr._durable, mngr._memory
            run_all(
                _nothing if orbax is None else orbax.close,
                _nothing if tier is None else tier.close,
                _nothing if memory is None else memory.close,
                lambda: _closing.release(mngr),
            )
        raise


def _nothing() -> None:
    pass
