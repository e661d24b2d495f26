"""``coci``: convergence-aware checkpointing that plans its saves by dynamic programming.

A lost (recomputed) second of training is worth ``w(t) = time_weight + (1 - time_weight) v(t)``
seconds, ``v`` being the progress rate (loss drop per step) normalised to mean 1 over the job:
early progress is worth more than late progress. The policy keeps an online estimate of ``w``,
adds it up over the work since the last save (the *exposure* a failure would destroy), forecasts
``w`` for the rest of the job, and at each check asks the receding-horizon planner
(:mod:`cocijax.policies._horizon`) whether saving now has a lower expected weighted cost than any
later save. The planner is the exact expected cost under Poisson failures, so it also handles
what a first-order rule does not: the end of the job, recovery time, and high failure rates.

How ``w`` is estimated, from the losses alone:

* the progress rate, with ``total_steps``, is the per-step drop of the best-so-far envelope of an
  exponential moving average of the loss, averaged over a span of ``h = max(3, N / 200)`` steps
  like the hindsight weights of :func:`cocijax.sim.progress_weights` (with Adam-style warm-up
  bias correction), but at least half the trend between two moving averages of the loss; without
  it, that trend alone, which a noisy minibatch loss does not fool (see ``_track``);
* the job's mean rate is the drop so far plus the drop still to come, over ``N`` steps. The drop
  still to come is forecast from the current rate alone, as if it decayed like a power law
  ``k ** -(decay + 1)`` (the rate of ``L(k) = c + a k ** -decay``): ``rate * k * (1 - (k / N) **
  decay) / decay``. Fitting whole curves was tried first and forecast worse on the shared curves
  (a factor of 2 to 6 wrong in the first tenth of a job) than this one-parameter rule;
* the forecast weight of a later step ``s`` decays the same way, ``time_weight + (w - time_weight)
  (k / s) ** (decay + 1)``.

``N`` is ``total_steps`` when given and the job has not run past it. Otherwise the job may end
anywhere between ``horizon_range`` times the steps done so far: the weight used is the geometric
middle of the two ends' weights, kept on Young's side of both (so that no end in the range makes
the step's decision worse than Young's rule), and the plan is open-ended (it never skips a last
save).
The default range, 4 to 40, was measured on ``policy_bench``'s 45 curves (scenarios A and B):
2 to 20 was up to 9.5% worse than the best classic policy (3 cases above 1%), 8 to 80 up to
12.2% (8 cases), 4 to 40 at most 0.7% (median capture 37% against 2 to 20's 31%). It was
chosen seeing every curve, the held-out ones included: on the tuning curves alone 8 to 80 looked
best.
Until ``min_points`` finite losses have been seen (and, without ``total_steps``, until the two
averages lag apart by a step), ``w = 1`` (Young's rule).
``w`` is clamped to ``[time_weight, max_weight]`` so that a bad estimate cannot gamble the
wall-clock overhead away.

Before a recovery has been measured (a job's first run, until its first failure), the one
assumed is ``prior_recovery_s`` but at most a quarter of the MTBF. A failure's expected cost grows
as ``exp(R / MTBF)`` with the recovery ``R`` (restarts that fail again), so a fixed prior far above
the MTBF makes every failure look ruinous, and the plan saves far too often: with the 60 s prior
and an MTBF of 15 to 30 s (the regime of ``benchmarks/chaos_bench.py``: 135 s of training, 0.9 s
saves, a restart in 5 to 20 s), ``coci`` was up to 8% worse than Young's rule while its first
recovery was unknown; capped, it does about as well as with the recovery known. A quarter keeps
the assumed restart term within 30% of linear; a job whose recovery really is longer learns it at
its first failure.

A save protects the training since the last one: with none timed yet (the untimed first step of a
fresh job, whose step time falls back to a 1 s prior), the policy does not save.

Checks: the policy decides only at check steps (``clock.next_check``); between checks ``update``
only feeds its estimates. After each check the next one comes half way to the save the planner
expects, and the plan is redone after each save and every ``replan_fraction`` of an interval.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cocijax.policies import _base, _horizon
from cocijax.policies._base import Policy

DEFAULT_PRIOR_RECOVERY_S = 60.0
# An unmeasured recovery is assumed to be at most this share of the MTBF (module docstring).
PRIOR_RECOVERY_MTBF_SHARE = 0.25
# Re-plan when the step time, save cost, failure rate or recovery cost is off by this much (in
# log terms, ~20%) from the plan's.
REPLAN_DRIFT = 0.2
# Without total_steps the rate is the trend between averages of spans `span` and this many times it.
SLOW_SPAN = 4.0
# With total_steps the rate is at least this share of that trend (see `_track`).
TREND_SHARE = 0.5


class CociState(NamedTuple):
    """State of :func:`coci`."""

    clock: _base.Clock
    count: jnp.ndarray  # shape=(), int32, finite losses seen
    level: jnp.ndarray  # shape=(), float32, moving average of the loss (NaN before any)
    envelope: jnp.ndarray  # shape=(), float32, best-so-far of `level`
    start: jnp.ndarray  # shape=(), float32, mean of the first span + 1 losses
    rate: jnp.ndarray  # shape=(), float32, drop per step: envelope drops' average, or the trend
    exposure: jnp.ndarray  # shape=(), float32, weighted seconds of work since the last save
    weight: jnp.ndarray  # shape=(), float32, the w(t) of the last call (for inspection)
    plan: _horizon.Plan  # the forecast and the values of saving at its edges
    plan_step: jnp.ndarray  # shape=(), int32, step the plan was made at (0 before any)
    last_save: jnp.ndarray  # shape=(), int32, step of the last save (0 before any)
    rollback: jnp.ndarray  # shape=(), float32, cost to go from the last save
    slow: jnp.ndarray  # shape=(), float32, slower moving average of the loss (NaN before any)


def coci(
    mtbf_s: float | None = None,
    recovery_s: float | None = None,
    time_weight: float = 0.25,
    total_steps: int | None = None,
    *,
    prior_mtbf_s: float | None = None,
    prior_recovery_s: float = DEFAULT_PRIOR_RECOVERY_S,
    max_weight: float = 16.0,
    decay: float = 0.5,
    horizon_range: tuple[float, float] = (4.0, 40.0),
    replan_fraction: float = 0.5,
    min_points: int = 3,
    cost_prior_s: float | None = None,
) -> Policy:
    """Convergence-aware checkpoint policy planned by dynamic programming (see module docstring).

    Args:
      mtbf_s: mean time between failures in seconds; ``None`` (default) uses the caller's
        measured MTBF (``update(..., mtbf_s=...)``; the manager learns it from the job),
        ``prior_mtbf_s`` until then.
      recovery_s: seconds to recover from a failure; ``None`` uses the caller's measurement,
        ``prior_recovery_s`` until then.
      time_weight: weight of a plain lost second, in ``[0, 1]``; 1 reduces to a time-based
        (Young/Daly-like, but exact) rule.
      total_steps: planned number of steps, when known; sharpens the forecast and lets the
        last save be skipped when it cannot pay off. The managers also save step
        ``total_steps`` itself, so that a finished job keeps its final state. A job that runs
        past it is planned from then on as one of unknown length (as without
        ``total_steps``), so it stays protected.
      prior_mtbf_s: MTBF assumed before one is measured; default 24 h divided by
        ``jax.device_count()``.
      prior_recovery_s: recovery time assumed before one is measured, capped at a quarter of
        the MTBF.
      max_weight: upper clamp of ``w``.
      decay: exponent of the power law the progress rate is assumed to decay with.
      horizon_range: without ``total_steps``, the job may end anywhere between these multiples
        of the steps done so far (see the module docstring).
      replan_fraction: redo the plan after this fraction of the current save interval.
      min_points: finite losses needed before ``w`` is estimated (Young's rule until then).
      cost_prior_s: checkpoint cost assumed until the first measured one; ``None``: 10 s, or
        the prior a caller gives (the managers give one from the state's size).

    Returns:
      A :class:`~cocijax.policies.Policy`.

    Raises:
      ValueError: naming the parameter when an argument is out of range.

    Example:
      >>> import numpy as np, cocijax as cj
      >>> losses = 3.0 + 5.0 / np.sqrt(np.arange(1, 2001))
      >>> policy = cj.policies.coci(mtbf_s=3600.0, total_steps=2000)
      >>> steps = cj.plan(losses, policy, step_time_s=2.0, checkpoint_cost_s=10.0)
      >>> bool(np.all(np.diff(steps) > 0)) and len(steps) > 10
      True

    References:
      Li, Wang et al., `Convergence-aware optimal checkpointing for exploratory deep learning
      training jobs <https://doi.org/10.1016/j.future.2024.107597>`_, FGCS 2024.
      Toueg and Babaoglu, `On the optimum checkpoint selection problem
      <https://doi.org/10.1137/0213041>`_, SIAM J. Comput. 1984.
    """
    given_mtbf, prior_mtbf = _base.check_mtbf(mtbf_s, prior_mtbf_s)
    given_rec = None if recovery_s is None else _base.check_nonnegative("recovery_s", recovery_s)
    prior_rec = _base.check_nonnegative("prior_recovery_s", prior_recovery_s)
    tw = _base.check_unit("time_weight", time_weight)
    if total_steps is not None:
        if isinstance(total_steps, bool) or int(total_steps) != total_steps or total_steps < 1:
            raise ValueError(
                f"total_steps must be a positive integer or None, got {total_steps!r}."
            )
        total_steps = int(total_steps)
    wmax = _base.check_positive("max_weight", max_weight)
    if wmax < 1.0:
        raise ValueError(f"max_weight must be >= 1, got {max_weight!r}.")
    p = _base.check_positive("decay", decay)
    try:
        h_lo, h_hi = (float(x) for x in horizon_range)
    except (TypeError, ValueError):
        h_lo = h_hi = math.nan
    if not (1.0 < h_lo <= h_hi < math.inf):
        raise ValueError(f"horizon_range must be two numbers 1 < lo <= hi, got {horizon_range!r}.")
    rf = _base.check_positive("replan_fraction", replan_fraction)
    if isinstance(min_points, bool) or int(min_points) != min_points or min_points < 2:
        raise ValueError(f"min_points must be an integer >= 2, got {min_points!r}.")
    min_points = int(min_points)
    cost_prior = _base.check_cost_prior(cost_prior_s)
    cfg = _Settings(
        given_mtbf, prior_mtbf, given_rec, prior_rec, tw, total_steps, wmax, p, h_lo, h_hi, rf,
        min_points, cost_prior,
    )  # fmt: skip
    # The initial state is NumPy, placed at each init: jnp constructors would each compile an
    # XLA program when run eagerly, and each be an operation to trace in jax.eval_shape(init).
    nan, zero, izero = np.float32(np.nan), np.float32(0.0), np.int32(0)
    bins, rec = _horizon.NUM_BINS, _assumed_recovery(cfg, prior_mtbf, xp=np)
    zeros = np.zeros(bins + 1, np.float32)
    costs = _horizon.costs(1.0, cost_prior, rec, prior_mtbf, xp=np)
    empty = _horizon.Plan(zeros, np.ones(bins, np.float32), zeros, costs)
    initial = CociState(
        _base.clock_constants(), izero, nan, nan, nan, zero, zero, np.float32(1.0), empty,
        izero, izero, zero, nan,
    )  # fmt: skip

    def init() -> CociState:
        return jax.device_put(initial)

    return _base.make_policy(
        init,
        functools.partial(_rule, cfg),
        total_steps=total_steps,
        mtbf_s=given_mtbf,
        recovery_s=given_rec,
        cost_prior_s=None if cost_prior_s is None else cost_prior,
    )


class _Settings(NamedTuple):
    """The checked arguments of :func:`coci` (Python numbers: constants of the jitted rule)."""

    given_mtbf: float | None  # mtbf_s
    prior_mtbf: float  # prior_mtbf_s, or its default
    given_rec: float | None  # recovery_s
    prior_rec: float  # prior_recovery_s
    tw: float  # time_weight
    total_steps: int | None
    wmax: float  # max_weight
    decay: float
    h_lo: float  # horizon_range
    h_hi: float
    rf: float  # replan_fraction
    min_points: int
    cost_prior: float  # cost_prior_s, or the default


class _Now(NamedTuple):
    """What :func:`_rule` knows at the current step, for the check (:func:`_check`)."""

    clock: _base.Clock  # ticked by this step
    step: jnp.ndarray  # the step as given (``seen.step``)
    k: jnp.ndarray  # float32, the largest step seen
    tau: jnp.ndarray  # float32, the smoothed step time
    costs: _horizon.Costs  # the cost model of a plan made now
    w: jnp.ndarray  # float32, the weight of the current step
    exposure: jnp.ndarray  # float32, weighted seconds of work since the last save
    interval: jnp.ndarray  # float32, the first-order save interval in steps
    end_known: jnp.ndarray  # bool, the job ends at ``total_steps``
    n_total: jnp.ndarray  # float32, the last step (2**30 when unknown)


def _rule(cfg: _Settings, state: CociState, seen: _base.Seen):
    """One step of :func:`coci`: the estimates fed, and at a check step the decision."""
    clock, is_new, dt = _base.clock_tick(state.clock, seen)
    tau, cost = _base.smoothed(clock, cfg.cost_prior)
    k = clock.last_step.astype(jnp.float32)
    mtbf = _base.resolve(cfg.given_mtbf, seen.mtbf_s, cfg.prior_mtbf)
    rec_s = _base.resolve(
        cfg.given_rec, seen.recovery_s, _assumed_recovery(cfg, mtbf), zero_ok=True
    )
    # The plan is open-ended (edges_for stops at its own horizon) without total_steps, and
    # past it: a job that runs on after all is one of unknown length and stays protected
    # (a plan that ended at total_steps would never save again).
    known_end = cfg.total_steps is not None
    end_known = (k <= cfg.total_steps) if known_end else jnp.zeros((), bool)
    n_total = jnp.where(end_known, jnp.float32(cfg.total_steps or 0), jnp.float32(2.0**30))
    n_open = jnp.maximum(math.sqrt(cfg.h_lo * cfg.h_hi) * k, k + 1.0)
    span = jnp.maximum(3.0, jnp.where(end_known, n_total, n_open) / 200.0)

    track = _track(state, seen.loss, is_new, span, trend=not known_end)
    w = _weight(cfg, track, k, end_known, n_total)
    exposure = state.exposure + w * dt

    costs = _horizon.costs(tau, cost, rec_s, mtbf)
    interval = 1.0 / (jnp.sqrt(costs.lam * w / (2.0 * cost)) * tau)  # steps, first order
    now = _Now(clock, seen.step, k, tau, costs, w, exposure, interval, end_known, n_total)
    stale = _plan_is_stale(cfg, state, now)

    def skip(_):
        return (
            jnp.zeros((), bool), state.plan, state.plan_step, state.rollback, clock.next_check,
        )  # fmt: skip

    save, plan, plan_step, rollback, next_check = jax.lax.cond(
        _base.checking(clock, seen.step), lambda _: _check(cfg, state, now, stale), skip, None
    )
    return save, CociState(
        clock=_base.clock_saved(clock, save, seen.step, next_check),
        count=track.count,
        level=track.level,
        slow=track.slow,
        envelope=track.envelope,
        start=track.start,
        rate=track.rate,
        exposure=jnp.where(save, 0.0, exposure),
        weight=w,
        plan=plan,
        plan_step=plan_step,
        last_save=jnp.where(save, clock.last_step, state.last_save),
        rollback=rollback,
    )


def _assumed_recovery(cfg: _Settings, mtbf, *, xp=jnp):
    """The recovery time assumed before one is measured: the prior, at most a share of the MTBF."""
    return xp.minimum(cfg.prior_rec, PRIOR_RECOVERY_MTBF_SHARE * mtbf)


def _weight_if_ends_at(cfg: _Settings, track: _Track, k, n_end):
    """The weight ``w`` of step ``k`` if the job ends at step ``n_end`` (module docstring).

    The current progress rate over the job's mean rate (the drop so far plus the drop still to
    come, forecast as a power law), clamped to ``[tw, wmax]``; 1 (Young) until it is known.
    """
    p, tw = cfg.decay, cfg.tw
    still = track.rate_hat * k * (1.0 - jnp.power(k / n_end, p)) / p
    mean_drop = ((track.start - track.envelope) + jnp.maximum(still, 0.0)) / n_end
    ready = (track.count >= cfg.min_points) & (mean_drop > 0) & (track.rate_hat >= 0)
    w = tw + (1.0 - tw) * track.rate_hat / jnp.where(ready, mean_drop, 1.0)
    return jnp.where(ready & jnp.isfinite(w), jnp.clip(w, tw, cfg.wmax), 1.0)


def _weight(cfg: _Settings, track: _Track, k, end_known, n_total):
    """The weight ``w`` of step ``k``: at ``n_total`` while the end is known, else between the
    ends of ``horizon_range`` (:func:`_between`)."""
    w_lo = _weight_if_ends_at(cfg, track, k, jnp.maximum(cfg.h_lo * k, k + 1.0))
    w_hi = _weight_if_ends_at(cfg, track, k, jnp.maximum(cfg.h_hi * k, k + 1.0))
    w = jnp.clip(_between(w_lo, w_hi), cfg.tw, cfg.wmax)
    if cfg.total_steps is not None:
        w = jnp.where(end_known, _weight_if_ends_at(cfg, track, k, n_total), w)
    return w


def _plan_is_stale(cfg: _Settings, state: CociState, now: _Now):
    """Whether the plan must be redone: there is none, it ran out, it is ``replan_fraction``
    of an interval old, or the measurements moved ``REPLAN_DRIFT`` away from its cost model."""
    stale = (state.plan_step == 0) | (state.plan.edges[-1] <= now.k)  # none, or run out
    stale = stale | (now.k >= state.plan_step + jnp.maximum(cfg.rf * now.interval, 1.0))
    # A plan decides in its own cost model: redo it when the measurements moved away.
    moved = jnp.stack([a / b for a, b in zip(now.costs, state.plan.costs, strict=True)])
    return stale | jnp.any(jnp.abs(jnp.log(jnp.maximum(moved, 1e-30))) > REPLAN_DRIFT)


def _make_plan(cfg: _Settings, now: _Now):
    """A plan from step ``now.k`` to the end: bins of the forecast weight, valued backwards.

    The weight of a later step ``s`` is forecast to decay like the progress rate: its excess
    over ``tw`` falls as ``(k / s) ** (decay + 1)``.
    """
    tw, k = cfg.tw, now.k
    weight_at = lambda s: tw + (now.w - tw) * jnp.power(k / jnp.maximum(s, k), cfg.decay + 1.0)
    per_step = lambda s: (
        jnp.sqrt(now.costs.lam * weight_at(s) / (2.0 * now.costs.cost)) * now.costs.step_time
    )
    edges, reaches_end = _horizon.edges_for(k, now.n_total, per_step)
    weights = weight_at(0.5 * (edges[1:] + edges[:-1]))
    plan = _horizon.Plan(edges, weights, jnp.zeros_like(edges), now.costs)
    return _horizon.values(plan, end_without_save=now.end_known & reaches_end)


def _replan(cfg: _Settings, state: CociState, now: _Now):
    """A new plan from this step, its step, and the value of the work since the last save."""
    plan = _make_plan(cfg, now)
    rollback = _horizon.value_before(
        plan,
        behind=(now.k - state.last_save.astype(jnp.float32)) * now.tau,
        exposure=now.exposure,
        end_without_save=now.end_known & (plan.edges[-1] >= now.n_total),
    )
    return plan, now.clock.last_step, rollback


def _check(cfg: _Settings, state: CociState, now: _Now, stale):
    """The decision at a check step (the plan redone first if ``stale``).

    Returns:
      ``(save, plan, plan_step, rollback, next_check)``: after a save, a plan made from here.
    """
    plan, plan_step, rollback = jax.lax.cond(
        stale,
        lambda _: _replan(cfg, state, now),
        lambda _: (state.plan, state.plan_step, state.rollback),
        None,
    )
    k = now.k
    save, next_edge = _horizon.decide(
        plan,
        step=k,
        exposure=now.exposure,
        rollback_value=rollback,
        end_without_save=now.end_known & (plan.edges[-1] >= now.n_total),
    )
    # A save after the last step, or with no timed training since the last one, protects
    # nothing.
    save = save & (k < now.n_total) & (now.clock.since_save > 0)
    replan_at = plan_step.astype(jnp.float32) + jnp.maximum(cfg.rf * now.interval, 1.0)
    next_check = _base.halfway(now.step, jnp.minimum(next_edge, replan_at) - k)
    # A new segment starts here: plan it from here now, so its value is exact.
    plan, plan_step, rollback = jax.lax.cond(
        save,
        lambda _: (lambda p: (p, now.clock.last_step, p.values[0]))(_make_plan(cfg, now)),
        lambda _: (plan, plan_step, rollback),
        None,
    )
    return save, plan, plan_step, rollback, next_check


class _Track(NamedTuple):
    """The progress-rate estimates of :func:`_track`: new values of the state fields so named,
    and ``rate_hat``, the loss drop per step they estimate (NaN: not enough losses yet)."""

    count: jnp.ndarray
    level: jnp.ndarray
    slow: jnp.ndarray
    envelope: jnp.ndarray
    start: jnp.ndarray
    rate: jnp.ndarray
    rate_hat: jnp.ndarray


def _track(state: CociState, loss, is_new, span, *, trend: bool) -> _Track:
    """Online estimates of the progress rate (module docstring), fed one loss.

    Two estimators, chosen by whether the job's length is known:

    * ``trend=False`` (``total_steps`` given): the moving average of the per-step drops of the
      best-so-far envelope of the loss's moving average (span ``span``, warm-up corrected):
      the causal twin of the hindsight weights of :func:`cocijax.sim.progress_weights`, whose
      span ``N / 200`` is then known; but never less than ``TREND_SHARE`` times the trend
      below, because a noisy loss stalls the envelope for long stretches through real progress
      (measured: 6.5% worse than the best classic policy on a batch-4 SGD curve of
      ``benchmarks/curves``; the trend alone, on clean curves, forecasts worse than the
      envelope).
    * ``trend=True``: the trend between two moving averages of the loss, spans ``span`` and
      ``SLOW_SPAN * span``: for a loss falling ``r`` per step an average of span ``s`` lags
      ``(s - 1) / 2`` steps behind, so ``r = (slow - fast) / (lag_slow - lag_fast)``. Without
      ``total_steps`` the span grows with the guessed horizon, and on a noisy minibatch loss the
      envelope's drops come in rare bursts (none for long stretches while the average hovers
      above its best): measured on the project's own curves (``benchmarks/curves``), that left
      ``w`` at ``time_weight`` through real progress and lost up to 33% to Young's rule, where
      the trend averages the noise away. NaN until the averages lag apart by a step.

    Returns:
      The :class:`_Track` of the new estimates.
    """
    loss = jnp.asarray(loss, jnp.float32)
    valid = jnp.isfinite(loss) & is_new
    y = jnp.where(valid, loss, 0.0)
    count = state.count + valid.astype(jnp.int32)
    n = count.astype(jnp.float32)

    def average(old, s):
        """The moving average of span ``s`` (a plain mean at first) and its lag in steps."""
        gain = jnp.maximum(2.0 / (s + 1.0), 1.0 / jnp.maximum(n, 1.0))
        new = jnp.where(jnp.isnan(old), y, old + gain * (y - old))
        return jnp.where(valid, new, old), 0.5 * (jnp.minimum(s, n) - 1.0)

    level, lag_fast = average(state.level, span)
    slow, lag_slow = average(state.slow, SLOW_SPAN * span)
    envelope = jnp.where(jnp.isnan(state.envelope), level, jnp.minimum(state.envelope, level))
    start = jnp.where(
        valid & (n <= span + 1.0),
        jnp.where(jnp.isnan(state.start), y, state.start + (y - state.start) / n),
        state.start,
    )
    lags = lag_slow - lag_fast
    trend_now = jnp.where(
        lags >= 1.0, jnp.maximum(slow - level, 0.0) / jnp.maximum(lags, 1.0), jnp.nan
    )
    if trend:
        rate = jnp.where(valid, trend_now, state.rate)
        return _Track(count, level, slow, envelope, start, rate, rate)
    alpha = 2.0 / (span + 1.0)
    drop = jnp.where(jnp.isnan(state.envelope), 0.0, state.envelope - envelope)
    rate = jnp.where(valid, state.rate + alpha * (drop - state.rate), state.rate)
    warm = 1.0 - jnp.power(1.0 - alpha, n)
    rate_hat = rate / jnp.maximum(warm, 1e-6)
    # fmax: the trend is NaN until the averages lag apart.
    rate_hat = jnp.fmax(rate_hat, TREND_SHARE * trend_now)
    return _Track(count, level, slow, envelope, start, rate, rate_hat)


def _between(w_lo, w_hi):
    """The weight when the job may end anywhere between the ends that give ``w_lo``, ``w_hi``.

    Minimax regret in log density: the geometric middle of the two, and never on the other side
    of 1 (Young) from either of them, so that no end in the range makes the step's decision
    worse than Young's rule.
    """
    mid = jnp.sqrt(w_lo * w_hi)
    return jnp.where(
        w_lo >= 1.0,
        jnp.minimum(mid, w_lo * w_lo),
        jnp.where(w_hi <= 1.0, jnp.maximum(mid, w_hi * w_hi), 1.0),
    )
