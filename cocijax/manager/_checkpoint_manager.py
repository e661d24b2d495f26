"""``CheckpointManager``: a policy decides when to save, the striped handler writes, Orbax manages.

The manager composes an ``ocp.CheckpointManager`` (exposed as ``.orbax``) that holds two items per
step: ``state`` (the training state, written by :class:`cocijax.StripedCheckpointHandler`) and
``policy`` (the policy's state and the job's measurements, see ``_policy_item``). Orbax keeps
doing what it already does well: atomic commit of step directories, asynchronous finalisation,
``max_to_keep``/``keep_period``/preservation policies. The manager adds what Orbax cannot know:

* **When to save.** ``save`` is called every step; a :mod:`cocijax.policies` policy decides, fed
  by the shared driver (``_driver``) with times it measures itself and the job's failure rate
  and recovery time, learned from the directory's history (``_history``).
* **Stripes outside the step directory.** With external ``roots`` a step's data lives on other
  file systems, so deleting the step directory is not enough: the stripes no committed step
  references are removed (``_gc``) after each save has finished and at start-up.

Orbax is configured to *rename* steps it deletes into ``.cocijax-deleted/`` (its
``todelete_subdir`` option) instead of deleting them file by file, so a crash in the middle of a
deletion never leaves a listed step with half its files; the manager empties that directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, final

import jax
import orbax.checkpoint as ocp

from cocijax import storage
from cocijax._validate import POSITIVE, check
from cocijax.manager._contract import (
    ManagerClosedError,
    Measurements,
    check_step,
    check_step_order,
)
from cocijax.manager._directory import (
    POLICY_ITEM,
    STATE_ITEM,
    TRASH_DIR,
    check_layout,
    is_committed,
    merge_options,
)
from cocijax.manager._driver import PolicyDriver, stage_loss
from cocijax.manager._faults import naming, retry_deletions, wait
from cocijax.manager._gc import collect_garbage
from cocijax.manager._history import RunHistory, process_age_s
from cocijax.manager._lock import DirectoryLock
from cocijax.manager._policy_item import PolicyStateHandler, PolicyStateRestore, PolicyStateSave

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
      ("unknown") in a fresh directory.
    * **checkpoint cost**: the blocking time of a save, including the wait for the previous
      asynchronous save if it was still running (a real stall of training).
    * **loss, one step late**: ``loss`` may be an unfinished ``jax.Array``. ``save`` starts its
      copy to host and the policy sees each loss with the next step, read only at the policy's
      next check (see :class:`cocijax.policies.Runner`): a step that cannot save costs no device
      sync. A NaN/inf loss is passed on; policies ignore it.
    * **failure rate and recovery time**, learned from the job itself: the directory is marked
      as running while open; opening one whose previous run did not close counts a failure;
      uptime and failures are saved with every checkpoint, and the MTBF given to the policy is
      the posterior mean of a Gamma-Poisson model with ``prior_mtbf_s`` as a prior worth one
      failure. The recovery time is measured from the process start to the first step after a
      :meth:`restore`. A policy built with its own ``mtbf_s``/``recovery_s`` keeps them.

    The policy state and these measurements are saved with every checkpoint (item ``policy``)
    and reloaded from the newest step when the manager opens (and from the restored step by
    :meth:`restore`), so a restarted job continues its schedule.

    In a multi-process job every process calls ``save``; the measured values are broadcast from
    process 0 before they reach the policy, so every process takes the same decision. Only the
    primary process deletes anything.

    Args:
      directory: where Orbax keeps step directories (created if missing).
      roots: storage roots the state is striped over. ``None`` (default) keeps the data inside
        each step directory, so Orbax's atomic commit and deletion cover it.
      policy: a :mod:`cocijax.policies` policy; default ``cj.policies.coci()``.
      max_to_keep: keep at most this many steps (Orbax option).
      keep_period: also keep every step that is a multiple of this (Orbax option).
      preservation_policy: an Orbax preservation policy, instead of the two above.
      options: any other ``ocp.CheckpointManagerOptions`` (e.g. ``enable_async_checkpointing``,
        ``read_only``). Options that decide when to save (``save_decision_policy``,
        ``should_save_fn``, ``save_on_steps``), ``best_fn`` and step naming (``step_prefix``,
        ``step_format_fixed_length``, ``step_name_format``) are not supported.
      handler_options: keyword arguments for :class:`cocijax.StripedCheckpointHandler`.
      prior_mtbf_s: the MTBF the learned estimate starts from; default 24 h divided by
        ``jax.device_count()``.
      clock: monotonic clock in seconds; injectable for deterministic tests.

    Raises:
      ValueError: ``directory`` holds files or steps cocijax did not write, or options conflict.
      DirectoryLockedError: another manager has the directory open for writing.

    Example:
      >>> import jax.numpy as jnp, tempfile, cocijax as cj
      >>> state = {"w": jnp.zeros(4)}
      >>> with cj.CheckpointManager(tempfile.mkdtemp(), policy=cj.policies.fixed(100)) as mngr:
      ...     saved = [s for s in range(1, 301) if mngr.save(s, state, loss=1.0 / s)]
      >>> saved
      [100, 200, 300]
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        roots: Sequence[str | os.PathLike[str]] | None = None,
        policy: Any = None,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        preservation_policy: Any = None,
        options: ocp.CheckpointManagerOptions | None = None,
        handler_options: dict[str, Any] | None = None,
        prior_mtbf_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        from cocijax import policies

        age = process_age_s()
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(
                f"directory: expected a path (str or os.PathLike), got {type(directory).__name__}."
            )
        self._directory = Path(directory).absolute()
        if self._directory.exists() and not self._directory.is_dir():
            raise NotADirectoryError(f"directory: {self._directory} exists and is not a directory.")
        self._roots = tuple(Path(r).absolute() for r in roots) if roots else ()
        # Each checkpoint directory stripes into its own folder on a root, so that the garbage
        # collection of one manager never sees (and removes) the stripes of another directory
        # sharing the root. Derived from the path, not random, so that every process of a job
        # agrees on it without communicating.
        namespace = ".cocijax-" + hashlib.sha256(str(self._directory).encode()).hexdigest()[:16]
        self._stripe_roots = tuple(root / namespace for root in self._roots)
        self._clock = clock
        self._closed = False
        self._lock: DirectoryLock | None = None
        self._history: RunHistory | None = None
        self._committed: set[int] = set()
        options = merge_options(
            options,
            max_to_keep=max_to_keep,
            keep_period=keep_period,
            preservation_policy=preservation_policy,
        )
        self._read_only = options.read_only
        self._policy_warned = False  # a policy state that cannot be continued is said once
        self._async = options.enable_async_checkpointing
        self._name_format = options.step_name_format
        self._primary = jax.process_index() == (options.multiprocessing_options.primary_host or 0)
        prior = policies.default_prior_mtbf_s() if prior_mtbf_s is None else prior_mtbf_s
        prior = check("prior_mtbf_s", prior, POSITIVE)
        policy = policies.coci() if policy is None else policy

        if not self._read_only:
            storage.make_dirs(self._directory)  # durably: a power loss must not lose it
        elif not self._directory.is_dir():
            raise FileNotFoundError(f"directory: {self._directory} does not exist.")
        if not self._read_only and self._primary:
            self._lock = DirectoryLock(self._directory)
            self._lock.acquire()
        try:
            self._uncommitted = check_layout(self._directory)
            for entry in self._uncommitted:
                log.warning("%s has no valid cocijax manifest: not listed (uncommitted).", entry)
            # Only the primary writer marks the directory; every process reads the history
            # saved with the checkpoints (process 0's measurements reach the policy anyway).
            self._history = RunHistory(
                self._directory,
                clock=clock,
                writer=self._lock is not None,
                opened_at_age_s=age,
            )
            self._driver = PolicyDriver(
                policy, clock=clock, history=self._history, prior_mtbf_s=prior
            )
            handler = storage.StripedCheckpointHandler(
                # A reader needs no roots (the manifest names them) and must not create them.
                roots=[] if self._read_only else list(self._stripe_roots),
                **(handler_options or {}),
            )
            registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
            registry.add(STATE_ITEM, storage.StripedSave, handler)
            registry.add(STATE_ITEM, storage.StripedRestore, handler)
            policy_handler = PolicyStateHandler(
                primary_host=options.multiprocessing_options.primary_host
            )
            registry.add(POLICY_ITEM, PolicyStateSave, policy_handler)
            registry.add(POLICY_ITEM, PolicyStateRestore, policy_handler)
            self.orbax = ocp.CheckpointManager(
                self._directory, options=options, handler_registry=registry
            )
            self._collect_garbage()
            latest = self.latest_step()
            self._history.adopt(None)
            if latest is not None:
                self._load_policy(latest, history=True)
            self._latest_saved = latest
        except BaseException:
            if hasattr(self, "orbax"):
                self.orbax.close()
            self._release()
            raise
        self._pending_loss: Any = None
        self._restored_step: int | None = None

    def _release(self) -> None:
        """Releases the lock and the running marker (a clean end: no failure is counted)."""
        if self._history is not None:
            self._history.close()
        if self._lock is not None:
            self._lock.release()

    # -- listing ----------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def roots(self) -> tuple[Path, ...]:
        """The external storage roots (empty when the data lives in the step directories)."""
        return self._roots

    @property
    def stripe_roots(self) -> tuple[Path, ...]:
        """Where this directory's stripes go: one folder per root, private to this directory."""
        return self._stripe_roots

    @property
    def policy_state(self) -> Any:
        """The current policy state (a pytree of arrays)."""
        return self._driver.state

    @property
    def measurements(self) -> Measurements:
        """The inputs of the policy's last decision (see :class:`Measurements`)."""
        return self._driver.measurements()

    @property
    def restored_step(self) -> int | None:
        """The step the last :meth:`restore` returned (useful with ``fallback=True``)."""
        return self._restored_step

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first: a save still in flight is not listed."""
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
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def item_directory(self, step: int) -> Path:
        """The directory of the ``state`` item of ``step`` (holds the cocijax manifest)."""
        return self._directory / self._name_format.build_name(step) / STATE_ITEM

    # -- save -------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, loss: Any, force: bool = False) -> bool:
        """Feeds one completed training step to the policy and saves if it says so.

        A step the policy cannot save at costs a few microseconds: no device sync, no dispatch
        (measured against Orbax's own ``save`` in ``benchmarks/step_cost_bench.py``).

        Args:
          step: the completed training step (1-based), larger than at the previous call.
          state: the training state pytree (jax/NumPy arrays, scalars, optax/Flax states).
          loss: the step's training loss: a number or a one-element (jax) array; NaN is fine.
          force: save even if the policy says no. The policy still sees the step but is not
            told about the forced save (its schedule does not change).

        Returns:
          True when a save was started (it completes asynchronously).

        Raises:
          ManagerClosedError: the manager was closed.
          ValueError: ``step`` is not larger than the latest saved step or the previous call's,
            or the manager was opened read-only.
          TypeError: ``step`` is not an int, or ``loss`` is not a scalar number or array.
        """
        self._check_open()
        if self._read_only:
            raise ValueError(f"save: {self._directory} was opened with read_only options.")
        step = check_step(step)
        check_step_order(step, self._latest_saved, self._driver.step, self._directory)
        loss = stage_loss(loss)
        # The previous step's loss goes with this step; it is read only at the policy's next
        # check (that step is done by then), so a step that cannot save costs no device sync.
        previous_loss = self._driver.loss if self._pending_loss is None else self._pending_loss
        self._pending_loss = loss
        saved = self._driver.decide(step, loss=previous_loss) or force
        if saved:
            self._save(step, state, loss)
        return saved

    def _save(self, step: int, state: Any, loss: Any) -> None:
        # Wait for the step's own computation first: that is training time, not checkpoint cost.
        jax.block_until_ready(state)
        # Reject unsupported leaves before Orbax starts its background threads: an error raised
        # inside the handler's async_save leaves Orbax threads waiting up to 300 s for signals
        # that never come, which also blocks interpreter exit.
        storage.check_tree(state)
        snapshot = self._driver.snapshot(loss)
        # The policy item's commit future writes once the cost is measured (see _policy_item);
        # it is released whatever happens here, so that no future waits for ever.
        ready = threading.Event()
        try:
            with self._driver.saving() as measured:
                self._wait()  # a still-running save is a real stall: timed
                with naming(self._step_dir(step), self._paths):
                    self._collect_garbage()
                    self._clear_uncommitted(step)
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
                            **{STATE_ITEM: storage.StripedSave(state), POLICY_ITEM: item}
                        ),
                        force=True,
                    )
                self._latest_saved = step
        finally:
            ready.set()

    def _clear_uncommitted(self, step: int) -> None:
        """Moves an unlisted (manifest-less) directory of ``step`` to the trash before reuse."""
        if not self._primary:
            return
        for entry in [e for e in self._uncommitted if e.name == str(step)]:
            trash = self._directory / TRASH_DIR
            trash.mkdir(exist_ok=True)
            target = trash / f"{entry.name}-uncommitted-{time.time_ns()}"
            log.warning("moving uncommitted %s to %s before saving step %d", entry, target, step)
            entry.rename(target)
            self._uncommitted.remove(entry)

    @property
    def _paths(self) -> tuple[Path, ...]:
        """Where this manager writes: an error naming any path below these says where it is."""
        return (self._directory, *self._roots)

    def _step_dir(self, step: int | None) -> Path:
        return self._directory if step is None else self._directory / str(step)

    def _wait(self) -> None:
        """Waits for the running save; its errors (every one, once) name a path."""
        wait(self.orbax, self._step_dir(self._latest_saved), self._paths)

    def _collect_garbage(self) -> None:
        """Empties the trash, removes unreferenced stripes, retries failed deletions of steps."""
        if not self._read_only and self._primary:
            collect_garbage(self._directory, self._stripe_roots)
            retry_deletions(self.orbax, self._directory)

    # -- restore ----------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, *, fallback: bool = False):
        """Restores a step's state and continues the policy schedule from that step.

        Args:
          step: the step; None for the latest.
          target: an abstract tree (``jax.ShapeDtypeStruct`` with shardings, or arrays) giving
            the structure, dtypes and placement; None restores as saved.
          fallback: if the step is damaged, restore the newest older step that is intact
            instead (a warning names each step skipped; see :attr:`restored_step`).

        Returns:
          The restored state.

        Raises:
          ManagerClosedError: the manager was closed.
          FileNotFoundError: no such committed step (the message lists the available ones).
          cocijax.storage.CorruptCheckpointError: the step is damaged (and ``fallback`` is
            False or no intact older step exists).
        """
        self._check_open()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"restore: no committed step in {self._directory}.")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(
                f"restore: step {step} is not a committed step in {self._directory} "
                f"(committed: {steps})."
            )
        candidates = [step] + ([s for s in reversed(steps) if s < step] if fallback else [])
        skipped: list[int] = []
        for candidate in candidates:
            try:
                restored = self.orbax.restore(
                    candidate,
                    args=ocp.args.Composite(**{STATE_ITEM: storage.StripedRestore(target)}),
                )
            except (storage.CorruptCheckpointError, storage.CheckpointFormatError) as e:
                if not fallback or candidate == candidates[-1]:
                    if skipped:
                        e.add_note(f"restore: also damaged, skipped: steps {skipped}")
                    raise
                warnings.warn(
                    f"restore: skipping damaged step {candidate}: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                skipped.append(candidate)
                continue
            self._load_policy(candidate)
            self._restored_step = candidate
            self._pending_loss = None
            self._driver.restart_timing()
            self._history.restored()
            return restored[STATE_ITEM]
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _load_policy(self, step: int, *, history: bool = False) -> None:
        """Adopts the policy state saved with ``step`` (and, when asked, the job history).

        A policy state saved by another policy cannot be continued: the policy starts fresh,
        said once per manager.
        """
        if self._read_only:
            return  # a reader never saves: the schedule is of no use to it
        where = self._directory / self._name_format.build_name(step) / POLICY_ITEM
        try:
            data = self.orbax.restore(
                step, args=ocp.args.Composite(**{POLICY_ITEM: PolicyStateRestore()})
            )[POLICY_ITEM]
        except (ValueError, OSError, KeyError) as e:
            self._warn_policy(f"the policy state of step {step} cannot be read ({e})")
            return
        if history:
            self._driver.load_history(data)
        try:
            self._driver.load_json(data, where=str(where))
        except (ValueError, KeyError, TypeError) as e:
            self._warn_policy(str(e))
            return
        # The saved step counts as seen: the next call must be after it.
        self._driver.step = step

    def _warn_policy(self, reason: str) -> None:
        if not self._policy_warned:
            self._policy_warned = True
            warnings.warn(
                f"{reason}; this manager's policy starts its schedule fresh.",
                RuntimeWarning,
                stacklevel=4,
            )

    # -- delete, wait, close ----------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Deletes a committed step and, with external roots, its stripes.

        Raises:
          ManagerClosedError: the manager was closed.
          FileNotFoundError: ``step`` is not a committed step.
        """
        self._check_open()
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"delete: step {step} is not a committed step in {self._directory} "
                f"(committed: {self.all_steps()})."
            )
        self._wait()
        self.orbax.delete(step)
        self._committed.discard(step)
        self._latest_saved = self.latest_step()
        self._collect_garbage()

    def wait_until_finished(self) -> None:
        """Blocks until the running save is committed (re-raises its error), then collects."""
        self._check_open()
        self._wait()
        with naming(self._directory, self._paths):
            self._collect_garbage()

    def close(self) -> None:
        """Waits for the running save, collects garbage, closes Orbax and releases the lock."""
        if self._closed:
            return
        try:
            self._wait()  # re-raises a failed save: close all the same
            with naming(self._directory, self._paths):
                self._collect_garbage()
        finally:
            with naming(self._directory, self._paths):
                try:
                    self.orbax.close()
                finally:
                    self._closed = True
                    self._release()

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(f"CheckpointManager for {self._directory} is closed.")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
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
