"""Fixed, Young, Daly and CheckFreq intervals equal their formulas."""

import math

import numpy as np
import pytest

import cocijax as cj


def _plan(policy, n, step_time=1.0, cost=10.0, losses=None):
    losses = np.ones(n) if losses is None else losses
    return cj.plan(losses, policy, step_time_s=step_time, checkpoint_cost_s=cost)


def test_fixed_saves_at_multiples():
    np.testing.assert_array_equal(_plan(cj.policies.fixed(7), 30), [7, 14, 21, 28])


@pytest.mark.parametrize(
    ("cost", "mtbf", "step_time"), [(10.0, 3600.0, 1.0), (8.0, 3600.0, 1.0), (30.0, 7200.0, 2.5)]
)
def test_young_interval_is_sqrt_2cm_to_the_nearest_step(cost, mtbf, step_time):
    interval = math.sqrt(2 * cost * mtbf) / step_time
    steps = _plan(cj.policies.young(mtbf), 2000, step_time, cost)
    k = round(interval)
    np.testing.assert_array_equal(steps, np.arange(k, 2001, k))
    formula = math.sqrt(2 * cost * mtbf)
    assert float(cj.policies.young_interval(cost, mtbf)) == pytest.approx(formula)


@pytest.mark.parametrize(
    ("cost", "mtbf"), [(10.0, 3600.0), (30.0, 7200.0), (600.0, 1000.0), (3000.0, 1000.0)]
)
def test_daly_interval_is_the_higher_order_formula(cost, mtbf):
    if cost < 2 * mtbf:
        x = cost / (2 * mtbf)
        ref = math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost
    else:
        ref = mtbf
    assert float(cj.policies.daly_interval(cost, mtbf)) == pytest.approx(ref, rel=1e-6)
    steps = _plan(cj.policies.daly(mtbf), 3000, 1.0, cost)
    assert steps[0] == round(ref)
    np.testing.assert_array_equal(np.diff(steps), round(ref))


def test_checkfreq_is_the_most_frequent_interval_under_the_overhead_bound():
    # C / (max_overhead * t) = 30 / (0.05 * 1) = 600 steps.
    steps = _plan(cj.policies.checkfreq(0.05), 2000, 1.0, 30.0)
    np.testing.assert_array_equal(steps, [600, 1200, 1800])
    # A non-integer ratio rounds up: 7 / (0.1 * 1.5) = 46.7 -> 47 steps (stall 9.9% <= 10%).
    steps = _plan(cj.policies.checkfreq(0.1), 200, 1.5, 7.0)
    np.testing.assert_array_equal(steps, [47, 94, 141, 188])
    # The stall never exceeds the bound.
    assert 7.0 / (47 * 1.5) <= 0.1 < 7.0 / (46 * 1.5)


def test_costs_are_smoothed_and_nan_means_not_measured():
    rng = np.random.default_rng(0)
    costs = 10.0 * (1 + 0.3 * rng.standard_normal(4000)).clip(0.2)
    steps = _plan(cj.policies.young(3600.0), 4000, 1.0, costs)
    intervals = np.diff(steps)
    # One noisy sample cannot swing the interval: all stay near sqrt(2 * 10 * 3600) = 268.
    assert np.all(np.abs(intervals - 268) < 30), intervals
    # Before a cost is measured the prior is used; afterwards the measured cost.
    costs = np.full(1000, np.nan)
    costs[400:] = 40.0  # sqrt(2 * 40 * 3600) = 537
    steps = _plan(cj.policies.young(3600.0, cost_prior_s=2.0), 1000, 1.0, costs)
    assert steps[0] == round(math.sqrt(2 * 2.0 * 3600))  # 120, from the prior
    assert np.diff(steps)[-1] == 537


def test_variable_step_times_count_as_time():
    # Young counts seconds, not steps: 2 s steps halve the interval in steps.
    steps = _plan(cj.policies.young(3600.0), 1000, 2.0, 8.0)
    np.testing.assert_array_equal(steps[:3], [120, 240, 360])
