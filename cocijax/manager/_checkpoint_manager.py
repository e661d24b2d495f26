"""``CheckpointManager``: a policy decides when to save, the striped handler writes, Orbax manages.

The manager composes an ``ocp.CheckpointManager`` (exposed as ``.orbax``) that holds, per step,
``state`` (the training state, written by :class:`cocijax.StripedCheckpointHandler`), ``policy``
(the policy's state and the job's measurements, see ``_policy_item``), the step's ``metrics``
in Orbax's own format when there are any, and the caller's ``extra`` items (any Orbax args:
JSON, pytrees, a Grain iterator). Orbax keeps doing what it already does well: atomic commit of
step directories, asynchronous finalisation, ``max_to_keep``/``keep_period``/preservation
policies. What every manager decides (the policy driver, the run history, retention, preemption,
the lock) is the framework-neutral core's (:mod:`cocijax.core`); this module adds what is the
JAX backend's own:

* **Stripes outside the step directory.** With external ``roots`` a step's data lives on other
  file systems: the stripes no committed step references are removed (``_gc``), off the
  training thread, after each save has finished and at start-up.
* **More kinds of step**: the memory tier's (``_memory_tier``), a durable tier's copies
  (``_tiers``) and steps Orbax's own manager wrote (``_orbax_steps``), listed and restored
  beside cocijax's (``_restoring``).
* **Damaged steps** set aside (``_gc.quarantine``) and a directory identity that survives
  aliases (``_identity``).

Orbax is configured to *rename* steps it deletes into ``.cocijax-deleted/`` (its
``todelete_subdir`` option) instead of deleting them file by file, so a crash in the middle of a
deletion never leaves a listed step with half its files; the manager empties that directory.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, final

import orbax.checkpoint as ocp

from cocijax import storage
from cocijax.core._contract import (
    MEASUREMENTS,
    POLICY_STATE,
    ManagerClosedError,
)
from cocijax.core._history import failed_exit, process_age_s
from cocijax.core._preemption import Preemption
from cocijax.manager import _closing, _opening, _restoring, _saving
from cocijax.manager._compile_cache import check_compilation_cache, use_compilation_cache
from cocijax.manager._directory import STATE_ITEM, checked_once
from cocijax.manager._tier_options import check_timeout

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


@final
class CheckpointManager:
    """Saves a training state when a cocijax policy says so, through striped async writes.

    Call :meth:`save` after every training step; it returns True when it started a save.

    The manager measures what the policy needs: the step time (between ``save`` calls, less a
    save's blocking; not the first step after opening or a restore, which compiles), the
    checkpoint cost (a save's blocking; until one is timed, a cost from the state's size, and
    the first timed step is saved to measure it), the loss one step late (``loss`` may be an
    unfinished ``jax.Array``: a step that does not save never waits for the device), and the
    failure rate and recovery time learned from the directory's history (a run that did not
    close, or left its ``with`` block by an exception, is a failure). These and the policy
    state are saved with every checkpoint, so a restarted job continues its schedule. A policy
    that knows ``total_steps`` saves the last step; otherwise pass ``force=True`` there. See
    :mod:`cocijax.core` and the docs' "Managers and tiers".

    **Preemption.** While the manager is open, ``preemption_signals`` (default SIGTERM) are
    caught; the next :meth:`save` saves its step and waits for the commit; then the job ends
    as the signal would have ended it (``exit_on_preemption``). In a multi-process job every
    process calls ``save`` and takes the same decisions (process 0's measurements are
    broadcast).

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
        ``gs://bucket/run42``) or a path (a shared file system). Committed steps are drained
        there in the background (``save`` never waits for it); ``all_steps``,
        ``latest_step`` and ``restore`` cover both tiers.
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
      memory: a memory tier: a folder on a tmpfs, or True for one under the machine's
        shared-memory tmpfs. Every save lands there first (same format; it survives the
        process's death, not the machine's) and restores read it first; the disk and the
        durable tier get the persisted saves only (a two-level policy's level 2, every save
        of a one-level policy). It keeps two steps; one folder per directory (its identity).
        Several processes need ``host_local``: each keeps its shards in its own memory tier.
      memory_bytes: the memory tier's budget (default: two states, at most the tmpfs's free
        space). A state whose two copies do not fit is refused at the first save (a
        ``ValueError`` naming the sizes); with ``memory=True`` the manager warns and saves to
        the disk only.
      compilation_cache: True keeps JAX's persistent compilation cache in
        ``<directory>/.cocijax-compile-cache`` (hidden: not a step), a folder keeps it there, so
        that a restart reuses the programs compiled after the manager was built (build it
        before jitting the training step). A cache folder set already is kept, with a warning.
      host_local: several processes (``jax.distributed``), each with folders of its own:
        ``directory`` and ``roots`` are this process's (e.g. a local disk), ``durable`` is
        shared. Each process commits and deletes its own shards there and drains them to the
        durable tier. Opening, ``restore``, ``delete`` and ``wait_until_finished`` are
        collective: the processes list only the steps every one can serve, so a replaced host
        restores from the durable tier. See the docs' "Several processes".

    Raises:
      ValueError: ``directory`` holds something neither cocijax nor Orbax wrote, locations
        overlap (a durable tier or root inside the directory), options conflict or are out of
        range, or an object-store root cannot be written within ``store_timeout_s``.
      TypeError: an argument has the wrong type (the message names it).
      DurableTierError: the durable tier cannot be listed within ``store_timeout_s``.
      DirectoryLockedError: another manager has the directory open for writing.

    Example:
      >>> import jax.numpy as jnp, tempfile, cocijax as cj
      >>> state = {"w": jnp.zeros(4)}
      >>> with cj.CheckpointManager(tempfile.mkdtemp(), policy=cj.policies.fixed(100)) as mngr:
      ...     saved = [s for s in range(1, 301) if mngr.save(s, state, loss=1.0 / s)]
      >>> saved
      [100, 200, 300]
    """

    @checked_once()  # Orbax lists the steps as it opens, and so does the manager: check each once
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
        memory: bool | str | os.PathLike[str] | None = None,
        memory_bytes: int | None = None,
        compilation_cache: bool | str | os.PathLike[str] | None = None,
        host_local: bool = False,
    ):
        age = process_age_s()
        opening = _opening.check_arguments(
            directory, roots=roots, policy=policy, max_to_keep=max_to_keep,
            keep_period=keep_period, preservation_policy=preservation_policy, best_fn=best_fn,
            best_mode=best_mode, keep_latest=keep_latest, preemption_signals=preemption_signals,
            exit_on_preemption=exit_on_preemption, options=options,
            handler_options=handler_options, prior_mtbf_s=prior_mtbf_s, clock=clock,
            durable=durable, durable_every=durable_every,
            durable_max_to_keep=durable_max_to_keep, durable_options=durable_options,
            orbax_retention=orbax_retention, store_timeout_s=store_timeout_s, memory=memory,
            memory_bytes=memory_bytes, host_local=host_local,
        )  # fmt: skip
        cache = check_compilation_cache(compilation_cache, opening.directory)
        if cache is not None:  # before the opening, whose policy compiles its decision
            use_compilation_cache(cache)
        _opening.open_manager(self, opening, age)
        self._pending_loss: Any = None
        self._restored_step: int | None = None
        self._restored_tier: str | None = None
        watcher = _opening.watcher(opening)
        watcher.install(on_end=self.close)
        self._preemption = Preemption(watcher, owner=str(self._directory))

    # -- listing ----------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def roots(self) -> tuple[Path | storage.KvPath, ...]:
        """The external storage roots (``KvPath`` for object stores; none: in the steps)."""
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
    def restored_tier(self) -> str | None:
        """The tier of the last :meth:`restore`: ``"memory"``, ``"local"`` or ``"durable"``."""
        return self._restored_tier

    @property
    def reached_preemption(self) -> bool:
        """A preemption signal arrived and its step has been saved and committed: stop now."""
        return self._preemption.reached

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The ``metrics`` saved with ``step`` (``None`` if it was saved without), as Orbax's."""
        return self.orbax.metrics(step)

    def all_steps(self) -> list[int]:
        """Committed steps of every tier, oldest first (a save in flight is not listed); a
        read-only manager lists afresh at every call, following a writer in another process."""
        return self._steps(every=True)

    def _steps(self, *, every: bool) -> list[int]:
        """:meth:`all_steps`; without ``every``, the newest one is among them, not all older."""
        local = self._local_steps(every=every)
        tiers = (local, self._orbax_steps, self.memory_steps(), self.durable_steps())
        return sorted(set().union(*tiers) - self._hidden)

    def durable_steps(self) -> list[int]:
        """Steps committed on the durable tier, oldest first (``[]`` without one)."""
        return self._durable.steps() if self._durable is not None else []

    def memory_steps(self) -> list[int]:
        """Memory tier steps (several processes: those all hold), oldest first (``[]``: none)."""
        return [] if self._memory is None else self._memory.listed()

    _local_steps = _saving.local_steps  # the disk's committed steps (``every=True``: all)

    def latest_step(self) -> int | None:
        """The newest committed step of any tier, or None."""
        return max(self._steps(every=False), default=None)  # older steps need not be read

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

        On a step the policy does not save there is no device sync and no dispatch; ``extra``,
        ``metrics`` and ``custom_metadata`` are checked only on a step that saves.

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
        return _saving.save_step(self, step, state, loss, force, extra, metrics, custom_metadata)

    def _step_dir(self, step: int | None) -> Path:  # what an error names
        return self._directory if step is None else self._directory / str(step)

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

        A step's memory copy is read first (one that does not restore is skipped, warned),
        then its local one, then its durable one; a step Orbax's own manager wrote is read
        through Orbax's handlers (see ``_restoring``).

        Args:
          step: the step; None for the newest step of the tiers asked for.
          target: an abstract tree (``jax.ShapeDtypeStruct`` with shardings, or arrays) giving
            the structure, dtypes and placement; None restores as saved.
          fallback: if the step is damaged, restore the newest older step that is intact
            instead (a warning names each step skipped; see :attr:`restored_step`); with
            ``host_local``, every process restores the same step (collective).
          extra: items saved with ``save(extra=...)`` to restore too: names to Orbax restore
            args (``ocp.args.JsonRestore()``, ``grain.checkpoint.CheckpointRestore(iterator)``).
          partial: ``target`` may be any sub-tree of the saved state (e.g. only the
            parameters); the leaves it omits are not read.
          tier: ``"memory"``, ``"local"`` or ``"durable"``: only that tier's copies; ``None``
            (default) reads any: memory, then local, then durable (see :attr:`restored_tier`).

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
        return _restoring.restore(
            self, step, target, fallback=fallback, extra=extra, partial=partial, tier=tier
        )

    def _restored(self, step: int, tier: str) -> None:
        """A restore returned ``step``: the next step is not timed, and ends a recovery."""
        self._restored_step, self._restored_tier = step, tier
        self._pending_loss = None
        self._driver.restart_timing()
        self._history.restored()

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
        _saving.delete_step(self, step)

    def wait_until_finished(self, *, durable: bool = False) -> None:
        """Blocks until the running save (and a persisted step's copy from memory to disk) is
        committed, re-raising its error, then collects garbage and waits for the removals.

        Args:
          durable: also wait until the committed steps handed to the durable tier are drained
            (or skipped for a newer one), and raise the first drain error since the last call.

        With ``host_local`` it is collective: a step some process could not commit is then
        listed by none.

        Raises:
          DurableTierError: with ``durable``, a drain failed (names the step and the URL).
          TimeoutError: a disk copy made no progress for ``store_timeout_s`` (names the step).
          HostsError: host-local, a process did not answer within ``store_timeout_s``.
        """
        self._check_open()
        _saving.wait_until_finished(self, durable=durable)

    def is_saving_in_progress(self) -> bool:
        """Whether a save has started and not yet committed (as Orbax's manager answers it).

        A step whose ``save`` returned True is safe from a crash only once this is False: the
        save writes on in the background after it returns (with a memory tier, a persisted
        step's copy to the disk too).
        """
        self._check_open()
        return _saving.save_in_flight(self)

    def close(self, *, timeout_s: float | None = None) -> None:
        """Waits for the running save, collects garbage, closes Orbax and releases the lock.

        Each of these runs whatever the ones before it raised (a failed save, an I/O error),
        so the lock is always released and the previous signal handlers are always back; the
        first error is raised afterwards (the others as notes), naming a path. The running
        marker is removed (a clean end) unless the previous run's failure is not recorded by
        any committed save of this run yet; a marker that cannot be removed is named in the
        error, and the next open counts it as one failure.

        Args:
          timeout_s: the longest close waits for the running save, the garbage collection and
            Orbax's close; ``None`` (default): as long as they take. With several processes a
            save commits once every process has written its part: after another process died,
            Orbax waits for it until JAX's heartbeat timeout aborts this process. With a
            bound, close gives up on the save then (not committed by then; the garbage
            collection and Orbax's close are skipped) and the rest of close runs.

        Raises:
          TimeoutError: ``timeout_s`` ran out (names the step abandoned).
          Exception: the first error of the above (a failed save's, with the path it names).
        """
        if timeout_s is not None:  # checked first: a bad value leaves the manager open
            timeout_s = check_timeout(timeout_s, "timeout_s")
        if not self._closed:
            self._closed = True
            _closing.close(self, timeout_s)

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
