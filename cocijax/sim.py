"""Fault-injection simulator that scores a save schedule.

A job of ``n_steps`` steps of ``step_time_s`` seconds saves after each step in ``save_steps``;
every save stalls training for ``checkpoint_cost_s`` seconds and is complete at the end of the
stall. Failures come from a renewal process (Weibull inter-arrival times with shape
``weibull_shape`` and mean ``mtbf_s``; shape 1 is a Poisson process). After a failure the job
spends ``recovery_s`` seconds recovering (a failure during recovery restarts it), then rolls back
to the newest completed checkpoint and recomputes. Failures can hit during work, a stall,
recovery or recomputation alike.

Overhead is reported in two currencies:

* wall seconds: stall + recomputation + recovery, i.e. the wall time beyond ``n_steps *
  step_time_s``;
* weighted seconds: stall + recovery + recomputed seconds, each weighted by ``w`` of the step it
  recomputes (see :func:`progress_weights`). With ``weights=None`` every ``w`` is 1 and both
  currencies agree.

The simulation is vectorised over trials with numpy: it walks the schedule segment by segment
(a segment is the work between two saves plus the stall that ends it) and only loops in Python
over segments and over the failures of one segment.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "SimResult",
    "expected_overhead_periodic",
    "progress_weights",
    "simulate",
]


class SimResult(NamedTuple):
    """Overheads of one schedule, averaged over trials.

    Attributes:
      wall_overhead_s: mean wall seconds lost (stall + recomputation + recovery).
      weighted_overhead_s: mean weighted seconds lost (stall + recovery + weighted recomputation).
      wall_overhead_se: standard error of ``wall_overhead_s``.
      weighted_overhead_se: standard error of ``weighted_overhead_s``.
      failures: mean number of failures per job.
      stall_s: mean stall seconds (part of both overheads).
      recompute_s: mean recomputed (lost) work seconds, unweighted.
      recovery_s: mean recovery seconds.
      n_saves: number of saves in the schedule (per failure-free pass).
    """

    wall_overhead_s: float
    weighted_overhead_s: float
    wall_overhead_se: float
    weighted_overhead_se: float
    failures: float
    stall_s: float
    recompute_s: float
    recovery_s: float
    n_saves: int


def progress_weights(losses, time_weight: float) -> np.ndarray:
    """Hindsight value weights ``w = time_weight + (1 - time_weight) * v`` of each step.

    ``v`` is the per-step drop of the best-so-far envelope of the loss after a centred moving
    average over ``max(3, n // 200)`` points each side, normalised to mean 1 (all ones if the
    loss never falls). NaN/inf entries are left out of the averages.

    Args:
      losses: 1-D array of per-step losses (entry ``i`` is the loss after step ``i + 1``).
      time_weight: weight of a plain second, in ``[0, 1]``.

    Returns:
      float64 array of the same length; its mean is 1.

    Raises:
      ValueError: if ``time_weight`` is outside ``[0, 1]`` or ``losses`` is not 1-D.

    Example:
      >>> w = progress_weights(np.linspace(3.0, 1.0, 1000), 0.25)
      >>> round(float(w.mean()), 6)
      1.0
    """
    if not 0.0 <= time_weight <= 1.0:
        raise ValueError(f"time_weight must be in [0, 1], got {time_weight}.")
    y = np.asarray(losses, dtype=np.float64)
    if y.ndim != 1:
        raise ValueError(f"losses must be 1-D, got shape {y.shape}.")
    n = y.size
    if n == 0:
        return np.ones(0)
    h = max(3, n // 200)
    ok = np.isfinite(y)
    # Windowed sums via cumulative sums: O(n) for any window.
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, y, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    lo = np.clip(np.arange(n) - h, 0, n)
    hi = np.clip(np.arange(n) + h + 1, 0, n)
    cnt = ccnt[hi] - ccnt[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        smooth = (csum[hi] - csum[lo]) / cnt
    if not np.isfinite(smooth).any():
        return np.ones(n)
    # Windows without a finite point carry the previous value (no progress there).
    first = np.flatnonzero(np.isfinite(smooth))[0]
    smooth[:first] = smooth[first]
    idx = np.where(np.isfinite(smooth), np.arange(n), 0)
    smooth = smooth[np.maximum.accumulate(idx)]
    env = np.minimum.accumulate(smooth)
    drop = np.diff(env, prepend=env[0]) * -1.0
    mean = drop.mean()
    v = drop / mean if mean > 0 else np.ones(n)
    return time_weight + (1.0 - time_weight) * v


def _weibull_scale(mtbf_s: float, shape: float) -> float:
    return mtbf_s / math.gamma(1.0 + 1.0 / shape)


def simulate(
    save_steps,
    *,
    n_steps: int,
    step_time_s: float,
    checkpoint_cost_s: float,
    recovery_s: float,
    mtbf_s: float,
    weibull_shape: float = 1.0,
    weights=None,
    trials: int = 1000,
    seed: int = 0,
) -> SimResult:
    """Monte Carlo overhead of a save schedule under random failures.

    Args:
      save_steps: 1-based steps after which the job saves (any order, duplicates and steps
        outside ``[1, n_steps]`` are dropped).
      n_steps: number of training steps in the job.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: seconds to recover after each failure (restart, reload).
      mtbf_s: mean time between failures.
      weibull_shape: Weibull shape ``k`` of the inter-failure times (1 = Poisson, < 1 = bursty).
      weights: per-step value weights (length ``n_steps``), e.g. from
        :func:`progress_weights`; ``None`` means all 1.
      trials: number of simulated jobs.
      seed: seed of the failure draws. The same seed gives the same failure times for every
        schedule (common random numbers), so differences between schedules have low variance.

    Returns:
      A :class:`SimResult` of means over trials.

    Raises:
      ValueError: naming the offending argument if it is out of range.

    Example:
      >>> r = simulate([50, 100], n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0,
      ...              recovery_s=5.0, mtbf_s=1e9, trials=10)
      >>> r.wall_overhead_s
      2.0
    """
    for name, val in (
        ("n_steps", n_steps),
        ("step_time_s", step_time_s),
        ("mtbf_s", mtbf_s),
        ("weibull_shape", weibull_shape),
        ("trials", trials),
    ):
        if not (np.isfinite(val) and val > 0):
            raise ValueError(f"{name} must be a positive number, got {val}.")
    for name, val in (("checkpoint_cost_s", checkpoint_cost_s), ("recovery_s", recovery_s)):
        if not (np.isfinite(val) and val >= 0):
            raise ValueError(f"{name} must be a non-negative number, got {val}.")
    n_steps, trials = int(n_steps), int(trials)
    steps = np.unique(np.asarray(save_steps, dtype=np.int64).ravel())
    steps = steps[(steps >= 1) & (steps <= n_steps)]
    if weights is None:
        w = np.ones(n_steps)
    else:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (n_steps,):
            raise ValueError(f"weights must have shape ({n_steps},), got {w.shape}.")
    # Cumulative weighted work at step boundaries; lost weighted work is a difference of it,
    # linearly interpolated inside a step.
    cw = np.concatenate([[0.0], np.cumsum(w)]) * step_time_s

    rng = np.random.default_rng(seed)
    scale = _weibull_scale(mtbf_s, weibull_shape)

    def draw(k: int) -> np.ndarray:
        return scale * rng.weibull(weibull_shape, size=k)

    ends = np.concatenate([steps, [n_steps]]) if steps.size == 0 or steps[-1] != n_steps else steps
    starts = np.concatenate([[0], ends[:-1]])
    stalls = np.where(np.isin(ends, steps), checkpoint_cost_s, 0.0)

    t_next = draw(trials)  # time until the next failure, per trial
    stall = np.zeros(trials)
    lost = np.zeros(trials)
    lost_w = np.zeros(trials)
    recov = np.zeros(trials)
    fails = np.zeros(trials)
    for s0, s1, c in zip(starts, ends, stalls, strict=True):
        work = (s1 - s0) * step_time_s
        dur = work + c
        active = np.arange(trials)
        while active.size:
            tn = t_next[active]
            ok = tn >= dur
            done = active[ok]
            t_next[done] -= dur
            stall[done] += c
            hit = active[~ok]
            if hit.size == 0:
                break
            x = t_next[hit]
            lw = np.minimum(x, work)
            lost[hit] += lw
            pos = s0 + lw / step_time_s
            lost_w[hit] += np.interp(pos, np.arange(n_steps + 1), cw) - cw[s0]
            stall[hit] += x - lw
            fails[hit] += 1
            # Recovery, restarted by any failure that lands inside it.
            nxt = draw(hit.size)
            pending = np.arange(hit.size)
            while pending.size:
                short = nxt[pending] < recovery_s
                sp = pending[short]
                if sp.size == 0:
                    break
                recov[hit[sp]] += nxt[sp]
                fails[hit[sp]] += 1
                nxt[sp] = draw(sp.size)
                pending = sp
            recov[hit] += recovery_s
            t_next[hit] = nxt - recovery_s
            active = hit
    wall = stall + lost + recov
    weighted = stall + lost_w + recov
    se = lambda a: float(a.std(ddof=1) / math.sqrt(trials)) if trials > 1 else 0.0
    return SimResult(
        wall_overhead_s=float(wall.mean()),
        weighted_overhead_s=float(weighted.mean()),
        wall_overhead_se=se(wall),
        weighted_overhead_se=se(weighted),
        failures=float(fails.mean()),
        stall_s=float(stall.mean()),
        recompute_s=float(lost.mean()),
        recovery_s=float(recov.mean()),
        n_saves=int(steps.size),
    )


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
