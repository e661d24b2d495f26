"""The receding-horizon planner: its costs match the simulator, its DP the exhaustive optimum."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cocijax as cj
from cocijax.policies import _horizon

TAU, COST, RECOVERY, MTBF = 60.0, 30.0, 120.0, 1800.0


def _expected_overhead(saves, weights):
    """Exact expected weighted overhead of a schedule (float64, written out segment by segment).

    A segment of steps i+1..j is repeated until it runs ``D = W + c`` seconds without a failure;
    each failed attempt, at ``x ~ Exp(lam)`` truncated to ``[0, D)``, loses the weighted work
    done (within a step, pro rata) plus the stall spent, and a recovery that restarts on
    failures: ``(e^{lam R} - 1) / lam`` in expectation.
    """
    lam = 1.0 / MTBF
    n = len(weights)
    cum = np.concatenate([[0.0], np.cumsum(weights)]) * TAU
    rec = math.expm1(lam * RECOVERY) / lam
    total, start = 0.0, 0
    for end in [*sorted(saves), n]:
        if end == start:
            continue
        c = COST if end in saves else 0.0
        work = (end - start) * TAU
        d = work + c
        # E[loss of one failed attempt] * P(fail), by numerical quadrature over the attempt.
        x = np.linspace(0.0, d, 20001)
        done = np.interp(np.minimum(x, work) / TAU + start, np.arange(n + 1), cum) - cum[start]
        loss = done + np.maximum(x - work, 0.0)
        lost = np.trapezoid(lam * np.exp(-lam * x) * loss, x)
        attempts = math.exp(lam * d)  # expected attempts until one succeeds
        total += c + attempts * lost + (attempts - 1.0) * rec
        start = end
    return total


def _per_step_plan(weights):
    n = len(weights)
    edges = jnp.minimum(jnp.arange(_horizon.NUM_BINS + 1, dtype=jnp.float32), n)
    w = jnp.concatenate([jnp.asarray(weights, jnp.float32), jnp.ones(_horizon.NUM_BINS - n)])
    costs = _horizon.costs(TAU, COST, RECOVERY, MTBF)
    plan = _horizon.Plan(edges, w, jnp.zeros_like(edges), costs)
    return _horizon.values(plan, end_without_save=True), costs


def test_segment_costs_agree_with_the_monte_carlo_simulator():
    weights = np.array([3.0, 0.2, 1.0, 5.0, 0.5, 0.5, 2.0, 0.1])
    saves = [2, 4, 7]
    exact = _expected_overhead(saves, weights)
    mc = cj.sim.simulate(
        saves, n_steps=len(weights), step_time_s=TAU, checkpoint_cost_s=COST,
        recovery_s=RECOVERY, mtbf_s=MTBF, weights=weights, trials=200_000, seed=1,
    )  # fmt: skip
    assert abs(mc.weighted_overhead_s - exact) < 4 * mc.weighted_overhead_se


@pytest.mark.parametrize("seed", range(4))
def test_dp_values_are_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    weights = rng.gamma(0.5, 2.0, size=10)  # bursty, like hindsight progress weights
    best = min(
        _expected_overhead(set(s), weights)
        for r in range(len(weights))
        for s in itertools.combinations(range(1, len(weights)), r)
    )
    plan, _ = _per_step_plan(weights)
    assert float(plan.values[0]) == pytest.approx(best, rel=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_deciding_step_by_step_reproduces_the_optimum(seed):
    """With the true weights, "save now?" at every step is Bellman's optimal policy."""
    rng = np.random.default_rng(seed)
    weights = rng.gamma(0.5, 2.0, size=40)
    plan, _ = _per_step_plan(weights)
    decide = jax.jit(
        lambda step, exposure, rollback: _horizon.decide(
            plan, step=step, exposure=exposure, rollback_value=rollback,
            end_without_save=True,
        )
    )  # fmt: skip
    saves, last, exposure = [], 0, 0.0
    for step in range(1, len(weights)):
        exposure += weights[step - 1] * TAU
        now, _ = decide(float(step), exposure, _horizon.value_at(plan, float(last)))
        if now:
            saves.append(step)
            last, exposure = step, 0.0
    assert _expected_overhead(set(saves), weights) == pytest.approx(float(plan.values[0]), rel=1e-4)


def test_value_before_a_plan_matches_the_plan_made_at_that_save():
    weights = np.random.default_rng(5).gamma(0.5, 2.0, size=30)
    plan, costs = _per_step_plan(weights)
    # Re-plan from step 4 as if the last save had been at step 0.
    later = _horizon.Plan(
        jnp.minimum(4.0 + jnp.arange(_horizon.NUM_BINS + 1, dtype=jnp.float32), 30.0),
        jnp.concatenate([jnp.asarray(weights[4:], jnp.float32), jnp.ones(_horizon.NUM_BINS - 26)]),
        jnp.zeros(_horizon.NUM_BINS + 1),
        costs,
    )
    later = _horizon.values(later, end_without_save=True)
    behind = _horizon.value_before(
        later, behind=4 * TAU, exposure=float(weights[:4].sum()) * TAU,
        end_without_save=True,
    )  # fmt: skip
    # Exact up to where in the first 4 steps their work sits (value_before spreads it evenly),
    # and for the saves that the re-plan can no longer place inside them.
    assert float(behind) == pytest.approx(float(plan.values[0]), rel=2e-2)


def test_edges_are_fine_now_and_coarse_far_ahead():
    edges, reaches_end = _horizon.edges_for(100.0, 1e6, lambda s: jnp.full_like(s, 1e-3))
    gaps = np.diff(np.asarray(edges))
    assert not bool(reaches_end)  # 1e6 steps hold 1000 saves: beyond HORIZON_SAVES
    assert gaps[0] < 0.1 / 1e-3 and gaps[-1] > 1.0 / 1e-3
    assert np.all(gaps >= 0) and float(edges[0]) == 100.0
    short, reaches = _horizon.edges_for(5.0, 20.0, lambda s: jnp.full_like(s, 1e-3))
    assert bool(reaches) and np.asarray(short)[:16].tolist() == list(range(5, 21))
