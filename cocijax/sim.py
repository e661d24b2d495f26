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

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "Expected",
    "SimResult",
    "expected_overhead",
    "expected_overhead_periodic",
    "optimal_schedule",
    "progress_weights",
    "replay",
    "simulate",
]

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
    max_overhead_factor: float = MAX_OVERHEAD_FACTOR,
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
      max_overhead_factor: abandon a trial once it has lost this many times the failure-free
        job time (see ``SimResult.finished``).

    Returns:
      A :class:`SimResult` of means over trials.

    Raises:
      ValueError: naming the offending argument if it is out of range.

    Example:
      >>> r = simulate([50, 100], n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0,
      ...              recovery_s=5.0, mtbf_s=1e9, trials=10)
      >>> r.wall_overhead_s, r.finished
      (2.0, 1.0)
    """
    _check_job(n_steps, step_time_s, checkpoint_cost_s, recovery_s, mtbf_s)
    for name, val in (
        ("weibull_shape", weibull_shape),
        ("trials", trials),
        ("max_overhead_factor", max_overhead_factor),
    ):
        if not (np.isfinite(val) and val > 0):
            raise ValueError(f"{name} must be a positive number, got {val}.")
    n_steps, trials = int(n_steps), int(trials)
    steps = _save_steps(save_steps, n_steps)
    w = _weights(weights, n_steps)
    rng = np.random.default_rng(seed)
    scale = mtbf_s / math.gamma(1.0 + 1.0 / weibull_shape)

    def draw(k: int) -> np.ndarray:
        return scale * rng.weibull(weibull_shape, size=k)

    t = _Trials(trials, draw(trials), max_overhead_factor * n_steps * step_time_s)
    _walk(t, steps, n_steps, step_time_s, checkpoint_cost_s, recovery_s, w, draw)
    return t.result(steps.size)


def replay(
    save_steps,
    failure_times_s,
    *,
    n_steps: int,
    step_time_s: float,
    checkpoint_cost_s: float,
    recovery_s: float,
    weights=None,
    commit_s: float = 0.0,
) -> SimResult:
    """The overhead of one job whose failures came at given times: a recorded run, replayed.

    The cost model of :func:`simulate`, with one trial whose failures are not drawn but given,
    e.g. the failures a real run suffered, to predict what that run should have lost. Unlike
    there, a save may commit after its stall ends: an asynchronous save writes on while
    training goes on, and a failure before it has committed rolls the job back to the newest
    save that had (``commit_s``). Step, stall and recovery times that vary within the run are
    not modelled.

    Args:
      save_steps: 1-based steps after which the job saves (as in :func:`simulate`).
      failure_times_s: wall-clock seconds from the start of the job's first step to each
        failure, non-decreasing. Failures after the job has ended are left out.
      n_steps: number of training steps in the job.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: seconds to recover after each failure (a failure during a recovery
        restarts it).
      weights: per-step value weights (length ``n_steps``); ``None`` means all 1.
      commit_s: seconds from the end of a save's stall until it has committed (0: safe once
        its stall ends, as :func:`simulate` assumes).

    Returns:
      A :class:`SimResult` of the one job (standard errors 0, ``finished`` 1, ``failures``
      the number that struck before the end).

    Raises:
      ValueError: naming the offending argument if it is out of range, or
        ``failure_times_s`` if it is not a non-decreasing list of finite, non-negative times.

    Example:
      >>> job = dict(n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0, recovery_s=5.0)
      >>> r = replay([50, 100], [70.0], **job)
      >>> r.failures, r.recompute_s, r.recovery_s, r.stall_s  # 19 s after the save at step 50
      (1.0, 19.0, 5.0, 2.0)
      >>> replay([50, 100], [52.0], commit_s=3.0, **job).recompute_s  # step 50 not committed
      51.0
    """
    _check_job(n_steps, step_time_s, checkpoint_cost_s, recovery_s, mtbf_s=1.0)  # none needed
    if not (np.isfinite(commit_s) and commit_s >= 0):
        raise ValueError(f"commit_s must be a non-negative number, got {commit_s}.")
    times = np.asarray(failure_times_s, dtype=np.float64)
    if (
        times.ndim != 1
        or not np.all(np.isfinite(times) & (times >= 0))
        or np.any(np.diff(times) < 0)
    ):
        raise ValueError(
            "failure_times_s must be a 1-D sequence of finite, non-negative, non-decreasing "
            f"seconds, got {failure_times_s!r}."
        )
    n_steps = int(n_steps)
    steps = _save_steps(save_steps, n_steps)
    cw = _cumulative_work(_weights(weights, n_steps), step_time_s)
    failures = iter(times.tolist())
    t = _Trials(1, np.zeros(1), math.inf)
    now, fail_at = 0.0, next(failures, math.inf)
    pos = safe = 0  # the step the job runs on from; the newest committed save
    pending: list[tuple[float, int]] = []  # (commit time, step) of saves not known committed
    while pos < n_steps:
        i = int(np.searchsorted(steps, pos, side="right"))
        end = int(steps[i]) if i < steps.size else n_steps
        c = checkpoint_cost_s if i < steps.size else 0.0
        work = (end - pos) * step_time_s
        if now + work + c <= fail_at:
            now += work + c
            t.stall[0] += c
            if i < steps.size:
                pending.append((now + commit_s, end))
            pos = end
            continue
        # A failure: the job rolls back to the newest save committed by then.
        done = min(fail_at - now, work)
        t.stall[0] += fail_at - now - done
        safe = max([safe] + [s for when, s in pending if when <= fail_at])
        reached = pos + done / step_time_s
        t.lost[0] += reached * step_time_s - safe * step_time_s
        t.lost_w[0] += np.interp(reached, np.arange(n_steps + 1), cw) - cw[safe]
        t.fails[0] += 1
        now, fail_at = fail_at, next(failures, math.inf)
        while fail_at - now < recovery_s:  # a failure during the recovery restarts it
            t.recov[0] += fail_at - now
            t.fails[0] += 1
            now, fail_at = fail_at, next(failures, math.inf)
        t.recov[0] += recovery_s
        now += recovery_s
        pos, pending = safe, []
    return t.result(steps.size)


def _cumulative_work(w: np.ndarray, step_time_s: float) -> np.ndarray:
    """Weighted work seconds at each step boundary (lost work is a difference of it)."""
    return np.concatenate([[0.0], np.cumsum(w)]) * step_time_s


def _walk(t, steps, n_steps, step_time_s, checkpoint_cost_s, recovery_s, w, draw) -> None:
    """Runs the trials ``t`` through the schedule; ``draw(k)`` gives the next ``k`` gaps."""
    cw = _cumulative_work(w, step_time_s)  # lost work: interpolated inside a step
    for s0, s1, c in _segments(steps, n_steps, checkpoint_cost_s):
        work = (s1 - s0) * step_time_s
        dur = work + c
        active = np.flatnonzero(t.alive)
        while active.size:
            ok = t.t_next[active] >= dur
            done = active[ok]
            t.t_next[done] -= dur
            t.stall[done] += c
            hit = active[~ok]
            if hit.size == 0:
                break
            x = t.t_next[hit]
            lw = np.minimum(x, work)
            t.lost[hit] += lw
            pos = s0 + lw / step_time_s
            t.lost_w[hit] += np.interp(pos, np.arange(n_steps + 1), cw) - cw[s0]
            t.stall[hit] += x - lw
            t.fails[hit] += 1
            t.recover(hit, recovery_s, draw)
            active = hit[t.alive[hit]]


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
) -> Expected:
    """The exact expected overhead of a save schedule under Poisson failures.

    The cost model of :func:`simulate` with ``weibull_shape=1``, without sampling: each
    segment's expectation is summed in closed form (``inf`` where the schedule cannot
    practically finish). Runs in ``O(n_steps)``.

    Args:
      save_steps: 1-based steps after which the job saves.
      n_steps: number of training steps.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: recovery seconds per failure.
      mtbf_s: mean time between failures.
      weights: per-step value weights; ``None`` means all 1.

    Returns:
      :class:`Expected` (wall and weighted seconds).

    Example:
      >>> e = expected_overhead([50, 100], n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0,
      ...                       recovery_s=5.0, mtbf_s=1e9)
      >>> round(e.wall_s, 3), round(e.weighted_s, 3)
      (2.0, 2.0)
    """
    _check_job(n_steps, step_time_s, checkpoint_cost_s, recovery_s, mtbf_s)
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
) -> np.ndarray:
    """The save schedule with the least expected weighted overhead under Poisson failures.

    Dynamic programming over checkpoint positions: ``cost[j]`` is the least expected cost of
    the steps up to a save after step ``j``, the minimum over the previous save ``i`` of
    ``cost[i]`` plus the segment's exact expected cost (as in :func:`expected_overhead`);
    the job ends without a save. Each segment's cost is ``O(1)`` from prefix sums, so the run
    is ``O(n L)`` for segments of at most ``L`` steps; ``L`` starts at a few optimal intervals
    and doubles until no chosen segment reaches it, so the cap never binds.

    Args:
      weights: per-step value weights (e.g. :func:`progress_weights`), length ``n_steps``.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: recovery seconds per failure.
      mtbf_s: mean time between failures.

    Returns:
      int64 array of the 1-based steps to save after, increasing.

    Raises:
      ValueError: naming an argument that is out of range.

    Example:
      >>> import numpy as np
      >>> s = optimal_schedule(np.ones(1000), step_time_s=1.0, checkpoint_cost_s=10.0,
      ...                      recovery_s=0.0, mtbf_s=3600.0)
      >>> 240 <= int(np.median(np.diff(s))) <= 270  # ~ Young's sqrt(2 C M) = 268
      True

    References:
      Toueg and Babaoglu, `On the optimum checkpoint selection problem
      <https://doi.org/10.1137/0213041>`_, SIAM J. Comput. 1984.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"weights must be a non-empty 1-D array, got shape {w.shape}.")
    n = w.size
    _check_job(n, step_time_s, checkpoint_cost_s, recovery_s, mtbf_s)
    w = _weights(w, n)
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
