"""Time-based policies: fixed interval, Young, Daly and CheckFreq.

Young and Daly save when the training time since the last save reaches their optimal interval,
rounded to the nearest step (a save happens once the time left to the interval is under half a
step), with the interval recomputed at each check from the smoothed checkpoint cost. Checks come
half way to where the smoothed step time says the interval ends (see ``_base``), so a caller can
skip the policy in between.

``mtbf_s=None`` lets the caller's measured MTBF (the manager learns it from the job) drive the
interval, with ``prior_mtbf_s`` until there is one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from cocijax.policies import _base
from cocijax.policies._base import Policy


class ClassicState(NamedTuple):
    clock: _base.Clock


def young_interval(checkpoint_cost_s, mtbf_s):
    """Young's first-order optimal interval ``sqrt(2 C M)`` in seconds (numpy or jax inputs)."""
    return jnp.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval(checkpoint_cost_s, mtbf_s):
    """Daly's higher-order estimate of the optimal interval (seconds of work between saves).

    ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` when ``C < 2M``, else ``M``.
    """
    c, m = checkpoint_cost_s, mtbf_s
    x = c / (2.0 * m)
    tau = jnp.sqrt(2.0 * c * m) * (1.0 + jnp.sqrt(x) / 3.0 + x / 9.0) - c
    return jnp.where(c < 2.0 * m, tau, m)


def _init() -> ClassicState:
    return ClassicState(_base.clock_init())


def _interval_policy(
    interval_fn, mtbf_s: float | None, prior_mtbf_s: float | None, cost_prior_s: float | None
) -> Policy:
    """Saves once ``interval_fn(cost, mtbf)`` seconds of training passed since the last save."""
    given, prior = _base.check_mtbf(mtbf_s, prior_mtbf_s)
    cost_prior = _base.check_cost_prior(cost_prior_s)

    def rule(state, seen: _base.Seen):
        clock, _, _ = _base.clock_tick(state.clock, seen)
        tau, cost = _base.smoothed(clock, cost_prior)
        mtbf = _base.resolve(given, seen.mtbf_s, prior)
        left = interval_fn(cost, mtbf) - 0.5 * tau - clock.since_save
        save = _base.checking(clock, seen.step) & (left <= 0)
        after = jnp.where(save, left + clock.since_save, left)  # seconds to the next save
        next_check = _base.halfway(seen.step, after / tau)
        return save, ClassicState(_base.clock_saved(clock, save, seen.step, next_check))

    return _base.make_policy(
        _init, rule, mtbf_s=given, cost_prior_s=None if cost_prior_s is None else cost_prior
    )


def fixed(every: int) -> Policy:
    """Saves after every step that is a multiple of ``every``.

    Args:
      every: interval in steps, a positive integer.

    Returns:
      A :class:`Policy`.

    Raises:
      ValueError: if ``every`` is not a positive integer.

    Example:
      >>> import numpy as np, cocijax as cj
      >>> cj.plan(np.ones(10), cj.policies.fixed(4), step_time_s=1.0, checkpoint_cost_s=1.0)
      array([4, 8])
    """
    if (
        isinstance(every, bool)
        or not isinstance(every, int | float)
        or every != int(every)
        or every < 1
    ):
        raise ValueError(f"every must be a positive integer, got {every!r}.")
    every = int(every)

    def rule(state, seen: _base.Seen):
        clock, _, _ = _base.clock_tick(state.clock, seen)
        step = jnp.asarray(seen.step, jnp.int32)
        save = (step % every) == 0
        next_multiple = (step // every + 1) * every
        return save, ClassicState(_base.clock_saved(clock, save, step, next_multiple))

    return _base.make_policy(_init, rule, uses_cost=False)


def young(
    mtbf_s: float | None = None,
    *,
    prior_mtbf_s: float | None = None,
    cost_prior_s: float | None = None,
) -> Policy:
    """Young's rule: save every ``sqrt(2 C M)`` seconds of training.

    Args:
      mtbf_s: mean time between failures, seconds; ``None`` uses the caller's measured MTBF
        (``update(..., mtbf_s=...)``, as the manager passes it), ``prior_mtbf_s`` until then.
      prior_mtbf_s: MTBF assumed before one is measured; default 24 h divided by
        ``jax.device_count()``.
      cost_prior_s: checkpoint cost assumed until the first measured one; ``None``: 10 s, or
        the prior a caller gives (the managers give one from the state's size).

    Returns:
      A :class:`Policy`.

    Raises:
      ValueError: if an argument is not positive.

    References:
      Young, `A first order approximation to the optimum checkpoint interval
      <https://doi.org/10.1145/361147.361115>`_, CACM 1974.
    """
    return _interval_policy(young_interval, mtbf_s, prior_mtbf_s, cost_prior_s)


def daly(
    mtbf_s: float | None = None,
    *,
    prior_mtbf_s: float | None = None,
    cost_prior_s: float | None = None,
) -> Policy:
    """Daly's higher-order optimal interval (see :func:`daly_interval`).

    Takes the arguments of :func:`young` and raises as it does.

    References:
      Daly, `A higher order estimate of the optimum checkpoint interval for restart dumps
      <https://doi.org/10.1016/j.future.2004.11.016>`_, FGCS 2006.
    """
    return _interval_policy(daly_interval, mtbf_s, prior_mtbf_s, cost_prior_s)


def checkfreq(max_overhead: float = 0.05, *, cost_prior_s: float | None = None) -> Policy:
    """CheckFreq's rule: the most frequent interval whose stall stays under ``max_overhead``.

    CheckFreq profiles the stall ``C`` of one save and the step time ``t`` and then raises the
    interval until the measured stall overhead is at most ``max_overhead`` of training time; the
    fixed point is ``k = max(ceil(C / (max_overhead * t)), 1)`` steps, recomputed here from the
    smoothed measurements at every call.

    Args:
      max_overhead: allowed fraction of training time spent stalled, in ``(0, 1]``.
      cost_prior_s: checkpoint cost assumed until the first measured one; ``None``: 10 s, or
        the prior a caller gives (the managers give one from the state's size).

    Returns:
      A :class:`Policy`.

    Raises:
      ValueError: if ``max_overhead`` is not in ``(0, 1]``.

    References:
      Mohan, Phanishayee, Chidambaram, `CheckFreq: Frequent, fine-grained DNN checkpointing
      <https://www.usenix.org/conference/fast21/presentation/mohan>`_, FAST 2021
      (``src/cf_iterator.py`` of msr-fiddle/CheckFreq: ``_chk_freq`` grows by 2 while the
      measured overhead exceeds ``max_overhead``).
    """
    mo = _base.check_positive("max_overhead", max_overhead)
    if mo > 1.0:
        raise ValueError(f"max_overhead must be in (0, 1], got {max_overhead!r}.")
    cost_prior = _base.check_cost_prior(cost_prior_s)

    def rule(state, seen: _base.Seen):
        clock, _, _ = _base.clock_tick(state.clock, seen)
        tau, cost = _base.smoothed(clock, cost_prior)
        every = jnp.maximum(jnp.ceil(cost / (mo * tau) - 1e-6), 1.0)
        left = every - clock.steps_since_save.astype(jnp.float32)
        save = _base.checking(clock, seen.step) & (left <= 0)
        next_check = _base.halfway(seen.step, jnp.where(save, every, left))
        return save, ClassicState(_base.clock_saved(clock, save, seen.step, next_check))

    return _base.make_policy(_init, rule, cost_prior_s=None if cost_prior_s is None else cost_prior)
