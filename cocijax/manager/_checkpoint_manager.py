"""``CheckpointManager``: a policy decides when to save, the striped handler writes, Orbax manages.

The manager composes an ``ocp.CheckpointManager`` (exposed as ``.orbax``) that holds, per step,
``state`` (the training state, written by :class:`cocijax.StripedCheckpointHandler`), ``policy``
(the policy's state and the job's measurements, see ``_policy_item``), the step's ``metrics``
in Orbax's own format when there are any, and the caller's ``extra`` items (any Orbax args:
JSON, pytrees, a Grain iterator). Orbax keeps doing what it already does well: atomic commit of
step directories, asynchronous finalisation, ``max_to_keep``/``keep_period``/preservation
policies. The manager adds what Orbax cannot know:

* **When to save.** ``save`` is called every step; a :mod:`cocijax.policies` policy decides, fed
  by the shared driver (``_driver``) with times it measures itself and the job's failure rate
  and recovery time, learned from the directory's history (``_history``).
* **Stripes outside the step directory.** With external ``roots`` a step's data lives on other
  file systems, so deleting the step directory is not enough: the stripes no committed step
  references are removed (``_gc``) after each save has finished and at start-up.
* **Best-N that keeps the newest steps** (``_retention``), and **preemption saves**
  (``_preemption``): a signal makes the next ``save`` save and wait for the commit.

Orbax is configured to *rename* steps it deletes into ``.cocijax-deleted/`` (its
``todelete_subdir`` option) instead of deleting them file by file, so a crash in the middle of a
deletion never leaves a listed step with half its files; the manager empties that directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, final

import jax
import numpy as np
import orbax.checkpoint as ocp

from cocijax import storage
from cocijax._files import make_dirs, move_aside
from cocijax.core._contract import (
    MEASUREMENTS,
    POLICY_STATE,
    ManagerClosedError,
    StepDeletedError,
    check_step,
    check_step_order,
)
from cocijax.core._driver import manager_driver, stage_loss, tree_nbytes
from cocijax.core._history import RunHistory, failed_exit, process_age_s
from cocijax.core._lock import DirectoryLock
from cocijax.core._preemption import Preemption, PreemptionWatcher, check_signals
from cocijax.core._retention import BestN, MetricsCheck, Retention
from cocijax.core._session import restore_order, run_all
from cocijax.manager._directory import (
    METRICS_ITEM,
    POLICY_ITEM,
    STATE_ITEM,
    TRASH_DIR,
    check_extra,
    check_layout,
    checked_once,
    is_committed,
    list_committed,
    merge_options,
    orbax_reader_notice_dropped,
    split_best,
)
from cocijax.manager._faults import naming, retry_deletions, wait
from cocijax.manager._gc import Remover, collect_garbage, quarantine
from cocijax.manager._identity import (
    check_directory,
    check_locations,
    open_identity,
    read_identity,
)
from cocijax.manager._orbax_steps import OrbaxStep, restore_orbax_step
from cocijax.manager._policy_item import PolicyStateHandler, PolicyStateRestore, PolicyStateSave
from cocijax.manager._tier_options import check_timeout, manager_root, pin_steps
from cocijax.manager._tiers import open_durable
from cocijax.storage._tree import check_tree

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


@final
class CheckpointManager:
    """Saves a training state when a cocijax policy says so, through striped async writes.

    Call :meth:`save` after every training step; it returns True when it started a save.

    What the manager measures and feeds the policy (no extra user input):

    * **step time**: the time between consecutive ``save`` calls, minus the time a save blocked.
      The first step after opening or :meth:`restore` is not timed (it usually includes
      compilation): the policy is given the step time saved with the checkpoint, or NaN
      ("unknown") in a fresh directory. The policy gets the median of the last three (one
      pause is never taken for the job's pace; see ``cocijax.core._driver``).
    * **checkpoint cost**: the blocking time of a save, including the wait for the previous
      asynchronous save if it was still running (a real stall of training); the median of the
      last three. Until one is measured, a cost from the state's size; and the first timed
      step (the second) is saved to measure it, unless the policy does not use it (``fixed``).
    * **loss, one step late**: ``loss`` may be an unfinished ``jax.Array``. ``save`` starts its
      copy to host and the policy sees each loss with the next step, read only at the policy's
      next check (see :class:`cocijax.policies.Runner`): a step that cannot save costs no device
      sync. A NaN/inf loss is passed on; policies ignore it.
    * **failure rate and recovery time**, learned from the job itself: the directory is marked
      as running while open; opening one whose previous run did not close (or left its
      ``with`` block by an exception) counts a failure; uptime and failures are saved with
      every checkpoint, and the MTBF given to the policy is the posterior mean of a
      Gamma-Poisson model with ``prior_mtbf_s`` as a prior worth one failure. The recovery
      time is measured from the process start to the first step after a :meth:`restore`. A
      policy built with its own ``mtbf_s``/``recovery_s`` keeps them.

    The policy state and these measurements are saved with every checkpoint (item ``policy``)
    and reloaded from the newest step when the manager opens (and from the restored step by
    :meth:`restore`), so a restarted job continues its schedule. A policy that knows the job's
    ``total_steps`` saves the last step, so a finished job keeps its final state; otherwise pass
    ``force=True`` at the last step.

    **Preemption.** While the manager is open (in the main thread), ``preemption_signals``
    (default SIGTERM) are caught; the next :meth:`save` saves its step whatever the policy
    says and waits until it is committed. Then, by default, the managers of the process are
    closed and the signal ends the process as it would have without cocijax (exit status
    143 for SIGTERM); with ``exit_on_preemption=False`` it returns True and sets
    :attr:`reached_preemption`: leave the loop then. Several managers in one process each take
    their preemption save. With several processes every one of them takes that save at the same step
    (JAX's preemption service through Orbax where it is on, else a flag exchange, see
    ``_preemption``). The previous handlers are back after :meth:`close`.

    In a multi-process job every process calls ``save``; the measured values are broadcast from
    process 0 before they reach the policy, so every process takes the same decision. Only the
    primary process deletes anything.

    Args:
      directory: where Orbax keeps step directories (created if missing).
      roots: storage roots the state is striped over. ``None`` (default) keeps the data inside
        each step directory, so Orbax's atomic commit and deletion cover it.
      policy: a :mod:`cocijax.policies` policy; default ``cj.policies.coci()``.
      max_to_keep: keep at most this many steps (Orbax option); with ``best_fn``, this many
        of the best steps.
      keep_period: also keep every step that is a multiple of this (Orbax option).
      preservation_policy: an Orbax preservation policy, instead of the two above.
      best_fn: ranks a step by its ``metrics`` (a dict -> a number): the ``max_to_keep`` best
        steps are kept, and the ``keep_latest`` newest ones whatever their metrics (unlike
        Orbax's ``best_fn``, which may delete the newest step). A step saved without
        ``metrics`` is not ranked: it is kept only while it is one of the newest. Also
        accepted as ``options.best_fn``.
      best_mode: ``"max"`` (default) or ``"min"``: whether larger ``best_fn`` values are better.
      keep_latest: with ``best_fn``, the newest steps kept whatever their metrics (default 1;
        0 ranks every step, as Orbax does).
      preemption_signals: the signals that announce a preemption (default SIGTERM); ``()``
        turns preemption saves off.
      exit_on_preemption: once the preemption save has committed (and every other open
        manager of the process has taken its own), close the managers and let the signal end
        the process as it would have without cocijax (SIGTERM: exit status 143), or call the
        handler that was installed before. ``False``: ``save`` returns True, sets
        :attr:`reached_preemption`, and the loop leaves itself.
      options: any other ``ocp.CheckpointManagerOptions`` (e.g. ``enable_async_checkpointing``,
        ``read_only``). Options that decide when to save (``save_decision_policy``,
        ``should_save_fn``, ``save_on_steps``) and step naming (``step_prefix``,
        ``step_format_fixed_length``, ``step_name_format``) are not supported.
      handler_options: keyword arguments for :class:`cocijax.StripedCheckpointHandler`.
      prior_mtbf_s: the MTBF the learned estimate starts from; default 24 h divided by
        ``jax.device_count()``.
      clock: monotonic clock in seconds; injectable for deterministic tests.
      durable: a second, durable tier: an object-store URL (``s3://bucket/run42``,
        ``gs://bucket/run42``) or a path (a shared or network file system). After a step
        commits locally, a background thread copies it there (pieces, manifest, policy,
        metrics and extra items; every checksum checked; the durable manifest last); a
        ``save`` never waits for it. While a drain runs, only the newest committed step is
        drained next. ``all_steps``/``latest_step``/``restore`` cover both tiers.
      durable_every: drain every ``durable_every``-th saved step (a preemption save always).
      durable_max_to_keep: steps kept on the durable tier (``None``: all); its newest
        committed step is never deleted.
      durable_options: TensorStore kvstore options for an object-store ``durable``, e.g.
        ``{"endpoint": "http://127.0.0.1:9000", "aws_region": "us-east-1"}``.
      orbax_retention: steps that Orbax's own ``CheckpointManager`` wrote in ``directory``
        (a job switching to cocijax) count in ``max_to_keep``: the oldest are deleted as new
        steps are saved. Default: they are listed and restored, never deleted.
      store_timeout_s: the longest any single wait for an object store may take: probing the
        roots and the durable tier at construction (an unreachable endpoint, a missing bucket
        or missing credentials raise within it, naming the URL and the cause), each request
        of the durable tier's own, and ``close()``'s wait for a drain that makes no progress
        (then abandoned, the step named in a warning; it stays on the local tier).

    Raises:
      ValueError: ``directory`` holds files or steps cocijax did not write, options conflict,
        ``best_mode``/``keep_latest``/``preemption_signals``/``durable_every``/
        ``durable_max_to_keep``/``store_timeout_s`` are out of range, ``durable`` has an
        unsupported URL scheme or options TensorStore refuses, or an object-store root cannot
        be written within ``store_timeout_s``.
      TypeError: ``best_fn`` is not callable, ``preemption_signals`` is not a sequence of
        signals, or a ``durable*`` argument or ``store_timeout_s`` has the wrong type.
      DurableTierError: the durable tier cannot be listed (or written, by the writer) within
        ``store_timeout_s``: its steps may be newer than the local ones.
      DirectoryLockedError: another manager has the directory open for writing.

    Example:
      >>> import jax.numpy as jnp, tempfile, cocijax as cj
      >>> state = {"w": jnp.zeros(4)}
      >>> with cj.CheckpointManager(tempfile.mkdtemp(), policy=cj.policies.fixed(100)) as mngr:
      ...     saved = [s for s in range(1, 301) if mngr.save(s, state, loss=1.0 / s)]
      >>> saved
      [100, 200, 300]
    """

    # Orbax lists the steps as it opens, and so does the manager: each step's manifest is read
    # and checked once in here (3 steps: 14 reads before, now 6; Orbax reads each step's
    # metrics in threads of its own, which check again).
    @checked_once()
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        roots: Sequence[str | os.PathLike[str]] | None = None,
        policy: Any = None,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        preservation_policy: Any = None,
        best_fn: Callable[[Any], Any] | None = None,
        best_mode: str = "max",
        keep_latest: int = 1,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        exit_on_preemption: bool = True,
        options: ocp.CheckpointManagerOptions | None = None,
        handler_options: dict[str, Any] | None = None,
        prior_mtbf_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        durable: str | os.PathLike[str] | None = None,
        durable_every: int = 1,
        durable_max_to_keep: int | None = None,
        durable_options: dict[str, Any] | None = None,
        orbax_retention: bool = False,
        store_timeout_s: float = 30.0,
    ):
        age = process_age_s()
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(
                f"directory: expected a path (str or os.PathLike), got {type(directory).__name__}."
            )
        self._directory = check_directory(directory)
        root_options = (handler_options or {}).get("root_options")
        self._roots = tuple(manager_root(r, root_options) for r in roots) if roots else ()
        # Where this directory stripes on each root: known once its identity is (below).
        self._stripe_roots: tuple[Path | storage.KvPath, ...] = ()
        self._clock = clock
        self._closed = False
        self._lock: DirectoryLock | None = None
        self._history: RunHistory | None = None
        self._committed: set[int] = set()
        self._orbax_steps: dict[int, OrbaxStep] = {}  # steps Orbax's own manager wrote
        self._remover = Remover()  # deletions run off the training thread
        self._store_timeout_s = store_timeout_s
        self._save_started = False
        options = merge_options(
            options,
            max_to_keep=max_to_keep,
            keep_period=keep_period,
            preservation_policy=preservation_policy,
        )
        orbax_options, best = split_best(options, best_fn=best_fn, best_mode=best_mode)
        if not isinstance(orbax_retention, bool):
            raise TypeError(f"orbax_retention: expected a bool, got {orbax_retention!r}.")
        # How many steps to keep, counting those Orbax wrote (None: Orbax's steps are kept).
        self._orbax_retention = options.max_to_keep if orbax_retention else None
        self._best = None  # best-N; max_to_keep alone is Orbax's
        if best is not None:
            rule = BestN(
                best[0],
                best_mode=best[1],
                max_to_keep=options.max_to_keep,
                keep_latest=keep_latest,
                keep_period=options.keep_period,
            )
            self._best = Retention(rule, max_to_keep=None)
        options = orbax_options
        signals = check_signals(preemption_signals)
        if not isinstance(exit_on_preemption, bool):
            raise TypeError(f"exit_on_preemption: expected a bool, got {exit_on_preemption!r}.")
        # A step saved without metrics is said once per manager.
        self._check_metrics = MetricsCheck(self._best and self._best.best)
        self._read_only = options.read_only
        self._async = options.enable_async_checkpointing
        self._name_format = options.step_name_format
        self._primary = jax.process_index() == (options.multiprocessing_options.primary_host or 0)
        make_driver = manager_driver(policy, prior_mtbf_s, clock=clock)
        # The durable tier (None without one): its drain pins the steps it still needs.
        self._durable = open_durable(
            durable,
            durable_options,
            every=durable_every,
            max_to_keep=durable_max_to_keep,
            local=self._directory,
            step_name=options.step_name_format.build_name,
            source_options=root_options,
            writer=not options.read_only and self._primary,
            clock=clock,
            timeout_s=store_timeout_s,
        )
        check_locations(self._directory, self._roots, getattr(self._durable, "root", None))
        if self._durable is not None:
            options = pin_steps(options, self._durable.pinned)

        if not self._read_only:
            make_dirs(self._directory)  # durably: a power loss must not lose it
        elif not self._directory.is_dir():
            raise FileNotFoundError(f"directory: {self._directory} does not exist.")
        if not self._read_only and self._primary:
            self._lock = DirectoryLock(self._directory)
            self._lock.acquire()
        try:
            layout = check_layout(self._directory)
            for entry, problem in layout.damaged:
                if self._lock is not None:
                    quarantine(entry, problem)
                else:
                    log.warning("%s is not listed: %s", entry, problem)
            self._orbax_steps = layout.orbax
            if self._orbax_steps:
                log.info(
                    "%s holds steps written by Orbax's CheckpointManager (%s): listed and "
                    "restored through Orbax's handlers; new steps are saved in cocijax's format",
                    self._directory,
                    sorted(self._orbax_steps),
                )
            namespace = self._namespace(options.multiprocessing_options.primary_host)
            if namespace is not None:
                self._stripe_roots = tuple(root / namespace for root in self._roots)
            # Only the primary writer marks the directory; every process reads the history
            # saved with the checkpoints (process 0's measurements reach the policy anyway).
            self._history = RunHistory(
                self._directory,
                clock=clock,
                writer=self._lock is not None,
                opened_at_age_s=age,
            )
            self._driver = make_driver(
                history=self._history,
                # A reader never decides: a compile per opening cost seconds of CPU each (a
                # reader opening managers in a loop ran long past its loop, compiling).
                compile_now=not self._read_only,
                drain_s=None if self._durable is None else self._last_drain_s,
            )
            handler = storage.StripedCheckpointHandler(
                # A reader needs no roots (the manifest names them) and must not create them.
                roots=[] if self._read_only else list(self._stripe_roots),
                **{"store_timeout_s": check_timeout(store_timeout_s), **(handler_options or {})},
            )
            registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
            registry.add(STATE_ITEM, storage.StripedSave, handler)
            registry.add(STATE_ITEM, storage.StripedRestore, handler)
            policy_handler = PolicyStateHandler(
                primary_host=options.multiprocessing_options.primary_host
            )
            registry.add(POLICY_ITEM, PolicyStateSave, policy_handler)
            registry.add(POLICY_ITEM, PolicyStateRestore, policy_handler)
            with orbax_reader_notice_dropped():
                self.orbax = ocp.CheckpointManager(
                    self._directory, options=options, handler_registry=registry
                )
            self._collect_garbage()
            if self._durable is not None:
                self._durable.open(max(self._local_steps(), default=None))
            latest = self.latest_step()
            self._history.adopt(None)
            if latest is None and self._lock is not None:
                log.info("no checkpoint in %s: starting at step 1", self._directory)
            if latest is not None:
                where = "local" if latest in self._local_steps() else "durable"
                where = "orbax" if latest in self._orbax_steps else where
                self._load_policy(latest, history=True, where=where)
            self._latest_saved = latest
        except BaseException:
            # The lock is released even when closing Orbax or the drain fails too; the error
            # of the open is the one raised.
            with contextlib.suppress(Exception):
                orbax = getattr(self, "orbax", None)
                tier = self._durable
                run_all(
                    _nothing if orbax is None else orbax.close,
                    _nothing if tier is None else tier.close,
                    self._release,
                )
            raise
        self._pending_loss: Any = None
        self._restored_step: int | None = None
        watcher = _watcher(() if self._read_only else signals, self._directory, exit_on_preemption)
        watcher.install(on_end=self.close)
        self._preemption = Preemption(watcher, owner=str(self._directory))

    def _release(self) -> None:
        """Removes the running marker (a clean end), then releases the lock, whatever fails.

        In this order: once the lock is free another writer may open and write its own marker.
        """
        run_all(
            self._history.close if self._history is not None else _nothing,
            self._lock.release if self._lock is not None else _nothing,
        )

    def _namespace(self, primary_host: int | None) -> str | None:
        """The name of this directory's folder on each root (None for a reader without one).

        The primary writer reads or makes the directory's identity (``_identity``); the other
        processes of a job take it from the primary, which holds the lock meanwhile.
        """
        if self._lock is not None:
            namespace = open_identity(self._directory, self._roots).namespace
        elif self._read_only:
            identity = read_identity(self._directory)
            namespace = None if identity is None else identity.namespace
        else:
            namespace = None
        if jax.process_count() > 1 and not self._read_only:
            namespace = _from_primary(namespace, is_source=self._primary)
        return namespace

    def _last_drain_s(self) -> float:
        return self._durable.drain_s

    # -- listing ----------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def roots(self) -> tuple[Path | storage.KvPath, ...]:
        """The external storage roots (empty when the data lives in the step directories);
        ``KvPath`` for object-store roots."""
        return self._roots

    @property
    def stripe_roots(self) -> tuple[Path | storage.KvPath, ...]:
        """Where this directory's stripes go: one folder per root, private to this directory."""
        return self._stripe_roots

    policy_state = POLICY_STATE
    measurements = MEASUREMENTS

    @property
    def restored_step(self) -> int | None:
        """The step the last :meth:`restore` returned (useful with ``fallback=True``)."""
        return self._restored_step

    @property
    def reached_preemption(self) -> bool:
        """A preemption signal arrived and its step has been saved and committed: stop now."""
        return self._preemption.reached

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The ``metrics`` saved with ``step`` (``None`` if it was saved without), as Orbax's."""
        return self.orbax.metrics(step)

    def all_steps(self) -> list[int]:
        """Committed steps of both tiers, oldest first: a save still in flight is not listed.

        A read-only manager lists the directory afresh at every call: it follows a writer in
        another process, whose new steps Orbax's cached listing would not show.
        """
        durable = self._durable.steps() if self._durable is not None else []
        return sorted(set(self._local_steps()) | set(durable) | set(self._orbax_steps))

    def durable_steps(self) -> list[int]:
        """Steps committed on the durable tier, oldest first (``[]`` without one)."""
        return self._durable.steps() if self._durable is not None else []

    def _local_steps(self) -> list[int]:
        """Committed steps of the local tier, oldest first."""
        if self._read_only:
            self._committed = set(list_committed(self._directory, frozenset(self._committed)))
            return sorted(self._committed)
        # Orbax lists a step as soon as its save starts; committed means the manifest is there.
        # A manifest, once valid, stays so: each step directory is read once.
        steps = sorted(self.orbax.all_steps())
        self._committed &= set(steps)
        for step in steps:
            if step not in self._committed and is_committed(
                self._directory / self._name_format.build_name(step)
            ):
                self._committed.add(step)
        return [step for step in steps if step in self._committed]

    def latest_step(self) -> int | None:
        """The newest committed step of either tier, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def item_directory(self, step: int) -> Path:
        """The directory of the ``state`` item of ``step`` (holds the cocijax manifest)."""
        return self._directory / self._name_format.build_name(step) / STATE_ITEM

    # -- save -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        loss: Any,
        force: bool = False,
        extra: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        custom_metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Feeds one completed training step to the policy and saves if it says so.

        On a step the policy does not save there is no device sync and no dispatch, and
        ``extra``, ``metrics`` and ``custom_metadata`` are not looked at; they are checked on a
        step that saves, before anything is written.

        Args:
          step: the completed training step (1-based), larger than at the previous call.
          state: the training state pytree (jax/NumPy arrays, scalars, optax/Flax states).
          loss: the step's training loss: a number or a one-element (jax) array; NaN is fine.
          force: save even if the policy says no (e.g. the last step of a job whose policy
            does not know ``total_steps``). The policy still sees the step and the measured
            cost of the save, but its schedule does not count it.
          extra: further items of the same step, committed with it: item names to Orbax save
            args of any type Orbax's handler registry knows (``ocp.args.JsonSave(config)``,
            ``ocp.args.StandardSave(tree)``, ``grain.checkpoint.CheckpointSave(iterator)``).
          metrics: scalars recorded with the step (Orbax's ``metrics`` item); ``best_fn``
            ranks steps by them.
          custom_metadata: a JSON dict kept in the step's Orbax metadata
            (``mngr.orbax.metadata(step).custom_metadata``).

        Returns:
          True when a save was started (it completes asynchronously; a preemption save has
          completed).

        Raises:
          ManagerClosedError: the manager was closed.
          ValueError: ``step`` is not larger than the latest saved step or the previous call's,
            the manager was opened read-only, an ``extra`` name is reserved (``state``,
            ``policy``, ``metrics``), or ``best_fn`` fails on ``metrics``.
          TypeError: ``step`` is not an int, ``loss`` is not a scalar number or array, an
            ``extra`` args type is unknown to Orbax (names the key), ``metrics`` holds a
            non-scalar, or ``custom_metadata`` is not a JSON dict.
        """
        self._check_open()
        if self._read_only:
            raise ValueError(f"save: {self._directory} was opened with read_only options.")
        step = check_step(step)
        check_step_order(step, self._latest_saved, self._driver.step, self._directory)
        loss = stage_loss(loss)
        if self._driver.wants_state_size:  # once: the cost assumed until a save is timed
            self._driver.state_size(tree_nbytes(state))
        # The previous step's loss goes with this step; it is read only at the policy's next
        # check (that step is done by then), so a step that cannot save costs no device sync.
        previous_loss = self._driver.loss if self._pending_loss is None else self._pending_loss
        self._pending_loss = loss
        saved = self._driver.decide(step, loss=previous_loss) or force
        preempted = self._preemption.due(step, self._driver.step_time_s)
        if saved or preempted:
            self._save(step, state, loss, extra, metrics, custom_metadata)
            if self._durable is not None:
                self._durable.offer(step, force=preempted)  # drained once committed
        if preempted:
            self._preemption.taken(step, self.wait_until_finished)
        return saved or preempted

    def _save(
        self,
        step: int,
        state: Any,
        loss: Any,
        extra: Any,
        metrics: Any,
        custom_metadata: Any,
    ) -> None:
        # Wait for the step's own computation first: that is training time, not checkpoint cost.
        jax.block_until_ready(state)
        # Reject unsupported leaves and bad items before Orbax starts its background threads:
        # an error raised inside the handler's async_save leaves Orbax threads waiting up to
        # 300 s for signals that never come, which also blocks interpreter exit.
        check_tree(state)
        items = check_extra(extra, restoring=False)
        # Warns with the user's `save` call as its place (save -> _save -> here).
        metrics = self._check_metrics(metrics, step=step, stacklevel=3)
        if metrics is not None:
            items[METRICS_ITEM] = ocp.args.JsonSave(metrics)
        custom_metadata = _check_custom_metadata(custom_metadata)
        snapshot = self._driver.snapshot(loss)
        # The policy item's commit future writes once the cost is measured (see _policy_item);
        # it is released whatever happens here, so that no future waits for ever.
        ready = threading.Event()
        try:
            with self._driver.saving() as measured:
                self._wait()  # a still-running save is a real stall: timed
                self._settle()
                with naming(self._step_dir(step), self._paths):
                    self._apply_retention()
                    self._collect_garbage()
                if not self._async:
                    # A synchronous Orbax save waits for every item, the policy item included,
                    # so that item records the cost measured so far; the policy itself is fed
                    # the whole blocking time.
                    measured["cost_s"] = self._clock() - measured["start"]
                    ready.set()
                item = PolicyStateSave(
                    build=lambda: self._driver.to_json(snapshot, cost_s=measured["cost_s"]),
                    ready=ready,
                )
                with naming(self._step_dir(step), self._paths):
                    self.orbax.save(
                        step,
                        args=ocp.args.Composite(
                            **{STATE_ITEM: storage.StripedSave(state), POLICY_ITEM: item, **items}
                        ),
                        custom_metadata=custom_metadata,
                        force=True,
                    )
                self._latest_saved = step
                self._save_started = True  # until a wait says whether it committed
        finally:
            ready.set()

    def _apply_retention(self) -> None:
        """Deletes the committed steps best-N does not keep (every process, same decision), and
        with ``orbax_retention`` the oldest steps Orbax wrote beyond ``max_to_keep``."""
        if self._orbax_retention is not None and self._lock is not None:
            over = len(self._local_steps()) + len(self._orbax_steps) - self._orbax_retention
            for step in sorted(self._orbax_steps)[: max(over, 0)]:
                log.info("%s: deleting step %d, written by Orbax", self._directory, step)
                self._drop_orbax_step(step)
        if self._best is None or self._read_only:
            return  # max_to_keep alone is Orbax's (with the drain's steps pinned)
        keep = {self._preemption.step} | (self._durable.pinned() if self._durable else set())
        for step in self._best.drop(self._local_steps(), self.orbax.metrics, keep=keep):
            self.orbax.delete(step)
            self._committed.discard(step)

    @property
    def _paths(self) -> tuple[Path, ...]:
        """Where this manager writes: an error naming any path below these says where it is."""
        return (self._directory, *self._roots)

    def _step_dir(self, step: int | None) -> Path:
        return self._directory if step is None else self._directory / str(step)

    def _wait(self) -> None:
        """Waits for the running save; its errors (every one, once) name a path."""
        started, self._save_started = self._save_started, False
        try:
            wait(self.orbax, self._step_dir(self._latest_saved), self._paths)
        except BaseException as error:
            # Orbax unlists the steps a save is to delete when the save starts, and deletes
            # them once it commits: after a failed save they are committed and on disk but not
            # listed. List them again now, not only at the next save (_collect_garbage).
            if not self._read_only and self._primary:
                try:
                    retry_deletions(self.orbax, self._directory)
                except Exception as also:
                    error.add_note(f"also: {type(also).__name__}: {also}")
            raise
        if started:
            self._history.recorded()  # a save of this run committed, with the job's failures

    def _collect_garbage(self) -> None:
        """Finds what to remove (the trash, unreferenced stripes, failed saves) and hands it to
        the remover's thread; retries failed deletions of steps."""
        if not self._read_only and self._primary:
            self._remover.remove(collect_garbage(self._directory, self._stripe_roots))
            retry_deletions(self.orbax, self._directory)

    # -- restore ----------------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        fallback: bool = False,
        extra: dict[str, Any] | None = None,
        partial: bool = False,
        tier: str | None = None,
    ):
        """Restores a step's state and continues the policy schedule from that step.

        With a durable tier, a step may have two copies: the local one is read first. A
        durable copy is read straight from the durable tier (the pieces the target needs,
        through TensorStore; the small items are downloaded and checked first).

        Args:
          step: the step; None for the newest step of the tiers asked for.
          target: an abstract tree (``jax.ShapeDtypeStruct`` with shardings, or arrays) giving
            the structure, dtypes and placement; None restores as saved.
          fallback: if the step is damaged, restore the newest older step that is intact
            instead (a warning names each step skipped; see :attr:`restored_step`).
          extra: items saved with ``save(extra=...)`` to restore too: names to Orbax restore
            args (``ocp.args.JsonRestore()``, ``grain.checkpoint.CheckpointRestore(iterator)``).
          partial: ``target`` may be any sub-tree of the saved state (e.g. only the
            parameters); the leaves it omits are not read.
          tier: ``"local"`` or ``"durable"`` to read only that tier's copies; ``None``
            (default) reads either, local first.

        A read-only manager may restore while a writer in another process saves and deletes
        old steps (``max_to_keep``): what it returns is always one complete step, never a mix.
        When the step being read is deleted under it, ``restore()`` (the newest step) starts
        again with the newest step (up to 8 times, then ``StepDeletedError``), and
        ``restore(step)`` raises ``StepDeletedError``.

        Returns:
          The restored state; ``(state, extra)`` when ``extra`` is given, ``extra`` a dict of
          the restored items by name.

        Raises:
          ManagerClosedError: the manager was closed.
          FileNotFoundError: no such committed step (the message lists the available ones).
          StepDeletedError: the step (a ``FileNotFoundError``) was deleted while it was read.
          KeyError: an ``extra`` item was not saved with the step (Orbax's error, listing the
            step's items).
          ValueError: ``target`` does not match the saved tree (names the leaf; with
            ``partial``, a target leaf that was never saved), ``partial`` without a target,
            a reserved ``extra`` name, or an unknown ``tier`` (or ``"durable"`` without one).
          TypeError: an ``extra`` args type is unknown to Orbax (names the key).
          cocijax.storage.CorruptCheckpointError: the step is damaged (and ``fallback`` is
            False or no intact older step exists).
        """
        self._check_open()
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
                    candidates = self._copies(step, tier, fallback=fallback)
                    (candidate, where), restored = self._restore_first(
                        candidates, args, fallback=fallback
                    )
                    self._load_policy(candidate, where=where)
            except _Deleted as deleted:
                if newest and attempt < _DELETED_RETRIES:
                    log.info(
                        "restore: step %d was deleted while it was read; retrying with the "
                        "newest step",
                        deleted.step,
                    )
                    continue
                raise StepDeletedError(
                    f"restore: step {deleted.step} in {self._directory} was deleted while it was "
                    "read (the writer's retention or delete)"
                    + (
                        f", {attempt + 1} times in a row: the writer deletes steps faster than "
                        "this reader reads them."
                        if newest
                        else f"; committed now: {self.all_steps()}."
                    )
                ) from deleted.__cause__
            self._restored_step = candidate
            self._pending_loss = None
            self._driver.restart_timing()
            self._history.restored()
            if extra is None:
                return restored[STATE_ITEM]
            return restored[STATE_ITEM], {name: restored[name] for name in items}
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _restore_first(
        self, copies: list[tuple[int, str]], args: dict[str, Any], *, fallback: bool
    ) -> tuple[tuple[int, str], Any]:
        """Restores the first copy that is intact (with ``fallback``) or the first one.

        Raises:
          _Deleted: a local copy's directory vanished while it was read (a writer deleted it).
        """
        skipped: list[tuple[int, str]] = []
        for step, where in copies:
            try:
                restored = self._restore_items(step, where, args)
            except Exception as e:
                # A writer renames a step out of the directory before it removes any of its
                # data, so data missing under a step directory that is still there is damage.
                if where == "local" and not self.item_directory(step).parent.exists():
                    raise _Deleted(step) from e
                # The durable writer deletes a step's manifest before its data; a store that
                # lost the step does too: either way it is no longer committed.
                if where == "durable" and self._durable.vanished(step):
                    raise _Deleted(step) from e
                if not isinstance(e, _DAMAGE) or not fallback or (step, where) == copies[-1]:
                    if skipped:
                        names = ", ".join(self._copy_name(*c) for c in skipped)
                        e.add_note(f"restore: also damaged, skipped: {names}")
                    if isinstance(e, _DAMAGE):
                        e.add_note(self._damage_hint(fallback))
                    raise
                warnings.warn(
                    f"restore: skipping damaged {self._copy_name(step, where)}: {e}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                skipped.append((step, where))
            else:
                self._set_aside([s for s, w in skipped if w == "local"])
                return (step, where), restored
        raise AssertionError("unreachable: the last copy returns or raises")

    def _copy_name(self, step: int, where: str) -> str:
        return f"step {step}" + (f" ({where} copy)" if self._durable else "")

    def _damage_hint(self, fallback: bool) -> str:
        verify = f"`cocijax verify {self._directory}` names every damaged step and file."
        if fallback:
            return f"restore: no intact older step to fall back to. {verify}"
        return (
            "restore(fallback=True) restores the newest intact older step instead (and sets "
            f"the damaged ones aside); {verify}"
        )

    def _set_aside(self, steps: list[int]) -> None:
        """Sets damaged local steps aside after a fallback restore skipped them (a writer's).

        They are newer than the step restored: left listed, the next save would have to come
        after them. Kept in the quarantine for inspection (see ``_gc``), not listed.
        """
        if not steps or self._lock is None:
            return
        self._wait()
        for step in steps:
            step_dir = self._step_dir(step)
            if step_dir.exists():
                quarantine(step_dir, "damaged, skipped by restore(fallback=True)")
            self._committed.discard(step)
        self.orbax.reload()
        self._latest_saved = self.latest_step()

    def _copies(
        self, step: int | None, tier: str | None, *, fallback: bool
    ) -> list[tuple[int, str]]:
        """The copies ``restore`` tries in turn: ``(step, "local" | "orbax" | "durable")``."""
        if tier not in (None, "local", "durable"):
            raise ValueError(f"restore: tier must be None, 'local' or 'durable', got {tier!r}.")
        if tier == "durable" and self._durable is None:
            raise ValueError("restore: tier='durable', but this manager has no durable tier.")
        local = self._local_steps() if tier != "durable" else []
        orbax = list(self._orbax_steps) if tier != "durable" else []
        durable = self._durable.steps() if self._durable is not None and tier != "local" else []
        if self._durable is not None and tier != "local" and step not in (None, *local, *durable):
            durable = self._durable.refreshed_steps()  # drained since the last listing?
        where = f"{self._directory}" + (f" or {self._durable.url}" if durable else "")
        tiers = {"local": local, "orbax": orbax, "durable": durable}
        return restore_order(step, tiers, fallback=fallback, where=where)

    def _restore_items(self, step: int, where: str, items: dict[str, Any]) -> Any:
        """Orbax's restore of ``items`` from the local or the durable copy of ``step``."""
        if where == "local":
            return self.orbax.restore(step, args=ocp.args.Composite(**items))
        if where == "orbax":
            state = items.get(STATE_ITEM, storage.StripedRestore())
            extra = {k: v for k, v in items.items() if k != STATE_ITEM}
            return restore_orbax_step(
                self._orbax_steps[step], state.item, extra, partial=state.partial
            )
        return self._durable.restore(step, items)

    def _load_policy(self, step: int, *, history: bool = False, where: str = "local") -> None:
        """Adopts the policy state saved with ``step`` (and, when asked, the job history).

        A policy state saved by another policy cannot be continued: the policy starts fresh,
        said once per manager.
        """
        if self._read_only:
            return  # a reader never saves: the schedule is of no use to it
        if where == "orbax":
            log.info("step %d was written by Orbax: the policy starts its schedule there", step)
            self._driver.step = step  # the next call must be after it
            return
        copy = where
        where = self._directory / self._name_format.build_name(step) / POLICY_ITEM
        if copy == "durable":
            where = self._durable.root / str(step) / POLICY_ITEM
        try:
            data = self._restore_items(step, copy, {POLICY_ITEM: PolicyStateRestore()})[POLICY_ITEM]
        except (ValueError, OSError, KeyError, storage.CorruptCheckpointError) as e:
            reason = f"the policy state of step {step} cannot be read ({e})"
            self._driver.start_fresh(reason, stacklevel=3)  # the user's open or restore
            return
        if self._driver.adopt(data, where=str(where), stacklevel=3, history=history):
            # The saved step counts as seen: the next call must be after it.
            self._driver.step = step

    # -- delete, wait, close ----------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Deletes a committed step and, with external roots, its stripes (on both tiers).

        A step written by Orbax's own manager is deleted too (moved to the trash, then removed).

        Raises:
          ManagerClosedError: the manager was closed.
          FileNotFoundError: ``step`` is not a committed step.
          DurableTierError: another writer holds the durable tier's lease (nothing deleted).
        """
        self._check_open()
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"delete: step {step} is not a committed step in {self._directory} "
                f"(committed: {self.all_steps()})."
            )
        self._wait()
        self._settle()
        if self._durable is not None:
            self._durable.wait(raise_errors=False)  # a drain of this step ends first
            if step in self._durable.steps():
                self._durable.delete(step)
        if step in self._local_steps():
            self.orbax.delete(step)
        if step in self._orbax_steps:
            self._drop_orbax_step(step)
        self._committed.discard(step)
        self._latest_saved = self.latest_step()
        self._collect_garbage()
        self._wait_for_removals()  # a deletion asked for is done when delete returns

    def _drop_orbax_step(self, step: int) -> None:
        """Moves a step Orbax wrote to the trash (emptied by the next garbage collection)."""
        if self._lock is not None:
            move_aside(self._orbax_steps[step].path, self._directory / TRASH_DIR)
        del self._orbax_steps[step]

    def wait_until_finished(self, *, durable: bool = False) -> None:
        """Blocks until the running save is committed (re-raises its error), then collects
        garbage and waits for the removals (which ``save`` leaves to a thread of its own).

        Args:
          durable: also wait until the committed steps handed to the durable tier are drained
            (or skipped for a newer one), and raise the first drain error since the last call.

        Raises:
          DurableTierError: with ``durable``, a drain failed (names the step and the URL).
        """
        self._check_open()
        self._wait()
        self._settle()
        try:
            if durable and self._durable is not None:
                self._durable.wait(raise_errors=True)
        finally:
            # After the drains: best-N no longer keeps the steps they pinned.
            with naming(self._directory, self._paths):
                self._apply_retention()
                self._collect_garbage()
            self._wait_for_removals()

    def _wait_for_removals(self) -> None:
        """Waits for the removals in flight; on an object store for ``store_timeout_s`` at most
        (what is left is removed by the next opening)."""
        remote = any(isinstance(r, storage.KvPath) for r in self._roots)
        if not self._remover.wait(self._store_timeout_s if remote else None):
            log.warning(
                "%s: removals of garbage on the roots still running after %g s "
                "(store_timeout_s): left to the next opening",
                self._directory,
                self._store_timeout_s,
            )

    def is_saving_in_progress(self) -> bool:
        """Whether a save has started and not yet committed (as Orbax's manager answers it).

        A step whose ``save`` returned True is safe from a crash only once this is False: the
        save writes on in the background after it returns.
        """
        self._check_open()
        return self.orbax.is_saving_in_progress()

    def _settle(self) -> None:
        """Tells the drain that no local save is in flight (the manager waited for it)."""
        if self._durable is not None:
            self._durable.settle()

    def close(self) -> None:
        """Waits for the running save, collects garbage, closes Orbax and releases the lock.

        Each of these runs whatever the ones before it raised (a failed save, an I/O error),
        so the lock is always released and the previous signal handlers are always back; the
        first error is raised afterwards (the others as notes), naming a path. The running
        marker is removed (a clean end) unless the previous run's failure is not recorded by
        any committed save of this run yet; a marker that cannot be removed is named in the
        error, and the next open counts it as one failure.

        Raises:
          Exception: the first error of the above (a failed save's, with the path it names).
        """
        if self._closed:
            return
        self._closed = True

        def finish() -> None:
            self._wait()  # re-raises a failed save: close all the same
            with naming(self._directory, self._paths):
                self._apply_retention()
                self._collect_garbage()

        def close_orbax() -> None:
            with naming(self._directory, self._paths):
                self.orbax.close()

        def close_durable() -> None:
            if self._durable is not None:
                self._durable.close()  # the last drain ends; its errors were logged

        run_all(
            finish,
            self._wait_for_removals,
            close_orbax,
            close_durable,
            self._preemption.watcher.uninstall,
            self._release,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(f"CheckpointManager for {self._directory} is closed.")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        if failed_exit(exc[1], preempted=self._preemption.reached) and self._history is not None:
            self._history.failed()  # the next run counts it (a peer rank died, a Ctrl-C)
        self.close()

    def __del__(self):
        # A manager dropped without close() must not keep the directory locked; at interpreter
        # exit the modules used here may already be gone, hence the broad guard. The running
        # marker stays: the run did not end cleanly.
        try:
            if self._lock is not None:
                self._lock.release()
        except Exception:
            pass


def _nothing() -> None:
    pass


_DAMAGE = (storage.CorruptCheckpointError, storage.CheckpointFormatError)
# How often ``restore()`` retries with the newest step when the one it reads is deleted.
_DELETED_RETRIES = 8


class _Deleted(Exception):
    """A step vanished while it was restored (internal: becomes a retry or StepDeletedError)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def _watcher(
    signals: tuple[signal.Signals, ...], directory: Path, exit_on_preemption: bool
) -> PreemptionWatcher:
    """The preemption watcher of a JAX job: flags exchanged, or JAX's service, across processes."""
    allgather = service = None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        allgather = multihost_utils.process_allgather
        if jax.config.jax_enable_preemption_service:
            service = ocp.multihost.reached_preemption
    return PreemptionWatcher(
        signals,
        owner=str(directory),
        allgather=allgather,
        service=service,
        exit_on_preemption=exit_on_preemption,
    )


def _from_primary(text: str | None, *, is_source: bool) -> str | None:
    """The primary process's ``text`` (a short ASCII string or None), on every process."""
    from jax.experimental import multihost_utils

    data = np.zeros(64, np.uint8)
    if is_source and text is not None:
        encoded = text.encode("ascii")
        data[0] = len(encoded) + 1
        data[1 : 1 + len(encoded)] = np.frombuffer(encoded, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data, is_source=is_source))
    size = int(data[0])
    return None if size == 0 else bytes(data[1:size]).decode("ascii")


def _check_custom_metadata(custom_metadata: Any) -> dict[str, Any] | None:
    """``custom_metadata`` as Orbax keeps it: a dict with string keys that JSON can write."""
    if custom_metadata is None:
        return None
    if not isinstance(custom_metadata, dict) or not all(
        isinstance(k, str) for k in custom_metadata
    ):
        raise TypeError(
            f"custom_metadata: expected a dict with string keys, got {custom_metadata!r:.80}."
        )
    try:
        json.dumps(custom_metadata)
    except (TypeError, ValueError) as e:
        raise TypeError(f"custom_metadata: must be JSON-serialisable ({e}).") from e
    return custom_metadata
