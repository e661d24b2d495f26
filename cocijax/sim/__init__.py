"""Fault-injection simulator that scores a save schedule.

A job of ``n_steps`` steps of ``step_time_s`` seconds saves after each step in ``save_steps``;
every save stalls training for ``checkpoint_cost_s`` seconds and is complete at the end of the
stall. Failures come from a renewal process (Weibull inter-arrival times with shape
``weibull_shape`` and mean ``mtbf_s``; shape 1 is a Poisson process). After a failure the job
spends ``recovery_s`` seconds recovering (a failure during recovery restarts it), then rolls back
to the newest completed checkpoint and recomputes. Failures can hit during work, a stall,
recovery or recomputation alike.

**Two levels.** Given ``machine_mtbf_s`` (with ``persist_cost_s`` and ``machine_recovery_s``),
every scorer models a job that saves at two levels (:mod:`cocijax.sim._levels`): a level-1 save
(stall ``checkpoint_cost_s``, e.g. to memory) survives a process failure (MTBF ``mtbf_s``,
recovery ``recovery_s``); a level-2 save (stall ``persist_cost_s``, e.g. to durable storage)
also survives a machine failure (MTBF ``machine_mtbf_s``, recovery ``machine_recovery_s``),
which rolls the job back to its newest level-2 save. A schedule is then a :class:`Schedule`
(steps and the level of each save); plain steps are all level-2 saves (a one-level policy's).

Overhead is reported in two currencies:

* wall seconds: stall + recomputation + recovery, i.e. the wall time beyond ``n_steps *
  step_time_s``;
* weighted seconds: stall + recovery + recomputed seconds, each weighted by ``w`` of the step it
  recomputes (see :func:`progress_weights`). With ``weights=None`` every ``w`` is 1 and both
  currencies agree.

Ways to score a schedule, and the best schedule:

* :func:`simulate` (Monte Carlo, any Weibull shape) walks the schedule segment by segment (a
  segment is the work between two saves plus the stall that ends it), vectorised over trials;
  it only loops in Python over segments and over the failures of one segment. A trial that has
  lost more than ``max_overhead_factor`` times the job's failure-free time is abandoned as not
  finishing: a schedule that rarely saves under a high failure rate needs ``exp(job / MTBF)``
  restarts, which no simulation (and no job) should wait for.
* :func:`replay` runs the model of :func:`simulate` once, with failures at given times (a
  recorded run's), to predict what that run should have lost; it can also let saves commit
  some time after their stall (asynchronous saves), which :func:`simulate` does not.
* :func:`expected_overhead` gives the exact expectation under Poisson failures, segment by
  segment (the formula is in :mod:`cocijax.policies._horizon`, which plans with it).
* :func:`optimal_schedule` is the schedule minimising the expected weighted overhead under
  Poisson failures, by dynamic programming over checkpoint positions (Toueg and Babaoglu,
  SIAM J. Comput. 1984, here with per-step weights): the exact offline optimum, a bound no
  online policy can beat.
"""

from cocijax.sim._exact import (
    Expected,
    expected_overhead,
    expected_overhead_periodic,
    optimal_schedule,
)
from cocijax.sim._levels import Schedule
from cocijax.sim._model import MAX_OVERHEAD_FACTOR, SimResult, progress_weights
from cocijax.sim._montecarlo import replay, simulate

__all__ = [
    "MAX_OVERHEAD_FACTOR",
    "Expected",
    "Schedule",
    "SimResult",
    "expected_overhead",
    "expected_overhead_periodic",
    "optimal_schedule",
    "progress_weights",
    "replay",
    "simulate",
]
