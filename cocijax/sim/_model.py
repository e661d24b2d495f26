"""The cost model every scorer shares: its result, per-step weights and argument checks."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# A trial that has lost this many times the job's failure-free time is abandoned (see above).
MAX_OVERHEAD_FACTOR = 100.0


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
      finished: fraction of trials that finished the job before losing
        ``max_overhead_factor`` times its failure-free time. Below 1 the schedule cannot
        practically finish the job at this failure rate, and the means (which count each
        abandoned trial with what it had lost by then) are lower bounds.
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
    finished: float = 1.0


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


def _cumulative_work(w: np.ndarray, step_time_s: float) -> np.ndarray:
    """Weighted work seconds at each step boundary (lost work is a difference of it)."""
    return np.concatenate([[0.0], np.cumsum(w)]) * step_time_s


def _check_job(n_steps, step_time_s, checkpoint_cost_s, recovery_s, mtbf_s) -> None:
    for name, val in (("n_steps", n_steps), ("step_time_s", step_time_s), ("mtbf_s", mtbf_s)):
        if not (np.isfinite(val) and val > 0):
            raise ValueError(f"{name} must be a positive number, got {val}.")
    for name, val in (("checkpoint_cost_s", checkpoint_cost_s), ("recovery_s", recovery_s)):
        if not (np.isfinite(val) and val >= 0):
            raise ValueError(f"{name} must be a non-negative number, got {val}.")


def _save_steps(save_steps, n_steps: int) -> np.ndarray:
    steps = np.unique(np.asarray(save_steps, dtype=np.int64).ravel())
    return steps[(steps >= 1) & (steps <= n_steps)]


def _weights(weights, n_steps: int) -> np.ndarray:
    if weights is None:
        return np.ones(n_steps)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n_steps,):
        raise ValueError(f"weights must have shape ({n_steps},), got {w.shape}.")
    if not np.all(np.isfinite(w) & (w >= 0)):
        raise ValueError("weights must be finite and non-negative.")
    return w


def _segments(steps: np.ndarray, n_steps: int, cost: float):
    """``(start, end, stall)`` of each segment: the steps after a save up to the next one."""
    ends = np.concatenate([steps, [n_steps]]) if steps.size == 0 or steps[-1] != n_steps else steps
    starts = np.concatenate([[0], ends[:-1]])
    return zip(starts, ends, np.where(np.isin(ends, steps), cost, 0.0), strict=True)


class _Trials:
    """Per-trial accumulators of :func:`simulate`, and the abandonment rule."""

    def __init__(self, trials: int, t_next: np.ndarray, cap_s: float):
        self.t_next = t_next  # time until the next failure
        self.stall, self.lost, self.lost_w, self.recov, self.fails = np.zeros((5, trials))
        self.alive = np.ones(trials, bool)  # not abandoned
        self.cap_s = cap_s

    def recover(self, hit: np.ndarray, recovery_s: float, draw) -> None:
        """Recovers the trials ``hit`` (a recovery restarts on any failure inside it)."""
        nxt = draw(hit.size)
        pending = np.arange(hit.size)
        while pending.size:
            short = nxt[pending] < recovery_s
            sp = pending[short]
            if sp.size == 0:
                break
            self.recov[hit[sp]] += nxt[sp]
            self.fails[hit[sp]] += 1
            nxt[sp] = draw(sp.size)
            # A recovery longer than the MTBF may never complete: stop at the cap.
            sp = sp[self.stall[hit[sp]] + self.lost[hit[sp]] + self.recov[hit[sp]] < self.cap_s]
            pending = sp
        self.recov[hit] += recovery_s
        self.t_next[hit] = nxt - recovery_s
        over = self.stall[hit] + self.lost[hit] + self.recov[hit] >= self.cap_s
        self.alive[hit[over]] = False

    def result(self, n_saves: int) -> SimResult:
        """The means over trials."""
        wall = self.stall + self.lost + self.recov
        weighted = self.stall + self.lost_w + self.recov
        n = wall.size
        se = lambda a: float(a.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        return SimResult(
            wall_overhead_s=float(wall.mean()),
            weighted_overhead_s=float(weighted.mean()),
            wall_overhead_se=se(wall),
            weighted_overhead_se=se(weighted),
            failures=float(self.fails.mean()),
            stall_s=float(self.stall.mean()),
            recompute_s=float(self.lost.mean()),
            recovery_s=float(self.recov.mean()),
            n_saves=int(n_saves),
            finished=float(self.alive.mean()),
        )
