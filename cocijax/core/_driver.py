"""The one driver of a policy in a training job, shared by every manager.

:class:`cocijax.CheckpointManager`, :class:`cocijax.torch.CheckpointManager` and
:class:`cocijax.SaveDecisionPolicy` all call :meth:`PolicyDriver.decide` once per training step
and let it measure: the step time is the time between consecutive calls, minus the time a save
blocked (the managers time their own saves with :meth:`PolicyDriver.saving`;
``SaveDecisionPolicy``, which Orbax calls before it saves, splits the interval that follows a save
into the step time it has and the save's cost). The first interval after opening or restoring is
not timed: it includes compilation. The driver feeds a :class:`cocijax.policies.Runner` (no
dispatch and no device sync on a step before the policy's next check), passes the job's learned
MTBF and recovery time (:mod:`cocijax.core._history`), and serialises everything a restarted
job needs to continue the same schedule.

**Robust inputs.** A process stopped for a while (``SIGSTOP``, a debugger, a suspended VM) or
a clock that jumps makes one interval far longer than the job's pace, or negative. Fed as they
were, one jump of 10^6 s made Young's rule save 54 steps in a row, or never again when it fell
inside a save. So the policy is fed the median of the last ``RECENT`` measurements of each
time, a negative interval is no measurement, and a save's cost counts at most ``COST_JUMP``
times the estimate before it (:mod:`cocijax.core._policy_inputs`): one pause never reaches the
policy, and a lasting change does from its second measurement (a disk 100 times slower from its
fourth save). A first step time waits for a second to confirm it: the policies smooth the step
time from its first value, which a paused first step would skew for hundreds of steps.

**The first save comes early.** While no save cost is known (a fresh job; not one that
restored the cost its checkpoint measured), the driver saves after the first timed step, the
second after opening (the first includes compilation): that save measures the real cost at
once and protects the job from its first minutes on. Until then the policy is given a cost
prior from the state's size (:func:`~cocijax.core._policy_inputs.prior_cost_s`; the managers
give the size at their first ``save`` call), unless it was built with a ``cost_prior_s`` of its
own, which wins. A policy whose decisions do not depend on the cost (``fixed``:
``Policy.uses_cost``) gets no early save.

**Two levels.** A two-level policy (``Policy.levels == 2``) decides a level per save
(:meth:`PolicyDriver.decide_level`): 1, a save that survives a process failure (a memory tier),
or 2, a persisted save. The managers time each level's saves apart (:meth:`PolicyDriver.saving`
with the level) and the policy gets both: ``checkpoint_cost_s`` is the level-1 stall (the
level-2 one until a level-1 save is timed: it costs no more), ``persist_cost_s`` the level-2
stall, and each failure class's MTBF and recovery time (``mtbf_s``/``recovery_s`` the process
failures', ``machine_mtbf_s``/``machine_recovery_s`` the machine failures', see
:mod:`cocijax.core._history`). A one-level policy's saves are all level 2; it is fed as before,
the MTBF of every failure. The early save, the final step's and a forced one are level 2.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, final

import jax
import numpy as np

from cocijax._validate import POSITIVE, check
from cocijax.core import _policy_state
from cocijax.core._collectives import broadcast_from_process_0, same_steps_on_every_process
from cocijax.core._contract import Measurements
from cocijax.core._history import MACHINE, PROCESS, RunHistory
from cocijax.core._policy_inputs import COST_JUMP, RecentTimes, prior_cost_s, read_loss
from cocijax.policies import Runner, coci, default_prior_mtbf_s
from cocijax.policies._base import DEFAULT_COST_PRIOR_S, check_policy

__all__ = ["PolicyDriver", "manager_driver"]


def manager_driver(
    policy: Any, prior_mtbf_s: float | None, *, clock: Callable[[], float]
) -> Callable[..., PolicyDriver]:
    """How a manager makes its driver, from its ``policy`` and ``prior_mtbf_s`` arguments.

    Both managers take the same two arguments with the same defaults, and drive the policy the
    same way: the job's learned MTBF starts from the prior, and a policy that knows the job's
    length saves its final step. The arguments are checked now, before the manager touches its
    directory; the driver is made once the directory's history is open.

    Args:
      policy: a :mod:`cocijax.policies` policy, or ``None`` for ``coci()``.
      prior_mtbf_s: the MTBF the learned estimate starts from, or ``None`` for
        :func:`cocijax.policies.default_prior_mtbf_s`.
      clock: the manager's monotonic clock in seconds.

    Returns:
      :class:`PolicyDriver` with those set: the manager passes ``history=`` and its own
      options.

    Raises:
      TypeError: ``policy`` is not a policy.
      ValueError: ``prior_mtbf_s`` is not a positive number.
    """
    policy = coci() if policy is None else policy
    check_policy(policy)
    prior = default_prior_mtbf_s() if prior_mtbf_s is None else prior_mtbf_s
    prior = check("prior_mtbf_s", prior, POSITIVE)
    return functools.partial(
        PolicyDriver, policy, clock=clock, prior_mtbf_s=prior, save_final_step=True
    )


@final
class PolicyDriver:
    """Runs one policy in a training job: measured inputs, learned failure rate, restartable.

    Args:
      policy: a :mod:`cocijax.policies` policy.
      clock: monotonic clock in seconds; injectable for deterministic tests.
      history: the job's failure history (learned MTBF and recovery time), or None.
      prior_mtbf_s: the MTBF the history's estimate starts from (see ``RunHistory.mtbf_s``).
      cost_from_intervals: the caller cannot time its saves: the interval after a "save"
        decision is split into the step time known so far and the save's cost.
      save_final_step: with a policy that knows the job's length (``policy.total_steps``),
        decide "save" at that step whatever the policy says, so that a finished job keeps its
        final state.
      broadcast: makes the measured inputs of every process equal before the policy sees them
        (see :class:`cocijax.policies.Runner`); default: JAX's broadcast from process 0. The
        PyTorch manager passes its process group's.
      same_steps: checks at every policy check (so before every save, see
        :meth:`snapshot`) that every process was given the same steps, raising
        :class:`~cocijax.core._contract.StepMismatchError` on all of them if not (see
        :class:`cocijax.policies.Runner`); default: one all-gather among JAX's processes;
        ``None`` checks nothing.
      compile_now: start compiling the policy's update in the background at once (see
        :meth:`compile_in_background`); a read-only manager, which never decides, passes
        False, and the JAX manager, which starts it at the first save after a restart.
      drain_s: how long the last drain to a durable tier took (the JAX manager's tier), for
        :meth:`measurements`; ``None`` without a durable tier.

    Attributes:
      step: the last step given to :meth:`decide`, or None.
      step_time_s: the job's step time in seconds, the median of the recent measurements (NaN
        before the first); saved with the checkpoint so that a restarted job has one at once.
      cost_s: the measured blocking time of the last save in seconds (NaN before the first).
      wants_state_size: the cost prior waits for the state's size (the policy uses the cost
        and was given no prior of its own): a manager calls :meth:`state_size` (once, at its
        first ``save``).
      loss: the loss the policy sees with the next step when the caller has no newer one (the
        last saved step's, after a restore).
    """

    def __init__(
        self,
        policy: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
        history: RunHistory | None = None,
        prior_mtbf_s: float = math.nan,
        cost_from_intervals: bool = False,
        save_final_step: bool = False,
        broadcast: Callable[[np.ndarray], np.ndarray] = broadcast_from_process_0,
        same_steps: Callable[[np.ndarray], None] | None = same_steps_on_every_process,
        compile_now: bool = True,
        drain_s: Callable[[], float] | None = None,
    ):
        check_policy(policy)
        self.policy = policy
        self.runner = Runner(policy, broadcast=broadcast, same_steps=same_steps)
        self._compiling = False  # compile_in_background was called
        if compile_now:
            self.compile_in_background()
        self.history = history
        # A finished job keeps its final state (and a rerun of it has nothing left to train).
        self._final_step = getattr(policy, "total_steps", None) if save_final_step else None
        # A policy whose decisions do not use the cost (fixed) is not given an early save.
        self._early_save = getattr(policy, "uses_cost", True)
        self._prior_mtbf_s = prior_mtbf_s
        self._clock = clock
        self._cost_from_intervals = cost_from_intervals
        self._drain_s = drain_s
        self._said_fresh = False  # a saved schedule that cannot continue is said once
        self.step: int | None = None
        self.cost_s = math.nan
        self.loss: Any = math.nan
        self._step_times = RecentTimes()
        self._timed_steps = 0  # step times measured (two for a checkpoint's: its job fed them)
        self._rough_step_times = False  # they are only upper bounds (see _measured)
        self._costs = RecentTimes(jump=COST_JUMP)  # level-2 saves' (a one-level policy's all)
        self._level1_costs = RecentTimes(jump=COST_JUMP)  # a two-level policy's level-1 saves'
        self.levels = getattr(policy, "levels", 1)
        # The cost assumed until one is measured (module docstring): from the state's size,
        # once a manager tells it; NaN lets the policy use its own ``cost_prior_s``, which
        # wins when it was given one.
        self._own_cost_prior_s = getattr(policy, "cost_prior_s", None)
        self._cost_prior_s = math.nan
        self.wants_state_size = self._early_save and self._own_cost_prior_s is None
        self._mark: float | None = None  # end of the previous call; None: the next is untimed
        self._saved_last = False  # the previous decision was "save" (cost_from_intervals)
        self._last: tuple[Any, dict, float] = (math.nan, {}, math.nan)  # see measurements

    def compile_in_background(self) -> None:
        """Starts compiling the policy's update in a thread, once (later calls do nothing).

        In a thread, so that the steps before the first check step run meanwhile; with the
        state the runner holds then (a restored one: no ``policy.init()`` to run).
        """
        if not self._compiling:
            self._compiling = True
            self.runner.compile(background=True)

    @property
    def state(self) -> Any:
        """The policy state (feeds the steps the runner recorded first)."""
        return self.runner.state

    @property
    def step_time_s(self) -> float:
        """The job's step time: the median of the recent measurements (see the attributes)."""
        return self._step_times.value

    @property
    def cost_estimate_s(self) -> float:
        """The save cost the policy uses: recent measurements' median, else its prior (its own
        when it was built with one, else the one from the state's size; NaN before either)."""
        return self._costs.value if self._costs.values else self._prior_s

    @property
    def _prior_s(self) -> float:
        own = self._own_cost_prior_s
        return self._cost_prior_s if own is None else own

    @property
    def mtbf_s(self) -> float:
        """The MTBF passed to the policy: the history's estimate, NaN without a history."""
        if self.history is None or not math.isfinite(self._prior_mtbf_s):
            return math.nan
        return self.history.mtbf_s(self._prior_mtbf_s)

    @property
    def recovery_s(self) -> float:
        """The recovery time passed to the policy (NaN until one is measured)."""
        return math.nan if self.history is None else self.history.recovery_s

    def class_mtbf_s(self, failure_class: str) -> float:
        """The learned MTBF of one failure class (NaN without a history or a prior)."""
        if self.history is None or not math.isfinite(self._prior_mtbf_s):
            return math.nan
        return self.history.class_mtbf_s(failure_class, self._prior_mtbf_s)

    def _class_recovery_s(self, failure_class: str) -> float:
        return math.nan if self.history is None else self.history.class_recovery_s(failure_class)

    def _inputs(self, step_time: float) -> dict[str, float]:
        """What the policy is given besides the step and its loss (see the module docstring)."""
        # Before any measurement, a policy with a prior of its own is given none.
        cost = self._costs.value if self._costs.values else self._cost_prior_s
        if self.levels == 1:
            return dict(
                step_time_s=step_time,
                checkpoint_cost_s=cost,
                mtbf_s=self.mtbf_s,
                recovery_s=self.recovery_s,
            )
        return dict(
            step_time_s=step_time,
            checkpoint_cost_s=self._level1_costs.value if self._level1_costs.values else cost,
            persist_cost_s=cost,
            mtbf_s=self.class_mtbf_s(PROCESS),
            recovery_s=self._class_recovery_s(PROCESS),
            machine_mtbf_s=self.class_mtbf_s(MACHINE),
            machine_recovery_s=self._class_recovery_s(MACHINE),
        )

    def state_size(self, nbytes: float) -> None:
        """Sets the cost prior from the size of the state saved (:func:`prior_cost_s`)."""
        self.wants_state_size = False
        self._cost_prior_s = prior_cost_s(nbytes)

    def measurements(self) -> Measurements:
        """What the policy was given at the last :meth:`decide` call (reads its loss).

        A value the policy was built with (``coci(mtbf_s=...)``) is what it used, so that is
        the MTBF or recovery time reported.
        """
        loss, inputs, cost = self._last
        inputs = inputs or self._inputs(math.nan)  # before the first decision: as of now
        own = {k: getattr(self.policy, k, None) for k in ("mtbf_s", "recovery_s")}
        used = {k: v if own.get(k) is None else own[k] for k, v in inputs.items()}
        # A one-level policy is given no machine class's values: the learned ones are shown.
        return Measurements(
            step_time_s=used.get("step_time_s", math.nan),
            loss=read_loss(loss),
            cost_estimate_s=cost,
            last_save_s=self.cost_s,
            mtbf_s=used.get("mtbf_s", math.nan),
            recovery_s=used.get("recovery_s", math.nan),
            failures=0 if self.history is None else self.history.failures,
            drain_s=math.nan if self._drain_s is None else self._drain_s(),
            persist_cost_estimate_s=self.cost_estimate_s,
            machine_mtbf_s=used.get("machine_mtbf_s", self.class_mtbf_s(MACHINE)),
            machine_recovery_s=used.get("machine_recovery_s", self._class_recovery_s(MACHINE)),
            machine_failures=0 if self.history is None else self.history.machine_failures,
        )

    def restart_timing(self) -> None:
        """The next interval is not timed (after opening, or a restore: compilation, loading)."""
        self._mark = None
        self._saved_last = False

    def decide(self, step: int, *, loss: Any) -> bool:
        """:meth:`decide_level`, as a bool: True for a save of either level."""
        return self.decide_level(step, loss=loss) > 0

    def decide_level(self, step: int, *, loss: Any) -> int:
        """Measures the step that just ended, feeds it to the policy and returns its decision.

        Args:
          step: the completed training step (1-based).
          loss: its loss: a number or a staged one-element array (see
            :func:`~cocijax.core._policy_inputs.stage_loss`), read only at the policy's next
            check.

        Returns:
          The level: 0 no save; 1 a two-level policy's level-1 save; 2 a persisted save: a
          one-level policy's save, the final step (``save_final_step``), or the first timed
          step while no save cost is known yet (see the module docstring).
        """
        now = self._clock()
        # Whether this step was timed without a save in it (a cost_from_intervals caller's
        # interval after a save holds one): the early save's cost is split off such a time.
        clean = self._mark is not None and not (self._cost_from_intervals and self._saved_last)
        if self._mark is not None:
            self._measured(now - self._mark, clean=clean)
        if self.history is not None:
            self.history.step_done()
        self.step = step
        # One step time could be a pause: the policy gets step times once two were measured
        # (or a checkpoint's, which its job fed).
        step_time = self.step_time_s if self._timed_steps > 1 else math.nan
        inputs = self._inputs(step_time)
        # The cost shown: the estimate (its prior included) of a level-1 save for two levels.
        shown = self._level1_costs.value if self._level1_costs.values else self.cost_estimate_s
        self._last = (loss, inputs, self.cost_estimate_s if self.levels == 1 else shown)
        level = self.runner.decide(step, loss=loss, **inputs)
        early = clean and self._early_save and not self._costs.values
        if early:
            self._early_save = False  # once: a save whose timing was lost is not redone
        if early or step == self._final_step:
            level = 2
        self._saved_last = level > 0
        self._mark = self._clock()
        return level

    def _measured(self, interval: float, *, clean: bool) -> None:
        """Takes the interval since the previous call: a step time, or a step and a save."""
        if not clean and not self._rough_step_times and self._step_times.values:
            # A jitter may make the interval shorter than the step time: a free save.
            self.cost_s = max(interval - self.step_time_s, 0.0)
            self._costs.add(self.cost_s, self._cost_reference)
            return
        if clean and self._rough_step_times:  # a real step time replaces the upper bounds
            self._step_times.values.clear()
        # Without a step time to split it with, a step and a save are all there is: an upper
        # bound of the step time (a policy that saves at every step still learns one).
        self._rough_step_times = not clean
        self._step_times.add(interval)
        self._timed_steps += 1

    @property
    def _cost_reference(self) -> float:
        """What a first measured cost is capped against (``COST_JUMP`` times it).

        The prior, but at least the policies' default cost prior (10 s): a small state's first
        save may well take a few seconds (a slow file system, a slow ``extra`` item), which
        must not be cut; a pause of days must.
        """
        prior = self._prior_s
        return max(prior, DEFAULT_COST_PRIOR_S) if math.isfinite(prior) else DEFAULT_COST_PRIOR_S

    @contextlib.contextmanager
    def saving(self, level: int = 2) -> Iterator[dict[str, float]]:
        """Times a save's blocking part as the checkpoint cost; the next step excludes it.

        Args:
          level: the save's level: a level-1 save's stall is a two-level policy's
            ``checkpoint_cost_s``, a level-2 save's its ``persist_cost_s`` (a one-level
            policy's saves are all level 2).

        Yields a dict whose ``"cost_s"`` is filled in when the block exits (also on an error).
        """
        start = self._clock()
        measured: dict[str, float] = {"start": start}
        try:
            yield measured
        finally:
            end = self._clock()
            costs = self._level1_costs if level == 1 else self._costs
            costs.add(end - start, self._cost_reference)
            if level == 2:
                self._early_save = False  # a cost is measured (or its clock jumped back)
            measured["cost_s"] = self.cost_s = max(end - start, 0.0)
            self._mark = end

    def snapshot(self, loss: Any, level: int = 2) -> dict[str, Any]:
        """Captures what the checkpoint of the current step records (no device sync).

        The steps recorded since the policy's last check are fed to it first: so the
        processes' steps are compared (``same_steps``) before every save.

        Args:
          loss: the current step's loss as given by the user (read later, off the train loop).
          level: the level of the save that records it (its cost joins that level's).
        """
        return {
            "leaves": jax.tree_util.tree_flatten_with_path(self.state)[0],  # as of this step
            "state_type": type(self.state).__name__,
            "step": self.step,
            "step_times": self._step_times.copy(),
            "costs": self._costs.copy(),
            "level1_costs": self._level1_costs.copy(),
            "level": level,
            "cost_reference": self._cost_reference,
            "cost_s": self.cost_s,
            "loss": loss,
            "history": None if self.history is None else self.history.to_json(),
        }

    def to_json(self, snapshot: dict[str, Any], *, cost_s: float | None = None) -> dict[str, Any]:
        """Serialises a :meth:`snapshot` (the format: :mod:`cocijax.core._policy_state`).

        Args:
          snapshot: what :meth:`snapshot` captured.
          cost_s: the measured cost of the save that records it (taken after the snapshot);
            None when the snapshot holds every cost measured.
        """
        return _policy_state.to_json(snapshot, cost_s=cost_s)

    def load_json(self, data: dict[str, Any], *, where: str) -> None:
        """Adopts state written by :meth:`to_json`.

        Args:
          data: the decoded JSON.
          where: the file it came from, for error messages.

        Raises:
          ValueError: the data was written by something else or by a different policy.
        """
        # Everything is decoded before anything is adopted: a damaged file changes nothing.
        saved = _policy_state.from_json(data, self.policy, where=where)
        self.runner.state = saved.policy_state
        self.step = saved.step
        self._step_times, self._costs, self.loss = saved.step_times, saved.costs, saved.loss
        self._level1_costs = saved.level1_costs
        self._timed_steps = 2 if saved.step_times.values else 0
        self._rough_step_times = False
        self.cost_s = saved.cost_s if saved.cost_s >= 0.0 else math.nan

    def adopt(self, data: Any, *, where: str, stacklevel: int, history: bool = False) -> bool:
        """Adopts a saved policy state (:meth:`load_json`), or warns once that it cannot.

        A state saved by another policy (or damaged) cannot be continued: the policy keeps the
        schedule it has, and :meth:`start_fresh` says so.

        Args:
          data: the decoded JSON saved with a checkpoint.
          where: the file it came from, for the warning.
          stacklevel: as for ``warnings.warn``, counted from the caller (1: its own line).
          history: also adopt the job history saved with it (any policy's: it is the job's).
            Only from a policy item (its format checked; the JAX manager's handler checks its
            digest) holding a history a job can have (``_history.check_saved``): otherwise
            nothing of the item is adopted, neither the history nor the policy state.

        Returns:
          Whether the policy state was adopted.
        """
        try:
            if history and self.history is not None:
                if not _policy_state.is_policy_state(data):
                    raise ValueError(
                        f"{where}: not a cocijax policy state (expected {_policy_state.FORMAT})"
                    )
                damage = self.history.adopt(data.get("history"))
                if damage:
                    raise ValueError(f"{where}: the job history on disk is damaged ({damage})")
            self.load_json(data, where=where)
        except (KeyError, TypeError, ValueError) as e:
            self.start_fresh(str(e), stacklevel=stacklevel + 1)
            return False
        return True

    def start_fresh(self, reason: str, *, stacklevel: int) -> None:
        """Warns that a saved schedule cannot be continued (once per driver, so per manager).

        Args:
          reason: why, naming the file.
          stacklevel: as for ``warnings.warn``, counted from the caller (1: its own line).
        """
        if self._said_fresh:
            return
        self._said_fresh = True
        warnings.warn(
            f"{reason}; this manager's policy starts its schedule fresh.",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )

    def compile_count(self) -> int:
        """How many times the batched update has been compiled (1 after the first step)."""
        return self.runner.compile_count()
