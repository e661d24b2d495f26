"""Exact expectations under Poisson failures, and the exact optimal schedule."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from cocijax.sim._levels import Schedule, expected_two_level, two_level_job
from cocijax.sim._levels_dp import optimal_two_level
from cocijax.sim._model import _save_steps, _segments, _weights


class Expected(NamedTuple):
    """Exact expected overheads of a schedule under Poisson failures (see :func:`simulate`).

    Attributes:
      wall_s: expected wall seconds lost (stall, recomputation, recovery).
      weighted_s: expected weighted seconds lost (recomputation weighted as in ``simulate``).
    """

    wall_s: float
    weighted_s: float


def _segment_cost(work, weighted, integral, c, lam, rec):
    """Expected weighted cost of segments (float64 arrays); inf where it overflows.

    ``integral`` is ``int_0^work exp(-lam x) w(x) dx``; see :mod:`cocijax.policies._horizon`
    for the derivation.
    """
    d = work + c
    with np.errstate(over="ignore", invalid="ignore"):
        grow = np.exp(lam * d)
        value = c - weighted + grow * integral + (math.expm1(lam * c) - lam * c) / lam
        value = value + (grow - 1.0) * rec
    return np.where(np.isfinite(value), value, np.inf)


def expected_overhead(
    save_steps,
    *,
    n_steps: int,
    step_time_s: float,
    checkpoint_cost_s: float,
    recovery_s: float,
    mtbf_s: float,
    weights=None,
    persist_cost_s: float | None = None,
    machine_mtbf_s: float | None = None,
    machine_recovery_s: float | None = None,
) -> Expected:
    """The exact expected overhead of a save schedule under Poisson failures.

    The cost model of :func:`simulate` with ``weibull_shape=1``, without sampling: each
    segment's expectation is summed in closed form (``inf`` where the schedule cannot
    practically finish); for a two-level job, each interval between level-2 saves by the
    recursion of :mod:`cocijax.sim._levels`. Runs in ``O(n_steps)``.

    Args:
      save_steps: 1-based steps after which the job saves; for a two-level job, a
        :class:`Schedule` (plain steps are then all level-2 saves).
      n_steps: number of training steps.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: recovery seconds per failure.
      mtbf_s: mean time between failures.
      weights: per-step value weights; ``None`` means all 1.
      persist_cost_s: two-level jobs: stall seconds of a level-2 save
        (``checkpoint_cost_s`` is then a level-1 save's).
      machine_mtbf_s: giving it makes the job two-level (see :mod:`cocijax.sim`): the mean
        time between machine failures, which only a level-2 save recovers from (``mtbf_s`` is
        then that of process failures); ``math.inf`` for none, as ``mtbf_s`` may then be.
      machine_recovery_s: two-level jobs: seconds to recover from a machine failure (from a
        level-2 save; ``recovery_s`` is then the recovery from a process failure).

    Returns:
      :class:`Expected` (wall and weighted seconds).

    Example:
      >>> e = expected_overhead([50, 100], n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0,
      ...                       recovery_s=5.0, mtbf_s=1e9)
      >>> round(e.wall_s, 3), round(e.weighted_s, 3)
      (2.0, 2.0)

      Two levels: saves of 0.5 s in memory every 25 steps, of 1 s to disk every 50.

      >>> two = Schedule([25, 50, 75, 100], [1, 2, 1, 2])
      >>> e = expected_overhead(two, n_steps=100, step_time_s=1.0, checkpoint_cost_s=0.5,
      ...                       recovery_s=5.0, mtbf_s=1e9, persist_cost_s=1.0,
      ...                       machine_mtbf_s=1e9, machine_recovery_s=60.0)
      >>> round(e.wall_s, 3)
      3.0
    """
    job = two_level_job(
        save_steps, n_steps, step_time_s, mtbf_s=mtbf_s, machine_mtbf_s=machine_mtbf_s,
        checkpoint_cost_s=checkpoint_cost_s, persist_cost_s=persist_cost_s,
        recovery_s=recovery_s, machine_recovery_s=machine_recovery_s,
    )  # fmt: skip
    if job is not None:
        return Expected(
            *expected_two_level(
                save_steps, n_steps=n_steps, step_time_s=step_time_s, job=job, weights=weights
            )
        )
    n_steps = int(n_steps)
    w = _weights(weights, n_steps)
    lam = 1.0 / mtbf_s
    rec = math.expm1(lam * recovery_s) / lam
    q = -math.expm1(-lam * step_time_s) / lam
    totals = np.zeros(2)
    for s0, s1, c in _segments(_save_steps(save_steps, n_steps), n_steps, checkpoint_cost_s):
        decay = np.exp(-lam * step_time_s * np.arange(s1 - s0))
        for i, seg_w in enumerate((np.ones(s1 - s0), w[s0:s1])):
            totals[i] += _segment_cost(
                (s1 - s0) * step_time_s, seg_w.sum() * step_time_s, q * (seg_w * decay).sum(),
                c, lam, rec,
            )  # fmt: skip
    return Expected(float(totals[0]), float(totals[1]))


def optimal_schedule(
    weights,
    *,
    step_time_s: float,
    checkpoint_cost_s: float,
    recovery_s: float,
    mtbf_s: float,
    persist_cost_s: float | None = None,
    machine_mtbf_s: float | None = None,
    machine_recovery_s: float | None = None,
) -> np.ndarray | Schedule:
    """The save schedule with the least expected weighted overhead under Poisson failures.

    Dynamic programming over checkpoint positions: ``cost[j]`` is the least expected cost of
    the steps up to a save after step ``j``, the minimum over the previous save ``i`` of
    ``cost[i]`` plus the segment's exact expected cost (as in :func:`expected_overhead`);
    the job ends without a save. Each segment's cost is ``O(1)`` from prefix sums, so the run
    is ``O(n L)`` for segments of at most ``L`` steps; ``L`` starts at a few optimal intervals
    and doubles until no chosen segment reaches it, so the cap never binds.

    Two levels (``machine_mtbf_s`` given): the same DP over the level-2 saves, whose
    intervals' expected costs add up (a level-2 save is a renewal point of the Poisson model),
    each interval's cost the least over its level-1 saves by an inner DP. The inner DP is exact
    because ``Y_j = g_j Y_{j-1} + b_j`` (:mod:`cocijax.sim._levels`) increases with
    ``Y_{j-1}`` (``g_j >= 1``): the best way to a level-1 save extends the best way to the one
    before it. Both run together, for every interval start at once: ``O(n L1 L2)`` time and
    ``O(L1 L2)`` memory for segments of at most ``L1`` steps and intervals of at most ``L2``,
    both caps doubled until no chosen segment or interval reaches them, as above. A class of
    failures that never happens (an MTBF of ``math.inf``) lifts its cap to ``n_steps``.

    Args:
      weights: per-step value weights (e.g. :func:`progress_weights`), length ``n_steps``.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: recovery seconds per failure.
      mtbf_s: mean time between failures.
      persist_cost_s: two-level jobs: stall seconds of a level-2 save
        (``checkpoint_cost_s`` is then a level-1 save's).
      machine_mtbf_s: giving it makes the job two-level (see :mod:`cocijax.sim`): the mean
        time between machine failures, which only a level-2 save recovers from (``mtbf_s`` is
        then that of process failures); ``math.inf`` for none, as ``mtbf_s`` may then be.
      machine_recovery_s: two-level jobs: seconds to recover from a machine failure (from a
        level-2 save; ``recovery_s`` is then the recovery from a process failure).

    Returns:
      int64 array of the 1-based steps to save after, increasing; for a two-level job, a
      :class:`Schedule` (the steps and the level of each save).

    Raises:
      ValueError: naming an argument that is out of range.

    Example:
      >>> import numpy as np
      >>> s = optimal_schedule(np.ones(1000), step_time_s=1.0, checkpoint_cost_s=10.0,
      ...                      recovery_s=0.0, mtbf_s=3600.0)
      >>> 240 <= int(np.median(np.diff(s))) <= 270  # ~ Young's sqrt(2 C M) = 268
      True
      >>> two = optimal_schedule(np.ones(1200), step_time_s=1.0, checkpoint_cost_s=0.5,
      ...                        recovery_s=15.0, mtbf_s=3600.0, persist_cost_s=30.0,
      ...                        machine_mtbf_s=1800.0, machine_recovery_s=120.0)
      >>> [int(x) for x in two.steps[two.levels == 2]]  # level-1 saves every ~64 steps
      [292, 584, 877]

    References:
      Toueg and Babaoglu, `On the optimum checkpoint selection problem
      <https://doi.org/10.1137/0213041>`_, SIAM J. Comput. 1984.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"weights must be a non-empty 1-D array, got shape {w.shape}.")
    n = w.size
    job = two_level_job(
        None, n, step_time_s, mtbf_s=mtbf_s, machine_mtbf_s=machine_mtbf_s,
        checkpoint_cost_s=checkpoint_cost_s, persist_cost_s=persist_cost_s,
        recovery_s=recovery_s, machine_recovery_s=machine_recovery_s,
    )  # fmt: skip
    w = _weights(w, n)
    if job is not None:
        return optimal_two_level(w, step_time_s=step_time_s, job=job)
    lam = 1.0 / mtbf_s
    # Segments longer than ~600 MTBF are hopeless and would overflow exp() in the sums.
    hard_cap = max(1, min(n, int(600.0 / (lam * step_time_s))))
    young = math.sqrt(2.0 * max(checkpoint_cost_s, 1e-9) * mtbf_s) / step_time_s
    floor = max(np.mean(w), 1e-12) * 1e-2
    cap = min(hard_cap, max(16, math.ceil(8.0 * young * math.sqrt(1.0 / max(w.min(), floor)))))
    while True:
        saves, longest = _dp(w, cap, step_time_s, checkpoint_cost_s, recovery_s, lam)
        if longest < cap or cap >= hard_cap:
            return saves
        cap = min(hard_cap, 2 * cap)


def _dp(w, cap, tau, cost, recovery_s, lam):
    """The DP of :func:`optimal_schedule` with segments of at most ``cap`` steps."""
    n = w.size
    rec = math.expm1(lam * recovery_s) / lam
    q = -math.expm1(-lam * tau) / lam
    cw = np.concatenate([[0.0], np.cumsum(w)]) * tau
    grow = np.exp(lam * tau * np.arange(cap))  # e^{lam u tau}, u = steps back from the end
    shrink = np.exp(-lam * tau * np.arange(cap))
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    prev = np.zeros(n + 1, np.int64)
    final = (np.inf, 0)
    for j in range(1, n + 1):
        ell = np.arange(1, min(cap, j) + 1)  # segment lengths; the segment starts at j - ell
        # int_0^W e^{-lam x} w dx for every start, summed from the segment's end backwards:
        # e^{-lam (ell-1) tau} * sum_u w_{j-u} e^{lam u tau}, all terms positive (no cancellation).
        back = np.cumsum(w[j - 1 :: -1][: ell.size] * grow[: ell.size])
        integral = q * shrink[: ell.size] * back
        work = ell * tau
        weighted = cw[j] - cw[j - ell]
        total = best[j - ell] + _segment_cost(work, weighted, integral, cost, lam, rec)
        k = int(np.argmin(total))
        best[j], prev[j] = total[k], j - ell[k]
        if j == n:
            end = best[j - ell] + _segment_cost(work, weighted, integral, 0.0, lam, rec)
            k = int(np.argmin(end))
            final = (end[k], j - ell[k])
    saves, at = [], final[1]
    while at > 0:
        saves.append(at)
        at = prev[at]
    saves = np.asarray(saves[::-1], np.int64)
    return saves, int(np.diff(np.concatenate([[0], saves, [n]])).max())


def expected_overhead_periodic(
    every: int,
    *,
    n_steps: int,
    step_time_s: float,
    checkpoint_cost_s: float,
    recovery_s: float,
    mtbf_s: float,
) -> float:
    """Exact expected wall overhead of saving every ``every`` steps under Poisson failures.

    A segment of ``D`` seconds (work plus its stall) that restarts after each failure, with a
    recovery of ``R`` seconds that itself restarts on failure, takes
    ``E[T] = (exp(D / M) - 1) * M * exp(R / M)`` seconds on average (``M`` the MTBF); the
    overhead is the sum over segments minus the failure-free work. The schedule is the one
    :func:`simulate` runs for ``save_steps = range(every, n_steps + 1, every)``.

    Args:
      every: save interval in steps.
      n_steps: number of steps in the job.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: recovery seconds per failure.
      mtbf_s: mean time between failures.

    Returns:
      The expected wall overhead in seconds.

    Raises:
      ValueError: if ``every`` or ``n_steps`` is not positive.

    References:
      Bougeret et al., `Checkpointing strategies for parallel jobs
      <https://doi.org/10.1145/2063384.2063428>`_, SC 2011 (the segment expectation).
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}.")
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}.")
    m = float(mtbf_s)
    full, rest = divmod(int(n_steps), int(every))

    def seg(d: float) -> float:
        return math.expm1(d / m) * m * math.exp(recovery_s / m)

    total = full * seg(every * step_time_s + checkpoint_cost_s)
    if rest:
        total += seg(rest * step_time_s)
    return total - n_steps * step_time_s
