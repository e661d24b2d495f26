"""``cocijax.torch.CheckpointManager``: the same save policies drive a PyTorch training loop.

It has the contract of ``cocijax.CheckpointManager``: call ``save(step, state, loss=loss)``
after every training step and the policy decides whether this step is checkpointed. Data is
written by ``torch.distributed.checkpoint`` (DCP) with ``async_save``: only the copy of the
tensors to host memory blocks the loop; the write, the ``fsync`` and the atomic commit (a rename
of a temporary directory, see ``_directory``) happen in the background.

Under ``torchrun`` every rank opens its manager and calls ``save`` and ``restore``: DCP writes
each rank's shards into the one step directory, every rank takes rank 0's decisions (its
measured inputs are broadcast, see ``_ranks``), and rank 0 alone commits, deletes and holds the
directory's lock, once every rank's writes are done.

Retention and preemption are the JAX manager's, from the same modules: best-N by ``metrics``
(``cocijax.core._retention``, rank 0 deciding from the metrics in each step's
``cocijax.json``) and preemption signals turned into one save (``cocijax.core._preemption``,
the ranks' flags gathered on the ``control`` group so that all save the same step).

The memory tier (``memory=``) is the JAX manager's too, its rules from ``cocijax.core._memory``
and its files in this manager's format (``_memory``): a level-1 save lands in memory only, a
persisted one in memory and then on the disk; ``restore`` reads memory first. With several
ranks each keeps its own memory tier, and a step restores from memory only if all can.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, final

from cocijax import policies as _policies
from cocijax.core._contract import (
    MEASUREMENTS,
    POLICY_STATE,
    FromDriver,
    ManagerClosedError,
    check_step_order,
)
from cocijax.core._driver import manager_driver
from cocijax.core._history import RunHistory, failed_exit, process_age_s
from cocijax.core._lock import DirectoryLock
from cocijax.core._memory import check_memory
from cocijax.core._preemption import Preemption, PreemptionWatcher, check_signals
from cocijax.core._retention import BestN, MetricsCheck, Retention
from cocijax.core._session import run_all
from cocijax.torch import _restoring, _saving
from cocijax.torch._directory import open_directory, read_metadata
from cocijax.torch._memory import MemoryTier, mark_ranks, open_tier
from cocijax.torch._ranks import Ranks
from cocijax.torch._state import (
    RESERVED,
    as_float,
    as_step,
    tree_nbytes,
)

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)

# DCP warns on every single-process save/load, even with no_dist=True, which is this module's
# mode without a process group; the async save warns from a worker thread, where
# catch_warnings cannot reach.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent",
    category=UserWarning,
)


@final
class CheckpointManager:
    """Saves and restores PyTorch training state when a cocijax policy says so.

    ``state`` is a dict of named objects, the same dict for ``save`` and ``restore``:

    * ``torch.nn.Module``: saved with ``get_model_state_dict`` and loaded in place (a
      ``fully_shard``/FSDP model as its shards, each rank its own);
    * ``torch.optim.Optimizer``: saved with ``get_optimizer_state_dict`` (keyed by parameter
      names, so a freshly built optimizer can be restored into) and loaded in place; its
      parameters must belong to the modules in the same dict;
    * anything else with ``state_dict``/``load_state_dict`` (LR schedulers, ``GradScaler``):
      handled by DCP's ``Stateful`` protocol;
    * tensors, numbers, strings and nested dicts of them: saved as they are; ``restore``
      returns the loaded values.

    ``extra`` (a dict of name -> object with ``state_dict``/``load_state_dict``, e.g. a
    ``torchdata`` ``StatefulDataLoader``) is saved per rank, each rank's own object, and loaded
    in place by ``restore(..., extra=...)``. The manager also saves each rank's RNG states of
    ``torch`` (and CUDA when present), ``numpy`` and Python's ``random``, restored by
    ``restore``; the key ``"cocijax"`` of ``state`` is reserved for them.

    The policy is fed as by the JAX manager (:mod:`cocijax.core`): measured step times and
    save costs, the loss, the job's learned failure rate; step 2 of a fresh job is saved to
    measure the cost. A policy that knows ``total_steps`` saves the last step; otherwise pass
    ``force=True`` there. ``metrics`` are recorded in the step's ``cocijax.json`` and ranked by
    ``best_fn`` (the ``max_to_keep`` best and the ``keep_latest`` newest steps are kept). A
    preemption signal makes the next ``save`` save and commit, then ends the job as the signal
    would have (``exit_on_preemption``); with several ranks, a signal to any one is enough.

    **Several ranks.** Initialise the process group before opening the manager; opening,
    ``save``, ``restore`` and ``close`` are collective (the same steps and ``force`` on every
    rank), the directory one every rank sees. Rank 0's inputs decide for all; rank 0 alone
    locks, commits and deletes; every rank restores its own shards, RNG states and extra items
    (and keeps its own memory tier). See the docs' "PyTorch" page.

    Args:
      directory: where checkpoints live; created if missing.
      policy: a ``cocijax.policies.Policy``; defaults to ``cocijax.policies.coci()``.
      max_to_keep: keep only the newest this many committed steps (``None`` keeps all); with
        ``best_fn``, this many of the best steps.
      best_fn: ranks a step by its ``metrics`` (a dict -> a number): the ``max_to_keep`` best
        steps are kept, and the ``keep_latest`` newest whatever their metrics. A step saved
        without ``metrics`` is not ranked: it is kept only while it is one of the newest.
      best_mode: ``"max"`` (default) or ``"min"``: whether larger ``best_fn`` values are better.
      keep_latest: with ``best_fn``, the newest steps kept whatever their metrics (default 1;
        0 ranks every step, the newest too).
      preemption_signals: the signals that announce a preemption (default SIGTERM); ``()``
        turns preemption saves off.
      exit_on_preemption: once the preemption save has committed, close the managers and let
        the signal end the process as it would have without cocijax (as for the JAX manager);
        ``False``: ``save`` returns True and sets :attr:`reached_preemption`.
      use_async: write in the background with ``dcp.async_save`` (default); ``False`` writes
        and commits inside ``save``.
      prior_mtbf_s: the MTBF the learned estimate starts from (as for the JAX manager).
      memory: a memory tier: a folder on a tmpfs, or True for one under the machine's
        shared-memory tmpfs (as for the JAX manager). Every save lands there first, in this
        manager's format (it survives the process's death, not the machine's); a two-level
        policy's level-1 saves go there only, every other save (a one-level policy's,
        ``force``, the final step, a preemption save) also to ``directory``, written from the
        same snapshot in the background. Two slots: the newest committed memory step is never
        overwritten. One folder per directory (its identity, ``.cocijax-id``), and per rank
        with several: each rank keeps its own state there. ``restore`` reads memory first (a
        damaged copy is skipped, warned); with several ranks, only a step whose memory copy
        checks out on every rank (see :attr:`restored_tier`).
      memory_bytes: the memory tier's budget (default: two states, at most the tmpfs's free
        space), checked at the first save: a state that does not fit is a ``ValueError``
        naming the sizes; with ``memory=True`` the manager warns and saves to the disk only.
      clock: a monotonic clock in seconds; injectable so tests can replay step times.

    Raises:
      ValueError: when ``max_to_keep`` < 1, ``best_mode``/``keep_latest``/
        ``preemption_signals``/``memory_bytes`` are out of range, ``directory`` holds
        checkpoints that were not written by ``cocijax.torch``, or ``memory`` overlaps
        ``directory`` or belongs to a copy of it.
      TypeError: when ``policy`` is not a policy, ``best_fn`` is not callable,
        ``preemption_signals`` is not a sequence of signals, or ``memory``/``memory_bytes``
        have the wrong type.
      DirectoryLockedError: another manager has the directory (or its memory folder) open
        for writing.

    Examples:
      >>> import tempfile, torch, cocijax as cj, cocijax.torch as cjt
      >>> model = torch.nn.Linear(4, 1)
      >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
      >>> path, n = tempfile.mkdtemp(), 250
      >>> with cjt.CheckpointManager(path, policy=cj.policies.fixed(100)) as mngr:
      ...     state = {"model": model, "optimizer": opt}
      ...     start = mngr.latest_step() or 0
      ...     if start:
      ...         _ = mngr.restore(target=state)
      ...     for step in range(start + 1, n + 1):
      ...         loss = model(torch.ones(4)).pow(2).sum()
      ...         opt.zero_grad(); loss.backward(); opt.step()
      ...         _ = mngr.save(step, state, loss=loss, force=step == n)
      ...     mngr.wait_until_finished()
      ...     mngr.all_steps()
      [100, 200, 250]
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        policy: _policies.Policy | None = None,
        max_to_keep: int | None = None,
        best_fn: Callable[[Mapping[str, Any]], Any] | None = None,
        best_mode: str = "max",
        keep_latest: int = 1,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        exit_on_preemption: bool = True,
        use_async: bool = True,
        prior_mtbf_s: float | None = None,
        memory: bool | str | os.PathLike[str] | None = None,
        memory_bytes: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        age = process_age_s()
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        best = None
        if best_fn is not None:
            best = BestN(
                best_fn, best_mode=best_mode, max_to_keep=max_to_keep, keep_latest=keep_latest
            )
        signals = check_signals(preemption_signals)
        if not isinstance(exit_on_preemption, bool):
            raise TypeError(f"exit_on_preemption: expected a bool, got {exit_on_preemption!r}.")
        make_driver = manager_driver(policy, prior_mtbf_s, clock=clock)
        self._dir = Path(directory)
        self._ranks = Ranks()
        self._dir_lock = DirectoryLock(self._dir)
        self._memory: MemoryTier | None = None
        self._lock = threading.Lock()
        lead = lambda fn: self._ranks.lead(fn, group=self._ranks.control)
        try:
            # Each rank keeps a memory tier of its own (see _memory): any number of ranks.
            options = check_memory(
                memory, memory_bytes, self._dir.absolute(), processes=1, stacklevel=3
            )
            opened = lead(lambda: open_directory(self._dir, self._dir_lock))
            self._steps, self._session, identity, opening, token = opened
            if options is not None:
                self._memory = open_tier(
                    options, identity, self._ranks, directory=self._dir.absolute(),
                    opening=opening, newest_on_disk=max(self._steps, default=None),
                )  # fmt: skip
            peers = [] if self._memory is None else mark_ranks(self._memory, self._ranks, token)
            latest = lead(self._newest_metadata)
        except BaseException:
            run_all(
                self._memory.close if self._memory is not None else (lambda: None),
                self._dir_lock.release,
                self._ranks.close,
            )
            raise
        self._restored: tuple[int, str] | None = None
        self._history = RunHistory(
            self._dir,
            clock=clock,
            writer=self._ranks.leader,
            opened_at_age_s=age,
            memory_marker=None if self._memory is None else self._memory.marker,
            token=token,
            peer_memory_tokens=peers,
        )
        # The steps of the ranks are not compared (JAX's check would start JAX's backend here).
        self._driver = make_driver(
            history=self._history, broadcast=self._ranks.broadcast, same_steps=None
        )
        self._retention = Retention(best, max_to_keep)
        self._check_metrics = MetricsCheck(best)  # a step without metrics: said once
        self._use_async = use_async
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "cocijax-torch-commit")
        self._pending: concurrent.futures.Future | None = None
        self._closed = False
        self._history.adopt(None)
        if latest is None and self._ranks.leader:
            log.info("no checkpoint in %s: starting at step 1", self._dir)
        if latest is not None:
            newest = self.latest_step()
            path = self._step_dir(newest)
            _restoring.load_policy_state(self, latest, path, history=True)
        # A signal to any rank counts: a scheduler may notify one node, and torchrun forwards
        # a signal to its ranks one after the other (rank 0's broadcast would miss the others).
        watcher = PreemptionWatcher(
            signals,
            owner=str(self._dir),
            allgather=self._ranks.allgather if self._ranks.world > 1 else None,
            exit_on_preemption=exit_on_preemption,
        )
        watcher.install(on_end=self.close)
        self._preemption = Preemption(watcher, owner=str(self._dir))

    def _newest_metadata(self) -> dict | None:
        """Rank 0, at opening: the newest step's ``cocijax.json`` (its memory copy's first)."""
        newest = self.latest_step()
        return None if newest is None else read_metadata(self._step_dir(newest).parent, newest)

    # ----------------------------------------------------------------------------- queries
    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._dir

    @property
    def rank(self) -> int:
        """This process's rank (0 without a process group)."""
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        """The number of ranks saving together (1 without a process group)."""
        return self._ranks.world

    policy_state = POLICY_STATE
    measurements = MEASUREMENTS
    checkpoint_cost_s = FromDriver(
        lambda driver: driver.cost_s,
        "The latest measured stall of a save in seconds (NaN before the first save).",
    )

    @property
    def reached_preemption(self) -> bool:
        """A preemption signal arrived and its step has been saved and committed: stop now."""
        return self._preemption.reached

    @property
    def restored_step(self) -> int | None:
        """The step the last :meth:`restore` loaded (None before one)."""
        return None if self._restored is None else self._restored[0]

    @property
    def restored_tier(self) -> str | None:
        """Which tier served the last :meth:`restore`: ``"memory"`` or ``"local"`` (the
        directory), or None before one."""
        return None if self._restored is None else self._restored[1]

    def all_steps(self) -> list[int]:
        """Saved steps of every tier, oldest first, including one still being written."""
        with self._lock:
            return sorted(set(self._steps).union(self.memory_steps()))

    def latest_step(self) -> int | None:
        """The newest saved step (possibly still being written), or ``None``."""
        return max(self.all_steps(), default=None)

    def memory_steps(self) -> list[int]:
        """Steps in the memory tier, oldest first (``[]`` without one), one being written
        included."""
        return [] if self._memory is None else sorted(self._memory.steps)

    def _step_dir(self, step: int) -> Path:
        """Where ``step`` is read from: its memory copy if it has one, else the directory's."""
        if step in self.memory_steps():
            return self._memory.path / str(step)
        return self._dir / str(step)

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The ``metrics`` saved with ``step`` (rank 0's), or ``None`` without; waits for a save
        in flight.

        Raises:
          FileNotFoundError: ``step`` is not a committed step.
        """
        self.wait_until_finished()
        if step not in self.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self._dir}; have {self.all_steps()}"
            )
        return read_metadata(self._step_dir(step).parent, step).get("metrics")

    # -------------------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        loss: Any,
        force: bool = False,
        extra: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> bool:
        """Reports a finished training step; checkpoints it when the policy says so.

        After a preemption signal, the step is saved whatever the policy says, and ``save``
        returns only once it is committed (see the class docstring).

        Args:
          step: the number of completed training steps (1-based), larger than every saved step.
          state: the named objects to save (see the class docstring).
          loss: this step's training loss (a float or a 0-d tensor; NaN/inf are passed on and
            ignored by the policies). A tensor is read with ``float``, which waits for it.
          force: save whatever the policy decides (e.g. the last step of a job whose policy
            does not know ``total_steps``). The policy is still called, so its state keeps
            counting steps. With several ranks, the same on all.
          extra: further objects with ``state_dict``/``load_state_dict`` saved with the step,
            per rank (e.g. ``{"loader": stateful_dataloader}``); looked at only when this step
            is saved, so passing them at every call costs nothing.
          metrics: scalars recorded with the step (numbers or one-element tensors; rank 0's
            with several ranks); ``best_fn`` ranks the steps by them. Looked at only when this
            step is saved.

        Returns:
          True when this step is being saved (a preemption save: has been committed).

        Raises:
          ValueError: when ``step`` is not larger than the latest saved step or the previous
            call's, ``loss`` has several elements, ``state`` uses the reserved key
            ``"cocijax"``, ``extra`` a reserved name (``state``, ``policy``), or ``best_fn``
            fails on ``metrics``.
          TypeError: when ``step`` is not an int, ``loss`` is not a number, an ``extra``
            object lacks ``state_dict``/``load_state_dict`` (naming its key), or ``metrics``
            holds a non-scalar (naming its key).
        """
        self._check_open()
        step = as_step(step)
        check_step_order(step, self.latest_step(), self._driver.step, self._dir)
        if RESERVED in state:
            raise ValueError(f"state key {RESERVED!r} is reserved by cocijax.torch")
        loss = as_float(loss)
        if self._driver.wants_state_size:  # once: the cost assumed until a save is timed
            self._driver.state_size(tree_nbytes(state))
        level = max(self._driver.decide_level(step, loss=loss), 2 * force)
        preempted = self._preemption.due(step, self._driver.step_time_s)
        if not (level or preempted):
            return False
        level = 2 if preempted else level
        _saving.save_step(self, step, state, loss, extra, metrics, level)
        if preempted:
            self._preemption.taken(step, self.wait_until_finished)
        return True

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is committed; re-raises its error."""
        self._wait_pending()

    # ----------------------------------------------------------------------------- restore
    def restore(
        self,
        step: int | None = None,
        target: Mapping[str, Any] | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> Any:
        """Loads a checkpoint into ``target`` in place, with the RNG and policy states.

        With a memory tier, a step's memory copy is read first: one that does not check out
        (torn, a file that fails its checksum) is skipped with a warning (and deleted) for the
        next copy, the older memory slot then the directory's (see :attr:`restored_tier`).

        Args:
          step: the step to restore; defaults to the latest.
          target: the same kind of dict that was passed to ``save`` (modules, optimizers and
            stateful objects are loaded in place; tensors are filled in place).
          extra: objects saved as ``extra`` (the same names), loaded in place, each rank its
            own.

        Returns:
          ``target`` as a new dict whose plain (non-stateful) values are the loaded ones; with
          ``extra``, the pair ``(that dict, extra)``.

        Raises:
          FileNotFoundError: when there is no checkpoint (at ``step``).
          ValueError: when ``target`` is missing or asks for keys the checkpoint lacks, when
            ``extra`` names an item the step does not have or the step was saved by another
            number of ranks (extra items are per rank).
          TypeError: when an ``extra`` object lacks ``state_dict``/``load_state_dict``.
        """
        self._check_open()
        self.wait_until_finished()
        return _restoring.restore(self, step, target, extra)

    # ----------------------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(f"CheckpointManager for {self._dir} is closed.")

    def close(self) -> None:
        """Waits for the save in flight and releases the background thread and the lock."""
        if self._closed:
            return
        self._closed = True
        # Each runs whatever the ones before raised: the lock is always released and the
        # previous signal handlers are always back.
        run_all(
            self.wait_until_finished,
            lambda: self._executor.shutdown(wait=True),
            self._preemption.watcher.uninstall,
            self._history.close,
            self._memory.close if self._memory is not None else (lambda: None),
            self._dir_lock.release,
            self._ranks.close,
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __del__(self):
        # A manager dropped without close() must not keep the directory locked; at interpreter
        # exit the modules used here may already be gone, hence the broad guard.
        for release in (lambda: self._memory.close(), lambda: self._dir_lock.release()):
            try:  # noqa: SIM105
                release()
            except Exception:  # no memory tier (None), or opened no further
                pass

    def __exit__(self, *exc: Any) -> None:
        if failed_exit(exc[1], preempted=self._preemption.reached):
            self._history.failed()  # the next run counts it (a rank died, a Ctrl-C)
        self.close()
