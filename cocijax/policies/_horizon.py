"""Receding-horizon checkpoint planning: exact segment costs on binned weights, a backward DP.

The expected overhead of a schedule under Poisson failures (rate ``lam``) splits into segments: a
segment of ``W`` seconds of work followed by a save that stalls ``C`` seconds. A failure inside it
loses the weighted work done so far in the segment plus the part of the stall spent, then costs a
recovery (``rec = (exp(lam R) - 1) / lam`` seconds in expectation, failures during recovery
included), and the segment starts over. With ``F`` the weighted work of the segment and
``I = integral_0^W exp(-lam x) w(x) dx``, its expected weighted cost is::

    C - F + exp(lam D) I + (exp(lam C) - 1 - lam C) / lam + (exp(lam D) - 1) rec,   D = W + C

(for ``w = 1`` this is the classic ``(exp(lam D) - 1) exp(lam R) / lam - W``). This is the cost
model of :func:`cocijax.sim.simulate` and :func:`cocijax.sim.optimal_schedule`, here on a forecast:
the weights are constant within each of ``NUM_BINS`` bins whose edges are step positions, so
``F`` and ``I`` are exact sums over bins. ``values`` runs the backward dynamic program over the
edges (Toueg and Babaoglu's, with weights), ``O(NUM_BINS ** 2)``. Every exponential is taken
relative to the segment's own start, so float32 stays accurate however long the horizon.

``decide`` then answers the online question at step ``t`` with the current segment open since
a save (its weighted work so far ``X``): of "save now" and "run on to an edge ``e`` and save there
(or to the end of the job without a save)", which has the least expected cost to go? A failure
before the segment is saved rolls back to its start, whose value the caller keeps.

References:
  Toueg and Babaoglu, `On the optimum checkpoint selection problem
  <https://doi.org/10.1137/0213041>`_, SIAM J. Comput. 1984.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NUM_BINS = 128
# A plan looks this many expected saves ahead at most (see edges_for).
HORIZON_SAVES = 48.0
# exp(x) of float32 overflows above ~88: a segment that long is never worth planning.
_MAX_EXPONENT = 80.0


class Costs(NamedTuple):
    """The failure and cost model a plan is made with (all in seconds)."""

    step_time: jnp.ndarray  # shape=(), float32
    cost: jnp.ndarray  # shape=(), float32, stall of one save
    rec: jnp.ndarray  # shape=(), float32, expected recovery per failure, restarts included
    lam: jnp.ndarray  # shape=(), float32, failure rate


class Plan(NamedTuple):
    """A forecast on bins, the cost model it was made with, and the values of saving at edges.

    Decisions use the plan's own cost model, not the latest measurements: the values were
    computed with it (a step time 20% off would make "save now" and "save later" compare costs
    in different units: measured on a live job, that alone made a policy save at every step).
    """

    edges: jnp.ndarray  # shape=(NUM_BINS + 1,), float32, step positions, edges[0] = planning step
    weights: jnp.ndarray  # shape=(NUM_BINS,), float32, forecast weight of each bin
    values: jnp.ndarray  # shape=(NUM_BINS + 1,), float32, cost to go from a save at each edge
    costs: Costs  # the cost model the values were computed with


def costs(step_time, cost, recovery_s, mtbf_s, *, xp=jnp) -> Costs:
    """The cost model of a plan; ``xp=np`` computes it from numbers without tracing."""
    f32 = lambda x: xp.asarray(x, xp.float32)
    lam = 1.0 / f32(mtbf_s)
    rec = xp.expm1(xp.minimum(lam * f32(recovery_s), f32(_MAX_EXPONENT))) / lam
    return Costs(f32(step_time), f32(cost), f32(rec), lam)


def _stall_loss(lam, c):
    """Expected stall seconds lost to failures during one save (``(e^{lam C} - 1 - lam C)/lam``)."""
    return (jnp.expm1(lam * c) - lam * c) / lam


def _segment_costs(k: Costs, work, weighted, integral, save):
    """Expected weighted cost of segments (arrays), with or without the save at their end."""
    c = jnp.where(save, k.cost, 0.0)
    d = work + c
    expo = k.lam * d
    value = (
        c
        - weighted
        + jnp.exp(jnp.minimum(expo, _MAX_EXPONENT)) * integral
        + _stall_loss(k.lam, c)
        + jnp.expm1(jnp.minimum(expo, _MAX_EXPONENT)) * k.rec
    )
    return jnp.where(expo < _MAX_EXPONENT, value, jnp.inf)


def _seconds(plan: Plan, k: Costs):
    """Bin starts (seconds from edges[0]), bin widths (seconds) and weighted work at each edge."""
    t = (plan.edges - plan.edges[0]) * k.step_time
    width = jnp.diff(t)
    weighted = jnp.concatenate([jnp.zeros(1), jnp.cumsum(plan.weights * width)])
    return t, width, weighted


def _integrals_from(plan: Plan, k: Costs, t, width, start):
    """``integral_{start}^{edge} exp(-lam (x - start)) w(x) dx`` for every edge (0 before start)."""
    # Each bin contributes its part after `start`, discounted from `start`.
    lo = jnp.maximum(t[:-1], start)
    hi = jnp.maximum(t[1:], start)
    part = plan.weights * jnp.exp(-k.lam * (lo - start)) * (-jnp.expm1(-k.lam * (hi - lo))) / k.lam
    return jnp.concatenate([jnp.zeros(1), jnp.cumsum(part)])


def values(plan: Plan, *, end_without_save: bool | jnp.ndarray) -> Plan:
    """Fills ``plan.values`` by the backward DP over its edges.

    ``values[i]`` is the least expected cost from a save at ``edges[i]`` to the last edge; the
    last segment ends with no save when ``end_without_save`` (the job ends there), else with one.
    """
    k = plan.costs
    t, width, weighted = _seconds(plan, k)
    n = plan.edges.shape[0]
    idx = jnp.arange(n)

    def body(r, v):
        i = n - 2 - r
        integral = _integrals_from(plan, k, t, width, t[i])
        seg = _segment_costs(k, t - t[i], weighted - weighted[i], integral, True)
        options = jnp.where(idx > i, seg + v, jnp.inf)
        to_end = _segment_costs(k, t[-1] - t[i], weighted[-1] - weighted[i], integral[-1], False)
        best = jnp.minimum(options.min(), jnp.where(end_without_save, to_end, jnp.inf))
        return v.at[i].set(best)

    return plan._replace(values=jax.lax.fori_loop(0, n - 1, body, jnp.zeros(n, jnp.float32)))


def value_before(
    plan: Plan, *, behind, exposure, end_without_save: bool | jnp.ndarray
) -> jnp.ndarray:
    """The cost to go from a save made ``behind`` seconds before the plan starts.

    The work since that save (``exposure`` weighted seconds, taken as spread evenly over
    ``behind``) is a segment already under way: its value is the best of ending it at one of
    the plan's edges (or at the end of the job without a save), each segment costed in full
    from the save, as :func:`values` costs them.
    """
    k = plan.costs
    t, width, weighted = _seconds(plan, k)
    behind = jnp.asarray(behind, jnp.float32)
    rate = exposure / jnp.maximum(behind, 1e-9)
    # Discounted integral of the part already done, then of the plan's part after it.
    done = rate * (-jnp.expm1(-k.lam * behind)) / k.lam
    integral = done + jnp.exp(-k.lam * behind) * _integrals_from(plan, k, t, width, 0.0)
    seg = _segment_costs(k, behind + t, exposure + weighted, integral, True) + plan.values
    seg = seg.at[0].set(jnp.where(behind > 0, seg[0], plan.values[0]))
    to_end = _segment_costs(k, behind + t[-1], exposure + weighted[-1], integral[-1], False)
    return jnp.minimum(seg.min(), jnp.where(end_without_save, to_end, jnp.inf))


def value_at(plan: Plan, position) -> jnp.ndarray:
    """The cost to go from a save at step ``position``, interpolated between edges."""
    return jnp.interp(position, plan.edges, plan.values)


def decide(
    plan: Plan,
    *,
    step,
    exposure,
    rollback_value,
    end_without_save: bool | jnp.ndarray,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Whether to save now, at step ``step``, and the edge the best alternative saves at.

    Args:
      plan: a plan made at or before ``step`` (its cost model is used).
      step: the current step (a position inside the plan).
      exposure: weighted seconds of work since the last save (lost on a failure now).
      rollback_value: cost to go from the last save (where a failure rolls back to).
      end_without_save: whether running on to the last edge without a save is an option.

    Returns:
      ``(save_now, next_edge)``: ``next_edge`` is the step of the best later save (or the last
      edge), meaningful when ``save_now`` is false.
    """
    k = plan.costs
    t, width, weighted = _seconds(plan, k)
    now = (jnp.asarray(step, jnp.float32) - plan.edges[0]) * k.step_time
    integral = _integrals_from(plan, k, t, width, now)
    done_now = jnp.interp(now, t, weighted)
    ahead = plan.edges > step
    work = jnp.where(ahead, t - now, 0.0)
    gained = jnp.where(ahead, weighted - done_now, 0.0)

    def option(work, gained, integral, c, value_after):
        # From now: a failure within the remaining D = work + c seconds loses the exposure and
        # what was added since, costs a recovery and rolls back; otherwise save and go on.
        d = work + c
        expo = k.lam * d
        lost_after = (
            integral
            - jnp.exp(-expo) * gained
            + jnp.exp(-k.lam * work)
            * (-jnp.expm1(-k.lam * c) - k.lam * c * jnp.exp(-k.lam * c))
            / k.lam
        )
        fail = -jnp.expm1(-expo)
        total = fail * (exposure + k.rec + rollback_value) + lost_after
        return total + jnp.exp(-expo) * (c + value_after)

    now_cost = option(0.0, 0.0, 0.0, k.cost, value_at(plan, step))
    later = jnp.where(ahead, option(work, gained, integral, k.cost, plan.values), jnp.inf)
    # Running on to the end of the job (the last edge) without another save.
    to_end = option(
        jnp.maximum(t[-1] - now, 0.0), jnp.maximum(weighted[-1] - done_now, 0.0), integral[-1],
        0.0, 0.0,
    )  # fmt: skip
    to_end = jnp.where(end_without_save, to_end, jnp.inf)
    best_later = jnp.argmin(later)
    save_now = (now_cost <= later[best_later]) & (now_cost <= to_end)
    next_edge = jnp.where(later[best_later] <= to_end, plan.edges[best_later], plan.edges[-1])
    return save_now, next_edge


def edges_for(step, end, density_fn, num_samples: int = 512):
    """Integer step edges from ``step`` towards ``end``: fine now, coarser further ahead.

    ``density_fn(positions)`` is the forecast number of saves per step (first order). The plan
    reaches at most ``HORIZON_SAVES`` expected saves ahead: what lies further changes the
    present decision by nothing measurable, and a longer horizon would only lose float32
    precision in the costs to go. In units of expected saves ``c`` from ``step``, edge ``i``
    sits at ``c = (1 + C) ** (i / NUM_BINS) - 1`` (``C`` the expected saves the plan covers):
    about ``NUM_BINS / log(1 + C)`` edges per interval now, a few intervals per bin at the far
    end. Where the horizon holds at most ``NUM_BINS`` steps, every step is an edge (the last
    ones repeat; empty bins are harmless).

    Returns:
      ``(edges, reaches_end)``: whether the last edge is ``end`` itself.
    """
    step = jnp.asarray(step, jnp.float32)
    end = jnp.maximum(jnp.asarray(end, jnp.float32), step + 1.0)
    # HORIZON_SAVES at today's density, stretched by the most the density can fall
    # (sqrt(max_weight / time_weight) <= 8 for coci's defaults): the horizon is inside the grid.
    reach = step + 8.0 * HORIZON_SAVES / jnp.maximum(density_fn(step), 1e-12)
    grid_end = jnp.minimum(end, jnp.maximum(reach, step + 1.0))
    grid = step + (grid_end - step) * jnp.linspace(0.0, 1.0, num_samples)
    dens = density_fn(grid)
    cum = jnp.concatenate([jnp.zeros(1), jnp.cumsum(0.5 * (dens[1:] + dens[:-1]) * jnp.diff(grid))])
    reaches_end = (grid_end >= end) & (cum[-1] <= HORIZON_SAVES)
    total = jnp.minimum(cum[-1], HORIZON_SAVES)
    last = jnp.where(reaches_end, end, jnp.ceil(jnp.interp(total, cum, grid)))
    last = jnp.maximum(last, step + 1.0)
    levels = jnp.expm1(jnp.log1p(total) * jnp.linspace(0.0, 1.0, NUM_BINS + 1))
    spread = jnp.interp(levels, cum, grid)
    every = jnp.minimum(step + jnp.arange(NUM_BINS + 1, dtype=jnp.float32), last)
    edges = jnp.where(last - step <= NUM_BINS, every, spread)
    edges = jnp.round(edges).at[0].set(step).at[-1].set(last)
    return jax.lax.cummax(edges), reaches_end
