"""``coci``: the value-optimal convergence-aware policy.

A lost (recomputed) second of training is worth ``w(t) = time_weight + (1 - time_weight) v(t)``
seconds, ``v`` being the progress rate (loss drop per second) normalised to mean 1 over the job;
a save stalls ``C`` seconds. Minimising ``C n + lambda w / (2 n)`` per unit time gives the local
checkpoint density ``n(t) = sqrt(lambda w(t) / (2 C))`` (``lambda = 1 / MTBF``), which with
``w = 1`` is Young's rule. The policy integrates ``n`` over training time since the last save and
saves once the integral reaches 1 (to the nearest step).

How ``v`` is estimated online:

* the current rate is the per-second drop of the best-so-far envelope of an exponential moving
  average of the (spike-clipped) loss, itself averaged (with Adam-style warm-up bias
  correction), both over a span of ``max(3, N / 200)`` steps like the hindsight weights of
  :func:`cocijax.sim.progress_weights`;
* the job-mean rate is the drop seen so far plus the drop the convergence model
  (:mod:`cocijax.policies._convergence`) still forecasts up to step ``N``, divided by the job
  time ``N * step_time``. ``N`` is ``total_steps`` when given. Without it the forecast stands
  alone: ``N`` is where the fitted curve has all but ``CONVERGED_FRACTION`` (5 %) of its drop
  behind it, clipped to ``[horizon_factor, MAX_HORIZON]`` times the current step.

Until ``min_fit_points`` finite losses have been seen, ``w = 1`` (Young); until the first fit
the forecast is taken as 0, which overstates ``v`` and so errs towards protecting the usually
steep start. ``w`` is clamped to ``[min_weight, max_weight]``
(density between ``sqrt`` of those times Young's) so that a bad forecast cannot gamble the
wall-clock overhead away.

Recovery cost: under Poisson failures each failure costs ``R`` (with restarts,
``(exp(lambda R) - 1) / lambda``) whatever the schedule, so ``R`` moves neither the optimal
density nor any decision here; it is validated and kept so that callers describe the whole
system (it would matter for bursty, non-Poisson failures right after a restart, which this policy
does not model). What does depend on the end of the job is the
last save: with ``total_steps`` known, a save is skipped when the weighted work it would protect
times the chance of a failure in the time left, ``(1 - exp(-lambda T_left)) W``, is below its
stall ``C``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from cocijax.policies import _base, _convergence
from cocijax.policies._base import Policy

DEFAULT_MTBF_S = 6 * 3600.0
# Without total_steps: the job is assumed to end when the forecast drop still to come is this
# fraction of the whole drop, but after at most MAX_HORIZON times the steps done so far.
CONVERGED_FRACTION = 0.05
MAX_HORIZON = 100.0
# Span of the online moving averages relative to the hindsight window (max(3, N / 200) points).
SPAN_FACTOR = 1.0


class CociState(NamedTuple):
    """State of :func:`coci`."""

    clock: _base.Clock
    history: _convergence.History
    fit: _convergence.Fit
    level: jnp.ndarray  # shape=(), float32, moving average of the loss (NaN before any)
    envelope: jnp.ndarray  # shape=(), float32, best-so-far of `level`
    start: jnp.ndarray  # shape=(), float32, first value of `level`
    rate: jnp.ndarray  # shape=(), float32, averaged envelope drop per second
    integral: jnp.ndarray  # shape=(), float32, integral of the density since the last save
    exposure: jnp.ndarray  # shape=(), float32, weighted seconds since the last save
    weight: jnp.ndarray  # shape=(), float32, the w(t) used at the last call (for inspection)


def coci(
    mtbf_s: float = DEFAULT_MTBF_S,
    recovery_s: float = 0.0,
    time_weight: float = 0.25,
    total_steps: int | None = None,
    *,
    min_weight: float = 0.25,
    max_weight: float = 16.0,
    horizon_factor: float = 2.0,
    refit_every: int = 8,
    min_fit_points: int = 3,
    cost_prior_s: float = 10.0,
) -> Policy:
    """Convergence-aware, value-optimal checkpoint policy (see the module docstring).

    Args:
      mtbf_s: mean time between failures in seconds (default 6 h).
      recovery_s: seconds to recover from a failure (see the module docstring for its role).
      time_weight: weight of a plain lost second, in ``[0, 1]``; 1 reduces to Young's rule.
      total_steps: planned number of steps, when known; sharpens the progress forecast.
      min_weight: lower clamp of ``w`` (the density never drops below ``sqrt(min_weight)``
        times Young's).
      max_weight: upper clamp of ``w``.
      horizon_factor: without ``total_steps``, the job is assumed to last at least this many
        times the steps done so far.
      refit_every: refit the convergence model every this many steps.
      min_fit_points: finite losses needed before ``v`` is used and the model is first fitted
        (Young's rule until then).
      cost_prior_s: checkpoint cost assumed until the first measured one.

    Returns:
      A :class:`~cocijax.policies.Policy`.

    Raises:
      ValueError: naming the parameter when an argument is out of range.

    Example:
      >>> import numpy as np, cocijax as cj
      >>> losses = 3.0 + 5.0 / np.sqrt(np.arange(1, 2001))
      >>> policy = cj.policies.coci(mtbf_s=3600.0, total_steps=2000)
      >>> steps = cj.plan(losses, policy, step_time_s=2.0, checkpoint_cost_s=10.0)

    References:
      Li, Wang et al., `Convergence-aware optimal checkpointing for exploratory deep learning
      training jobs <https://doi.org/10.1016/j.future.2024.107597>`_, FGCS 2024.
      Young, `A first order approximation to the optimum checkpoint interval
      <https://doi.org/10.1145/361147.361115>`_, CACM 1974.
    """
    lam = 1.0 / _base.check_positive("mtbf_s", mtbf_s)
    _base.check_nonnegative("recovery_s", recovery_s)
    tw = _base.check_unit("time_weight", time_weight)
    if total_steps is not None:
        if isinstance(total_steps, bool) or int(total_steps) != total_steps or total_steps < 1:
            raise ValueError(
                f"total_steps must be a positive integer or None, got {total_steps!r}."
            )
        total_steps = int(total_steps)
    wmin = _base.check_positive("min_weight", min_weight)
    wmax = _base.check_positive("max_weight", max_weight)
    if wmin > 1.0 or wmax < 1.0:
        raise ValueError(
            f"min_weight must be <= 1 <= max_weight, got min_weight={min_weight!r}, "
            f"max_weight={max_weight!r}."
        )
    hf = _base.check_positive("horizon_factor", horizon_factor)
    if hf < 1.0:
        raise ValueError(f"horizon_factor must be >= 1, got {horizon_factor!r}.")
    if int(refit_every) != refit_every or refit_every < 1:
        raise ValueError(f"refit_every must be a positive integer, got {refit_every!r}.")
    if int(min_fit_points) != min_fit_points or min_fit_points < 2:
        raise ValueError(f"min_fit_points must be an integer >= 2, got {min_fit_points!r}.")
    _base.check_nonnegative("cost_prior_s", cost_prior_s)
    refit_every, min_fit_points = int(refit_every), int(min_fit_points)
    nan = jnp.asarray(jnp.nan, jnp.float32)
    zero = jnp.zeros((), jnp.float32)

    def init() -> CociState:
        return CociState(
            _base.clock_init(),
            _convergence.history_init(),
            _convergence.fit_init(),
            nan,
            nan,
            nan,
            zero,
            zero,
            zero,
            jnp.ones((), jnp.float32),
        )

    def update(state: CociState, *, step, loss, step_time_s, checkpoint_cost_s):
        clock, is_new, dt = _base.clock_tick(state.clock, step, step_time_s, checkpoint_cost_s)
        tau, cost = _base.smoothed(clock, cost_prior_s)
        k = clock.last_step.astype(jnp.float32)
        if total_steps is not None:
            n_total = jnp.float32(total_steps)
        else:
            # The job is taken to run until the forecast says it has converged (all but
            # CONVERGED_FRACTION of the drop done), between horizon_factor and MAX_HORIZON times
            # the steps so far; the previous fit gives the answer.
            drop = state.start - state.fit.c
            n_total = jnp.clip(
                _convergence.converged_at(state.fit, drop, CONVERGED_FRACTION),
                hf * k,
                MAX_HORIZON * k,
            )
            n_total = jnp.where(jnp.isfinite(n_total), n_total, hf * k)
            n_total = jnp.maximum(n_total, k + 1.0)
        span = jnp.maximum(3.0, n_total / 200.0) * SPAN_FACTOR
        alpha = 2.0 / (span + 1.0)

        loss = jnp.asarray(loss, jnp.float32)
        valid = jnp.isfinite(loss) & is_new
        y = jnp.where(valid, _convergence.clip_spike(state.history, loss), 0.0)
        history = _convergence.history_add(state.history, k, jnp.where(valid, loss, 0.0), valid)

        # Moving averages warm up as plain means (weight max(alpha, 1 / count)), so the first
        # loss does not linger in them; `start` is the mean of the first span + 1 losses, the
        # first window of the hindsight weights' centred average.
        count = history.count.astype(jnp.float32)
        gain = jnp.maximum(alpha, 1.0 / jnp.maximum(count, 1.0))
        level = jnp.where(
            valid,
            jnp.where(jnp.isnan(state.level), y, state.level + gain * (y - state.level)),
            state.level,
        )
        envelope = jnp.where(jnp.isnan(state.envelope), level, jnp.minimum(state.envelope, level))
        in_first = valid & (count <= span + 1.0)
        start = jnp.where(
            in_first,
            jnp.where(jnp.isnan(state.start), y, state.start + (y - state.start) / count),
            state.start,
        )
        drop = jnp.where(jnp.isnan(state.envelope), 0.0, state.envelope - envelope)
        rate = jnp.where(valid, state.rate + alpha * (drop / dt - state.rate), state.rate)

        ready = history.count >= min_fit_points
        refit = valid & ready & ((clock.last_step % refit_every == 0) | ~state.fit.ok)
        # The rate average starts at 0: undo that bias (as Adam does) while it warms up.
        warm = 1.0 - jnp.power(1.0 - alpha, history.count.astype(jnp.float32))
        rate_hat = rate / jnp.maximum(warm, 1e-6)
        fit = _convergence.maybe_fit(refit, history, k, state.fit)
        ahead = jnp.where(
            fit.ok,
            _convergence.predict(fit, k) - _convergence.predict(fit, jnp.maximum(n_total, k)),
            0.0,
        )
        total_drop = (start - envelope) + jnp.maximum(ahead, 0.0)
        mean_rate = total_drop / (jnp.maximum(n_total, k) * tau)
        # Before a fit exists the forecast is 0: the job-mean rate is underestimated and v errs
        # towards protecting the (usually steep) start.
        v = jnp.where(
            ready & (mean_rate > 0), rate_hat / jnp.where(mean_rate > 0, mean_rate, 1.0), 1.0
        )
        w = jnp.clip(tw + (1.0 - tw) * v, wmin, wmax)
        w = jnp.where(jnp.isfinite(w), w, 1.0)

        density = jnp.sqrt(lam * w / (2.0 * cost))
        integral = state.integral + density * dt
        exposure = state.exposure + w * dt
        save = integral >= 1.0 - 0.5 * density * tau
        if total_steps is not None:
            left = jnp.maximum(n_total - k, 0.0) * tau
            save = save & (-jnp.expm1(-lam * left) * exposure >= cost)
        clock = _base.clock_saved(clock, save)
        return save, CociState(
            clock=clock,
            history=history,
            fit=fit,
            level=level,
            envelope=envelope,
            start=start,
            rate=rate,
            integral=jnp.where(save, 0.0, integral),
            exposure=jnp.where(save, 0.0, exposure),
            weight=w,
        )

    return Policy(init, update)
