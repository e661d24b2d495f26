"""``coci_paper``: the rule of the published COCI artifact, kept as the anchor to compare with.

Followed: ``src/COCI_Iterator.py`` of wangzc-HPC/COCI, class ``COCIIterator``:

* ``_parameter_profile`` / ``_fit``: the loss is fitted as ``exp(theta1 t + theta2)`` of the
  wall time ``t`` in **minutes** (``scipy.optimize.curve_fit``), first after
  ``profile_threshold = 50`` iterations;
* ``_COCI_strategy``: with ``ts`` the checkpoint cost and ``ft_lambda`` the failure rate (both per
  minute), the loss decrement between checkpoints is
  ``pc = (1 - exp(theta1 ts)) * (1 / (2 ft_lambda) - 1 / (2 theta1))`` and checkpoints go where
  the fitted loss has fallen by ``pc``, ``2 pc``, ... from its value now
  (``floor(loss_now / pc)`` of them), in training time (checkpoint time excluded);
* ``COCI_save_dynamic``: one save at iteration 10 to time a checkpoint (kept);
* ``_online_fitting``: every ``fit_interval = 10000`` iterations the points gathered since the
  last re-plan are refitted; if ``theta1`` or ``theta2`` moved by more than 0.1 the plan is
  redone from the current fitted loss and the gathered points are cleared.

Deliberate differences, all documented: the least-squares fit is the same model solved as a grid
over ``theta1`` with the closed-form optimal ``exp(theta2)`` (no iterative solver in a jitted
step), on the bounded binned history of :mod:`cocijax.policies._convergence`; a re-plan
replaces the old plan (the artifact inserts the new slots ahead of the old ones); and when the
fit does not describe a falling loss (``theta1 >= 0``, ``pc <= 0``) the artifact's formula is
undefined, so the policy falls back to Young's interval rather than never saving. Note that
``pc`` has units of time but is compared with a loss, as in the artifact: the schedule depends
on the choice of minutes, which is kept.

References:
  Li, Wang et al., `Convergence-aware optimal checkpointing for exploratory deep learning
  training jobs <https://doi.org/10.1016/j.future.2024.107597>`_, FGCS 2024; artifact
  https://github.com/wangzc-HPC/COCI.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cocijax.policies import _base, _convergence
from cocijax.policies._base import Policy


@functools.cache
def _rate_grid() -> jax.Array:
    """Grid of -theta1 * span (span = time covered by the history): from almost flat to a decay
    over 1/200 of it.

    Made on first use, not at import, eagerly in a thread of its own, where no trace of the
    caller is active (JAX's trace state is per thread): the same float32 values whether it is
    first asked inside ``jit`` or not.
    """
    # Not at import: it compiled four small XLA programs, 0.1 s of every `import cocijax` that
    # reached the manager (-X importtime). Not jax.ensure_compile_time_eval: that gave 65 of
    # the 96 values one ulp apart.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(
            lambda: jnp.asarray(jnp.logspace(-3.0, jnp.log10(200.0), 96), jnp.float32)
        ).result()


# The artifact saves once at iteration 10 to time a checkpoint.
PROFILE_SAVE_STEP = 10


class PaperState(NamedTuple):
    """State of :func:`coci_paper`."""

    clock: _base.Clock
    history: _convergence.History  # points (minutes, loss) since the last re-plan
    theta1: jnp.ndarray  # shape=(), float32, per minute
    theta2: jnp.ndarray  # shape=(), float32
    planned: jnp.ndarray  # shape=(), bool, a plan exists
    next_level: jnp.ndarray  # shape=(), float32, fitted loss at which the next save happens
    decrement: jnp.ndarray  # shape=(), float32, pc
    count: jnp.ndarray  # shape=(), int32, iterations seen


def fit_exp(h: _convergence.History):
    """Least squares ``y ~ exp(theta1 t + theta2)`` over the binned points ``(t, y)``.

    ``theta1`` is searched on a log grid, then on a finer grid around the best point (two
    stages of 96 and 64 candidates: relative resolution ~0.4 %); ``exp(theta2)`` is the
    closed-form optimum for each candidate.
    """
    span = jnp.maximum(jnp.max(jnp.where(h.n > 0, h.x, 0.0)), 1e-6)
    rates = _rate_grid() / span
    i = jnp.argmin(_exp_sse(h, rates)[0])
    grid = _rate_grid()
    step = jnp.log(grid[1] / grid[0])
    fine = rates[i] * jnp.exp(jnp.linspace(-1.0, 1.0, 64) * step)
    sse, scale = _exp_sse(h, fine)
    j = jnp.argmin(sse)
    return -fine[j], jnp.log(jnp.maximum(scale[j], 1e-30))


def _exp_sse(h: _convergence.History, rates):
    e = jnp.exp(-rates[:, None] * h.x[None, :])
    see = (h.n * e * e).sum(axis=1)
    sye = (h.n * h.y * e).sum(axis=1)
    scale = sye / jnp.maximum(see, 1e-30)
    sse = (h.n * h.y * h.y).sum() - scale * sye
    return jnp.where(scale > 0, sse, jnp.inf), scale


def _no_fit(h: _convergence.History):
    del h
    return jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)


def coci_paper(
    mtbf_s: float,
    *,
    profile_steps: int = 50,
    fit_interval: int = 10000,
    threshold: float = 0.1,
    time_unit_s: float = 60.0,
    cost_prior_s: float | None = None,
) -> Policy:
    """The COCI artifact's rule: saves at equal decrements of the fitted loss.

    Args:
      mtbf_s: mean time between failures, seconds.
      profile_steps: iterations before the first fit (the artifact's ``profile_threshold``).
      fit_interval: refit every this many iterations (the artifact's ``fit_interval``).
      threshold: re-plan when ``theta1`` or ``theta2`` moves by more than this.
      time_unit_s: the artifact's time unit (minutes).
      cost_prior_s: checkpoint cost assumed until the first measured one; ``None``: 10 s, or
        the prior a caller gives (the managers give one from the state's size).

    Returns:
      A :class:`~cocijax.policies.Policy`.

    Raises:
      ValueError: naming the parameter when an argument is out of range.
    """
    m = _base.check_positive("mtbf_s", mtbf_s)
    for name, val in (("profile_steps", profile_steps), ("fit_interval", fit_interval)):
        if isinstance(val, bool) or int(val) != val or val < 2:
            raise ValueError(f"{name} must be an integer >= 2, got {val!r}.")
    thr = _base.check_positive("threshold", threshold)
    unit = _base.check_positive("time_unit_s", time_unit_s)
    cost_prior = _base.check_cost_prior(cost_prior_s)
    profile_steps, fit_interval = int(profile_steps), int(fit_interval)
    ft_lambda = unit / m  # failures per time unit
    f0 = jnp.zeros((), jnp.float32)

    def init() -> PaperState:
        return PaperState(
            _base.clock_init(), _convergence.history_init(), f0, f0, jnp.zeros((), bool), f0, f0,
            jnp.zeros((), jnp.int32),
        )  # fmt: skip

    def plan(theta1, theta2, t_now, ts):
        now = jnp.exp(theta1 * t_now + theta2)
        pc = -jnp.expm1(theta1 * ts) * (1.0 / (2.0 * ft_lambda) - 1.0 / (2.0 * theta1))
        ok = (theta1 < 0) & (pc > 0) & jnp.isfinite(pc) & jnp.isfinite(now)
        return ok, now - pc, pc

    def rule(state: PaperState, seen: _base.Seen):
        # The artifact takes its failure rate as given: seen.mtbf_s and recovery_s are not used.
        clock, is_new, _ = _base.clock_tick(state.clock, seen)
        tau, cost = _base.smoothed(clock, cost_prior)
        t_now = clock.elapsed / unit
        ts = cost / unit
        loss = jnp.asarray(seen.loss, jnp.float32)
        valid = jnp.isfinite(loss) & is_new
        count = state.count + is_new.astype(jnp.int32)
        history = _convergence.history_add(state.history, t_now, jnp.where(valid, loss, 0.0), valid)

        profile = is_new & (count == profile_steps)
        refit = is_new & (count > profile_steps) & (count % fit_interval == 0)

        do = profile | refit
        th1, th2 = jax.lax.cond(do, fit_exp, _no_fit, history)
        changed = do & (
            profile | (jnp.abs(th1 - state.theta1) > thr) | (jnp.abs(th2 - state.theta2) > thr)
        )
        ok, level, pc = plan(th1, th2, t_now, ts)
        theta1 = jnp.where(changed, th1, state.theta1)
        theta2 = jnp.where(changed, th2, state.theta2)
        planned = jnp.where(changed, ok, state.planned)
        next_level = jnp.where(changed, level, state.next_level)
        pc = jnp.where(changed, pc, state.decrement)
        # The artifact clears its online points when the parameters change.
        history = jax.tree.map(
            lambda a, b: jnp.where(changed, a, b), _convergence.history_init(), history
        )

        fitted = jnp.exp(theta1 * t_now + theta2)
        save_plan = planned & (next_level >= 0) & (fitted <= next_level)
        # Young's interval when the artifact's plan is undefined (see the module docstring).
        fallback = (count > profile_steps) & ~planned
        save_young = fallback & (clock.since_save >= jnp.sqrt(2.0 * cost * m) - 0.5 * tau)
        save = save_plan | save_young | (is_new & (count == PROFILE_SAVE_STEP))
        next_level = jnp.where(save_plan, next_level - pc, next_level)
        return save, PaperState(
            # The fitted loss can cross the next level at any step: check every step.
            _base.clock_saved(clock, save, seen.step, jnp.asarray(seen.step, jnp.int32) + 1),
            history,
            theta1,
            theta2,
            planned,
            next_level,
            pc,
            count,
        )

    return _base.make_policy(
        init, rule, mtbf_s=m, cost_prior_s=None if cost_prior_s is None else cost_prior
    )
