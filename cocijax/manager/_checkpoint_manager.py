"""``CheckpointManager``: a policy decides when to save, the striped handler writes, Orbax manages.

The manager composes an ``ocp.CheckpointManager`` (exposed as ``.orbax``) that holds two items per
step: ``state`` (the training state, written by :class:`cocijax.StripedCheckpointHandler`) and
``policy`` (the policy's state and the manager's measurements, see ``_policy_item``). Orbax keeps
doing what it already does well: atomic commit of step directories, asynchronous finalisation,
``max_to_keep``/``keep_period``/preservation policies. The manager adds what Orbax cannot know:

* **When to save.** ``save`` is called every step; a :mod:`cocijax.policies` policy decides, fed
  with times the manager measures itself (no user input).
* **Stripes outside the step directory.** With external ``roots`` a step's data lives on other
  file systems, so deleting the step directory is not enough: the manager removes the stripes no
  committed step references, after each save has finished and at start-up (crash leftovers).

Orbax is configured to *rename* steps it deletes into ``.cocijax-deleted/`` (its
``todelete_subdir`` option) instead of deleting them file by file, so a crash in the middle of a
deletion never leaves a listed step with half its files; the manager empties that directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from cocijax import storage
from cocijax._manager_dir import (
    POLICY_ITEM,
    STATE_ITEM,
    STEP_RE,
    TRASH_DIR,
    DirectoryLock,
    DirectoryLockedError,
    check_layout,
    is_committed,
    merge_options,
)
from cocijax._policy_driver import PolicyDriver, stage_loss
from cocijax._policy_item import PolicyStateHandler, PolicyStateRestore, PolicyStateSave
from cocijax.storage import _tree as storage_tree

# DirectoryLockedError is defined next to the lock and re-exported here, where users meet it.
__all__ = ["CheckpointManager", "DirectoryLockedError", "Measurements"]

log = logging.getLogger(__name__)


class Measurements(NamedTuple):
    """What the policy was told at the last ``save`` call, and the last save's blocking time."""

    step_time_s: float  # the previous step's measured duration
    loss: float  # the loss it saw (the previous step's: losses are read one step late)
    cost_estimate_s: float  # checkpoint cost it was given (NaN before the first save)
    last_save_s: float  # blocking time of the most recent save (NaN before the first)


class CheckpointManager:
    """Saves a training state when a cocijax policy says so, through striped async writes.

    Call :meth:`save` after every training step; it returns True when it started a save.

    What the manager measures and feeds the policy (no extra user input):

    * **step time**: monotonic-clock time from the end of one ``save`` call to the policy's
      decision in the next, so the checkpoint writes inside ``save`` are excluded. The decision
      is where the step is known to be over (reading the loss, or the policy's own computation
      queued behind the step, waits for it), so each step time reaches the policy one call late,
      like the loss. The first step after ``__init__``/``restore`` is not timed (it usually
      includes compilation): the policy is given the step time saved with the checkpoint, or
      NaN ("unknown") in a fresh directory, where the second step then gets its own host-side
      time, measured before the decision.
    * **checkpoint cost**: the blocking time of a save, including the wait for the previous
      asynchronous save if it was still running (a real stall of training).
    * **loss, one step late**: ``loss`` may be an unfinished ``jax.Array``. Reading it at once
      would stall the host until the step is done, so ``save`` starts its copy to host and the
      policy sees each loss at the next call (the previous step has finished by then while the
      current one keeps running). A NaN/inf loss is passed on; policies ignore it.

    The policy update is jitted once. The policy state and these measurements are saved with
    every checkpoint (item ``policy``) and reloaded from the newest step when the manager opens
    (and from the restored step by :meth:`restore`), so a restarted job continues its schedule.

    In a multi-process job every process calls ``save``; the measured values are broadcast from
    process 0 before each decision, so every process takes the same decision. Only the primary
    process deletes anything.

    Args:
      directory: where Orbax keeps step directories (created if missing).
      roots: storage roots the state is striped over. ``None`` (default) keeps the data inside
        each step directory, so Orbax's atomic commit and deletion cover it.
      policy: a :mod:`cocijax.policies` policy; default ``cj.policies.coci()`` (its default MTBF).
      max_to_keep: keep at most this many steps (Orbax option).
      keep_period: also keep every step that is a multiple of this (Orbax option).
      preservation_policy: an Orbax preservation policy, instead of the two above.
      options: any other ``ocp.CheckpointManagerOptions`` (e.g. ``enable_async_checkpointing``,
        ``read_only``). Options that decide when to save (``save_decision_policy``,
        ``should_save_fn``, ``save_on_steps``), ``best_fn`` and step naming (``step_prefix``,
        ``step_format_fixed_length``, ``step_name_format``) are not supported.
      handler_options: keyword arguments for :class:`cocijax.StripedCheckpointHandler`.
      clock: monotonic clock in seconds; injectable for deterministic tests.

    Raises:
      ValueError: ``directory`` holds files or steps cocijax did not write, or options conflict.
      DirectoryLockedError: another manager has the directory open for writing.

    Example:
      >>> with cj.CheckpointManager(path, policy=cj.policies.fixed(100)) as mngr:
      ...     for step in range(1, 301):
      ...         state, loss = train_step(state, batch)
      ...         mngr.save(step, state, loss=loss)
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
        clock: Callable[[], float] = time.monotonic,
    ):
        from cocijax import policies

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
        self._stripe_cache: dict[tuple[str, int], set[Path]] = {}
        self._committed: set[int] = set()
        options = merge_options(
            options,
            max_to_keep=max_to_keep,
            keep_period=keep_period,
            preservation_policy=preservation_policy,
        )
        self._read_only = options.read_only
        self._async = options.enable_async_checkpointing
        self._name_format = options.step_name_format
        self._primary = jax.process_index() == (options.multiprocessing_options.primary_host or 0)
        self._driver = PolicyDriver(policies.coci() if policy is None else policy)

        if not self._read_only:
            self._directory.mkdir(parents=True, exist_ok=True)
        elif not self._directory.is_dir():
            raise FileNotFoundError(f"directory: {self._directory} does not exist.")
        if not self._read_only and self._primary:
            self._lock = DirectoryLock(self._directory)
            self._lock.acquire()
        try:
            self._uncommitted = check_layout(self._directory)
            for entry in self._uncommitted:
                log.warning("%s has no valid cocijax manifest: not listed (uncommitted).", entry)
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
            if latest is not None:
                self._load_policy(latest)
        except BaseException:
            if hasattr(self, "orbax"):
                self.orbax.close()
            self._release_lock()
            raise
        self._pending_loss: Any = None
        self._restored_step: int | None = None
        self._t_mark = clock()
        self._timed = False

    # -- lock -------------------------------------------------------------------------------

    def _release_lock(self) -> None:
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
        loss, step_time, cost = self._driver.inputs
        return Measurements(step_time, loss, cost, self._driver.cost_s)

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

        Args:
          step: the completed training step (1-based), larger than at the previous call.
          state: the training state pytree (jax/NumPy arrays, scalars, optax/Flax states).
          loss: the step's training loss: a number or a one-element (jax) array; NaN is fine.
          force: save even if the policy says no. The policy still sees the step but is not
            told about the forced save (its schedule does not change).

        Returns:
          True when a save was started (it completes asynchronously).

        Raises:
          ValueError: ``step`` is not larger than the latest saved step or the previous call's.
          TypeError: ``loss`` is not a scalar number or array.
        """
        self._check_open()
        if self._read_only:
            raise ValueError(f"save: {self._directory} was opened with read_only options.")
        if isinstance(step, bool) or not hasattr(step, "__index__"):
            raise TypeError(f"step: expected an int, got {type(step).__name__}.")
        step = step.__index__()
        latest = self.orbax.latest_step()  # includes a save still in flight
        if latest is not None and step <= latest:
            raise ValueError(
                f"step: {step} is not after the latest saved step {latest} in {self._directory}; "
                "resume from latest_step() + 1, or delete() the newer steps first."
            )
        if self._driver.step is not None and step <= self._driver.step:
            raise ValueError(
                f"step: {step} is not after the previous call's step {self._driver.step}; "
                "call save once per training step with increasing steps."
            )
        loss = stage_loss(loss)
        # The previous step's loss, read by the driver only at the policy's next check (the
        # step is done by then): a step that cannot save costs no device sync.
        previous_loss = self._driver.loss if self._pending_loss is None else self._pending_loss
        self._pending_loss = loss
        self._driver.loss = previous_loss
        step_time = self._driver.step_time_s  # the previous step's, see the class docstring
        if math.isnan(step_time) and self._timed:
            # Only the first step of a fresh directory was before this one, and it was not timed:
            # the host-side time of this step is a better guess than "unknown".
            step_time = self._clock() - self._t_mark
        decided = self._driver.decide(step, loss=previous_loss, step_time_s=step_time)
        # Measured after the decision: at a check, reading the losses waits for the step's
        # computation, so the step has ended; between checks the host-side time between calls
        # averages to the step time once the dispatch queue is full (the policy smooths it).
        # The first step of a session is not timed: it usually includes compilation.
        if self._timed:
            self._driver.step_time_s = self._clock() - self._t_mark
        self._timed = True
        saved = decided or force
        if saved:
            self._save(step, state, loss)
        self._t_mark = self._clock()
        return saved

    def _save(self, step: int, state: Any, loss: Any) -> None:
        # Wait for the step's own computation first: that is training time, not checkpoint cost.
        jax.block_until_ready(state)
        # Reject unsupported leaves before Orbax starts its background threads: a TypeError
        # raised inside the handler's async_save leaves Orbax threads waiting up to 300 s for
        # signals that never come, which also blocks interpreter exit.
        for path, leaf in storage_tree.flatten(state)[0]:
            storage_tree.leaf_kind(path, leaf)
        snapshot = self._driver.snapshot(loss)
        measured: dict[str, float] = {}
        ready = threading.Event()

        def build() -> dict[str, Any]:
            return self._driver.to_json(snapshot, cost_s=measured["cost_s"])

        start = self._clock()
        try:
            self.orbax.wait_until_finished()  # a still-running save is a real stall: timed
            self._collect_garbage()
            self._clear_uncommitted(step)
            if not self._async:
                # A synchronous Orbax save waits for every item, the policy item included, so
                # that item records the cost measured so far; the policy itself is fed the
                # whole blocking time below.
                measured["cost_s"] = self._clock() - start
                ready.set()
            self.orbax.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: storage.StripedSave(state),
                        POLICY_ITEM: PolicyStateSave(build=build, ready=ready),
                    }
                ),
                force=True,
            )
        finally:
            measured["cost_s"] = self._clock() - start
            self._driver.cost_s = measured["cost_s"]
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

    # -- garbage collection -----------------------------------------------------------------

    def _collect_garbage(self) -> None:
        """Empties the trash and removes stripe directories no committed step references.

        Runs only on the primary process and only while no save is in flight (callers have
        waited), so the only unreferenced stripes are those of deleted steps and of crashed
        saves. Steps are read from disk, not from Orbax's cache, so a committed step's data is
        never removed even if another tool listed it differently.
        """
        if self._read_only or not self._primary:
            return
        trash = self._directory / TRASH_DIR
        if trash.is_dir():
            for entry in trash.iterdir():
                shutil.rmtree(entry, ignore_errors=True)
        if not self._stripe_roots:
            return
        referenced: set[Path] = set()
        for entry in self._directory.iterdir():
            if STEP_RE.match(entry.name):
                refs = self._stripes_of(entry)
                if refs is None:
                    return  # a step whose stripes are unknown: removing any could lose its data
                referenced |= refs
        for root in self._stripe_roots:
            for stripe_dir in storage.find_stripe_dirs(root):
                if stripe_dir.resolve() not in referenced:
                    log.info("removing unreferenced stripe directory %s", stripe_dir)
                    shutil.rmtree(stripe_dir, ignore_errors=True)

    def _stripes_of(self, step_dir: Path) -> set[Path] | None:
        """Stripe directories a step references; None when that cannot be known.

        No manifest, or one that is not JSON (torn), means an uncommitted step: nothing is
        referenced. A manifest that is JSON but cannot be interpreted (say, a newer format) or
        cannot be read (I/O error) gives None, and the caller then removes nothing. A committed
        manifest never changes, so a known answer is cached per step directory and manifest
        version (its modification time).
        """
        manifest = step_dir / STATE_ITEM / storage.MANIFEST_NAME
        try:
            key = (str(step_dir), manifest.stat().st_mtime_ns)
            if key in self._stripe_cache:
                return self._stripe_cache[key]
            json.loads(manifest.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return set()
        except OSError as e:
            log.warning("cannot read %s (%s): keeping every stripe for now", manifest, e)
            return None
        try:
            refs = storage.referenced_stripe_dirs(step_dir / STATE_ITEM)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("cannot interpret %s (%s): keeping every stripe", manifest, e)
            return None
        self._stripe_cache[key] = {p.resolve() for p in refs}
        return self._stripe_cache[key]

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
            self._t_mark = self._clock()
            self._timed = False
            return restored[STATE_ITEM]
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _load_policy(self, step: int) -> None:
        """Adopts the policy state saved with ``step``; keeps the current one if it cannot."""
        if self._read_only:
            return  # a reader never saves: the schedule is of no use to it
        where = self._directory / self._name_format.build_name(step) / POLICY_ITEM
        try:
            data = self.orbax.restore(
                step, args=ocp.args.Composite(**{POLICY_ITEM: PolicyStateRestore()})
            )[POLICY_ITEM]
            self._driver.load_json(data, where=str(where))
        except (ValueError, OSError, KeyError) as e:
            warnings.warn(
                f"policy state of step {step} not loaded ({e}); the policy keeps its current "
                "state.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        # The saved step counts as seen: the next call must be after it.
        self._driver.step = step

    # -- delete, wait, close ----------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Deletes a committed step and, with external roots, its stripes.

        Raises:
          FileNotFoundError: ``step`` is not a committed step.
        """
        self._check_open()
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"delete: step {step} is not a committed step in {self._directory} "
                f"(committed: {self.all_steps()})."
            )
        self.orbax.wait_until_finished()
        self.orbax.delete(step)
        self._committed.discard(step)
        self._collect_garbage()

    def wait_until_finished(self) -> None:
        """Blocks until the running save is committed (re-raises its error), then collects."""
        self._check_open()
        self.orbax.wait_until_finished()
        self.orbax.check_for_errors()
        self._collect_garbage()

    def close(self) -> None:
        """Waits for the running save, collects garbage, closes Orbax and releases the lock."""
        if self._closed:
            return
        try:
            self.orbax.wait_until_finished()  # re-raises a failed save: close all the same
            self._collect_garbage()
        finally:
            try:
                self.orbax.close()
            finally:
                self._closed = True
                self._release_lock()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"CheckpointManager for {self._directory} is closed.")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self):
        # A manager dropped without close() must not keep the directory locked; at interpreter
        # exit the modules used here may already be gone, hence the broad guard.
        try:  # noqa: SIM105
            self._release_lock()
        except Exception:
            pass
