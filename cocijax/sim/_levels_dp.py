"""The exact two-level optimum: dynamic programming over level-2 intervals, and inside each over
level-1 segments, in the cost model of :mod:`cocijax.sim._levels`."""

from __future__ import annotations

import math

import numpy as np

from cocijax.sim._levels import Schedule, TwoLevel

# Segments longer than this many expected failures are hopeless, and would overflow exp().
_MAX_FAILURES = 600.0


class _Segments:
    """``(b, g)`` of the segments ending at a step, for every length up to ``cap1``.

    ``Y_j = g Y_{j-1} + b`` (:mod:`cocijax.sim._levels`), each in ``O(cap1)`` from a backward
    cumulative sum, as in the one-level DP.
    """

    def __init__(self, w, tau: float, job: TwoLevel, cap1: int):
        self.w, self.tau, self.lam, self.cap1 = w, tau, job.lam, cap1
        self.p2, self.rbar = job.rollback()
        lam = self.lam
        self.q = tau if lam == 0 else -math.expm1(-lam * tau) / lam  # int_0^tau e^{-lam x} dx
        self.grow = np.exp(lam * tau * np.arange(cap1))  # e^{lam u tau}, u steps back from e

    def at(self, e: int, c: float) -> tuple[np.ndarray, np.ndarray]:
        """Arrays over lengths ``1 .. min(cap1, e)`` of the segments ending at step ``e``
        with a stall of ``c`` seconds."""
        lam, m = self.lam, min(self.cap1, e)
        back = np.cumsum(self.w[e - 1 :: -1][:m] * self.grow[:m])
        d = np.arange(1, m + 1) * self.tau + c
        with np.errstate(over="ignore", invalid="ignore"):
            if lam == 0:
                b = self.tau * back + c
                return b, np.ones(m)
            more = np.expm1(lam * d)  # exp(lam D) - 1
            # exp(lam D) times the discounted work and stall: the one-level segment cost.
            b = self.q * math.exp(lam * (self.tau + c)) * back + math.expm1(lam * c) / lam
            b = b + more * self.rbar
            g = 1.0 + self.p2 * more
        bad = ~(np.isfinite(b) & np.isfinite(g))
        return np.where(bad, np.inf, b), np.where(bad, np.inf, g)


def optimal_two_level(w: np.ndarray, *, step_time_s: float, job: TwoLevel) -> Schedule:
    """The two-level schedule of least expected weighted overhead (see
    :func:`cocijax.sim.optimal_schedule`)."""
    n, tau = w.size, step_time_s
    # Segments over _MAX_FAILURES expected failures, or intervals over as many machine
    # failures, are hopeless (and a segment's would overflow exp()).
    hard1, hard2 = (
        n if rate == 0 else max(1, min(n, int(_MAX_FAILURES / (rate * tau))))
        for rate in (job.lam, job.lam2)
    )
    hard2 = max(hard1, hard2)
    stretch = math.sqrt(1.0 / max(float(w.min()), max(float(w.mean()), 1e-12) * 1e-2))

    def first_cap(cost: float, rate: float, hard: int) -> int:
        if rate == 0:
            return hard
        young = math.sqrt(2.0 * max(cost, 1e-9) / rate) / tau
        return min(hard, max(16, math.ceil(1.5 * young * stretch)))

    cap2 = first_cap(job.c2, job.lam2, hard2)
    cap1 = min(cap2, first_cap(job.c1, job.lam1, hard1))
    while True:
        schedule, long1, long2 = _solve(w, tau, job, cap1, cap2)
        short1 = long1 < cap1 or cap1 >= min(hard1, cap2)
        short2 = long2 < cap2 or cap2 >= hard2
        if short1 and short2:
            return schedule
        cap2 = cap2 if short2 else min(hard2, 2 * cap2)
        cap1 = min(cap2, hard1, cap1 if short1 else 2 * cap1)


def _solve(w, tau, job: TwoLevel, cap1: int, cap2: int):
    """The DP with segments of at most ``cap1`` steps and intervals of at most ``cap2``.

    ``y[p, e]``, the least ``Y`` from a level-2 save at ``p`` to a level-1 save at ``e``, lives
    in a ring of ``cap1 + 1`` rows (``e``) by ``K = cap1 + cap2 + 1`` columns (``p``), each row
    stored twice over so that the ``p`` of the last ``cap2`` steps are one slice: a step reads
    the rows of the last ``cap1`` steps for every ``p`` at once. Row ``e`` holds finite values
    only for ``p`` in ``[e - cap2, e]``; with ``K`` columns a ``p`` after ``e`` (an interval
    starting after the segment) reads inf, with no mask.

    Returns:
      ``(schedule, longest segment, longest interval)``.
    """
    n = w.size
    segs = _Segments(w, tau, job, cap1)
    rows, cols = cap1 + 1, cap1 + cap2 + 1
    ring = np.full((rows, 2 * cols), np.inf)
    ring[0, [0, cols]] = 0.0
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    prev = np.zeros(n + 1, np.int64)
    final = (np.inf, 0)
    for e in range(1, n + 1):
        ell = np.arange(1, min(cap1, e) + 1)
        first = max(0, e - cap2)  # the earliest p, the interval's level-2 save
        starts = np.arange(first, e)
        y = ring[(e - ell) % rows, first % cols : first % cols + starts.size]  # y[e - ell, p]
        row = np.full(cols, np.inf)
        row[starts % cols] = _extend(y, *segs.at(e, job.c1))
        row[e % cols] = 0.0  # a level-2 save at e starts an interval
        ring[e % rows] = np.concatenate([row, row])
        # The job ends at n, with no save.
        total = best[first:e] + _extend(y, *segs.at(e, job.c2 if e < n else 0.0))
        k = int(np.argmin(total))
        best[e], prev[e] = total[k], starts[k]
        if e == n:
            final = (total[k], int(starts[k]))
    ends, at = [n], final[1]
    while at > 0:
        ends.append(at)
        at = int(prev[at])
    ends = ends[::-1]
    steps, levels, long1 = [], [], 0
    for p, e in zip([0, *ends[:-1]], ends, strict=True):
        inner = _inner(segs, p, e, job.c1, job.c2 if e < n else 0.0)
        long1 = max(long1, int(np.diff([p, *inner, e]).max()))
        steps += [*inner, e]
        levels += [1] * len(inner) + [2]
    if steps[-1] == n:  # the job ends there: no save
        steps, levels = steps[:-1], levels[:-1]
    long2 = int(np.diff([0, *ends]).max())
    return Schedule(np.asarray(steps, np.int64), np.asarray(levels, np.int64)), long1, long2


def _extend(y: np.ndarray, b: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``min over rows i of g[i] y[i, p] + b[i]``, for every column ``p`` (in place: a step's
    arrays are large, and temporaries doubled the DP's time)."""
    out = np.multiply(y, g[:, None])
    out += b[:, None]
    return out.min(axis=0)


def _inner(segs: _Segments, p: int, end: int, c1: float, c_end: float) -> list[int]:
    """The level-1 saves of the best interval from a level-2 save at ``p`` to ``end`` (where a
    save of ``c_end`` seconds, or the end of the job, closes it): the inner DP for one ``p``."""
    y = np.full(end - p + 1, np.inf)  # y[i]: the least Y to a level-1 save at p + i
    y[0] = 0.0
    prev = np.zeros(end - p + 1, np.int64)
    for i in range(1, end - p + 1):
        b, g = segs.at(p + i, c_end if i == end - p else c1)
        ell = np.arange(1, b.size + 1)[:i]
        total = y[i - ell] * g[: ell.size] + b[: ell.size]
        k = int(np.argmin(total))
        y[i], prev[i] = total[k], i - ell[k]
    saves, at = [], int(prev[end - p])
    while at > 0:
        saves.append(p + at)
        at = int(prev[at])
    return saves[::-1]
