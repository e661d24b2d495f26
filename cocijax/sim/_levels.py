"""The two-level cost model: its schedules, its arguments, and its exact expectation.

A two-level job saves at two levels. A level-1 save (stall ``checkpoint_cost_s``, ``C1``)
survives a *process* failure (mean time between them ``mtbf_s``); a level-2 save (stall
``persist_cost_s``, ``C2``) also survives a *machine* failure (``machine_mtbf_s``), and counts as
a level-1 save too. A process failure rolls the job back to its newest save of either level and
costs a recovery of ``recovery_s`` (``R1``); a machine failure rolls it back to its newest
level-2 save and costs ``machine_recovery_s`` (``R2``), the level-1 saves since then being lost
with the machine. A failure during a recovery restarts it; a machine failure during a level-1
recovery turns it into a level-2 one. The start of the job counts as a level-2 save.

Under Poisson failures (rates ``l1``, ``l2``, ``L = l1 + l2``) the job splits at its level-2
saves into *intervals* whose expected durations add up (a process forgets its past at each save
that no failure can undo). An interval splits at its level-1 saves into segments of ``D_j``
seconds (work and the stall that ends it). A failure in segment ``j`` sends the job back to the
segment's start with probability ``1 - p2`` and to the interval's start (after a level-2
recovery) with probability ``p2`` (a machine failure, or a process failure whose recovery a
machine failure interrupts); ``rbar`` is the expected recovery per failure. The expected
(weighted) time ``Y_j`` from the interval's start to the end of segment ``j`` then obeys::

    Y_j = g_j Y_{j-1} + b_j,    g_j = 1 + p2 (exp(L D_j) - 1),
                                b_j = exp(L D_j) G_j + (exp(L D_j) - 1) rbar,

``G_j = integral_0^{D_j} exp(-L x) w(x) dx`` (``w`` the weight of the work at ``x``, 1 in a
stall): ``b_j`` is the one-level segment's expectation (:mod:`cocijax.policies._horizon`) under
the total rate, and ``g_j - 1`` the expected number of times a failure in segment ``j`` sends
the job back to the interval's start. The overhead is the sum over intervals of their last
``Y`` minus the failure-free (weighted) work.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from cocijax.sim._model import _check_job, _weights


class Schedule(NamedTuple):
    """A two-level save schedule: the steps saved after, and the level of each save.

    The scorers of :mod:`cocijax.sim` take any sequences (the steps in any order; a step given
    twice counts at its highest level); :func:`cocijax.sim.optimal_schedule` and
    :func:`cocijax.plan` return int64 arrays, the steps increasing.

    Attributes:
      steps: 1-based steps after which the job saves.
      levels: the level of each save, 1 (survives a process failure) or 2 (also survives a
        machine failure), one per step.

    Example:
      >>> import numpy as np
      >>> s = Schedule(np.array([10, 20, 30]), np.array([1, 1, 2]))
      >>> s.steps[s.levels == 2].tolist()
      [30]
    """

    steps: np.ndarray
    levels: np.ndarray


class TwoLevel(NamedTuple):
    """The checked two-level costs (seconds) and failure rates (per second, 0: none)."""

    c1: float
    c2: float
    r1: float
    r2: float
    lam1: float
    lam2: float

    @property
    def lam(self) -> float:
        return self.lam1 + self.lam2

    def rollback(self) -> tuple[float, float]:
        """``(p2, rbar)``: the chance a failure sends the job back to the interval's start,
        and the expected recovery seconds per failure (restarts included)."""
        lam = self.lam
        if lam == 0.0:
            return 0.0, 0.0
        # A level-1 recovery ends when it completes or when a machine failure interrupts it;
        # a process failure restarts it.
        fail = -math.expm1(-lam * self.r1)
        ends = (1.0 - fail) + fail * self.lam2 / lam
        phase1 = fail / lam / ends  # expected seconds of the level-1 recovery phase
        to_machine = fail * (self.lam2 / lam) / ends
        p2 = self.lam2 / lam + self.lam1 / lam * to_machine
        rec2 = em1(lam, self.r2)
        return p2, self.lam1 / lam * phase1 + p2 * rec2


def em1(lam, x):
    """``(exp(lam x) - 1) / lam`` (``x`` when ``lam`` is 0); inf where it overflows."""
    if lam == 0.0:
        return np.asarray(x, np.float64) * 1.0
    with np.errstate(over="ignore"):
        return np.expm1(lam * np.asarray(x, np.float64)) / lam


def two_level_job(save_steps, n_steps, step_time_s, **kwargs) -> TwoLevel | None:
    """The checked job of a scorer's arguments: its two levels, or None for a one-level job.

    Every argument is checked (``kwargs`` are the scorers' cost, MTBF and recovery keywords);
    a two-level job's MTBFs may be ``inf`` (a class that never fails).

    Raises:
      ValueError: naming a missing or bad argument, or a :class:`Schedule` given to a
        one-level job.
    """
    job = None
    if any(
        kwargs[k] is not None for k in ("persist_cost_s", "machine_mtbf_s", "machine_recovery_s")
    ):
        job = check_two_level(**kwargs)
    elif isinstance(save_steps, Schedule):
        raise ValueError(
            "save_steps is a two-level Schedule but the job is one-level: give "
            "machine_mtbf_s, persist_cost_s and machine_recovery_s, or plain steps."
        )
    mtbf_s = kwargs["mtbf_s"] if job is None else 1.0  # a two-level job's: checked above
    _check_job(n_steps, step_time_s, kwargs["checkpoint_cost_s"], kwargs["recovery_s"], mtbf_s)
    return job


def check_two_level(
    *, mtbf_s, machine_mtbf_s, checkpoint_cost_s, persist_cost_s, recovery_s, machine_recovery_s
) -> TwoLevel:
    """The checked two-level arguments.

    Raises:
      ValueError: naming an argument that is missing or out of range.
    """
    for name, val in (("mtbf_s", mtbf_s), ("machine_mtbf_s", machine_mtbf_s)):
        if val is None or not (val > 0):  # inf: failures of that class never happen
            raise ValueError(f"{name} must be a positive number or inf, got {val}.")
    for name, val in (
        ("checkpoint_cost_s", checkpoint_cost_s),
        ("persist_cost_s", persist_cost_s),
        ("recovery_s", recovery_s),
        ("machine_recovery_s", machine_recovery_s),
    ):
        if val is None or not (np.isfinite(val) and val >= 0):
            raise ValueError(
                f"{name} must be a non-negative number, got {val} (a two-level job, "
                "machine_mtbf_s given, needs persist_cost_s and machine_recovery_s too)."
            )
    return TwoLevel(
        float(checkpoint_cost_s), float(persist_cost_s), float(recovery_s),
        float(machine_recovery_s), 1.0 / float(mtbf_s), 1.0 / float(machine_mtbf_s),
    )  # fmt: skip


def two_level_steps(save_steps, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, levels)`` of a :class:`Schedule` or a plain list of steps (all level 2).

    Steps outside ``[1, n_steps]`` are dropped; a step given twice keeps its highest level.

    Raises:
      ValueError: if a level is not 1 or 2, or ``levels`` does not match ``steps``.
    """
    if isinstance(save_steps, Schedule):
        steps = np.asarray(save_steps.steps, np.int64).ravel()
        levels = np.asarray(save_steps.levels, np.int64).ravel()
        if levels.shape != steps.shape:
            raise ValueError(
                f"Schedule.levels must have one level per step: {levels.size} levels for "
                f"{steps.size} steps."
            )
        if not np.all((levels == 1) | (levels == 2)):
            raise ValueError(f"Schedule.levels must be 1 or 2, got {sorted(set(levels.tolist()))}.")
    else:
        steps = np.asarray(save_steps, np.int64).ravel()
        levels = np.full(steps.shape, 2, np.int64)
    keep = (steps >= 1) & (steps <= n_steps)
    steps, levels = steps[keep], levels[keep]
    order = np.lexsort((-levels, steps))  # by step, the highest level first
    steps, levels = steps[order], levels[order]
    first = np.concatenate([[True], np.diff(steps) > 0]) if steps.size else np.zeros(0, bool)
    return steps[first], levels[first]


def level_segments(steps, levels, n_steps: int, job: TwoLevel):
    """``(start, end, stall, closes)`` arrays of the segments: ``closes`` where a level-2
    save (or the end of the job) ends the segment's interval."""
    ends, stall = list(steps), [job.c2 if v == 2 else job.c1 for v in levels]
    closes = [v == 2 for v in levels]
    if not ends or ends[-1] != n_steps:
        ends.append(n_steps)
        stall.append(0.0)
        closes.append(True)
    closes[-1] = True
    ends = np.asarray(ends, np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    return starts, ends, np.asarray(stall), np.asarray(closes)


def expected_two_level(
    save_steps, *, n_steps: int, step_time_s: float, job: TwoLevel, weights=None
) -> tuple[float, float]:
    """``(wall, weighted)`` expected overhead of a two-level schedule (module docstring)."""
    n_steps = int(n_steps)
    w = _weights(weights, n_steps)
    steps, levels = two_level_steps(save_steps, n_steps)
    lam = job.lam
    p2, rbar = job.rollback()
    q = em1(-lam, step_time_s) if lam > 0 else step_time_s  # int_0^tau e^{-lam x} dx
    totals = np.zeros(2)
    y = np.zeros(2)  # Y of the interval so far, wall and weighted
    for s0, s1, c, closes in zip(*level_segments(steps, levels, n_steps, job), strict=True):
        decay = np.exp(-lam * step_time_s * np.arange(s1 - s0))
        d = (s1 - s0) * step_time_s + c
        with np.errstate(over="ignore", invalid="ignore"):
            more = np.expm1(lam * d)  # exp(lam D) - 1
            stall = em1(lam, c)  # exp(lam D) * int_W^D e^{-lam x} dx
            for i, seg_w in enumerate((np.ones(s1 - s0), w[s0:s1])):
                work = q * float((seg_w * decay).sum())  # int_0^W e^{-lam x} w(x) dx
                b = (more + 1.0) * work + stall + more * rbar
                # g_j - 1 = p2 (exp(lam D) - 1); nan (0 * inf) only where b is inf anyway.
                y[i] = y[i] + b + (p2 * more * y[i] if p2 > 0 else 0.0)
        if closes:
            totals += y
            y[:] = 0.0
    totals = np.where(np.isfinite(totals), totals, np.inf)
    return float(totals[0] - n_steps * step_time_s), float(totals[1] - w.sum() * step_time_s)
