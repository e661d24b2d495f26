"""``coci_paper`` follows the COCI artifact's plan: equal decrements of the fitted loss."""

import math

import numpy as np
import pytest

import cocijax as cj
from cocijax.policies import _convergence, _paper


def test_exp_fit_recovers_the_artifact_model():
    t = np.linspace(0.1, 50.0, 400)  # minutes
    y = np.exp(-0.04 * t + 1.2)
    th1, th2 = _paper.fit_exp(_convergence.history_of(t, y))
    assert float(th1) == pytest.approx(-0.04, rel=0.05)
    assert float(th2) == pytest.approx(1.2, abs=0.05)


def test_saves_where_the_fitted_loss_has_fallen_by_pc():
    # Loss exp(theta1 t + theta2) with t in minutes; 6 s steps, cost 0.5 min, MTBF 100 min.
    theta1, theta2, step_s, cost_s, mtbf_s = -0.02, 1.0, 6.0, 30.0, 6000.0
    n = 3000
    t_min = np.arange(1, n + 1) * step_s / 60.0
    losses = np.exp(theta1 * t_min + theta2)
    policy = cj.policies.coci_paper(mtbf_s, profile_steps=50)
    steps = cj.plan(losses, policy, step_time_s=step_s, checkpoint_cost_s=cost_s)
    # The artifact's formulas (COCIIterator._COCI_strategy), in minutes.
    lam, ts = 60.0 / mtbf_s, cost_s / 60.0
    pc = (1 - math.exp(theta1 * ts)) * (1 / (2 * lam) - 1 / (2 * theta1))
    now = math.exp(theta1 * t_min[49] + theta2)
    levels = now - pc * np.arange(1, math.floor(now / pc) + 1)
    slots = (np.log(levels) - theta2) / theta1  # minutes
    expected = np.ceil(slots * 60.0 / step_s - 1e-9).astype(int)
    expected = expected[expected <= n]
    assert steps[0] == _paper.PROFILE_SAVE_STEP  # the artifact's profiling save
    got = steps[1:]
    assert got.size == expected.size
    # The grid fit is close to, not exactly, the artifact's least squares: allow 2 % of a slot.
    assert np.all(np.abs(got - expected) <= np.maximum(2, 0.02 * expected))


def test_falls_back_to_young_when_the_loss_does_not_fall():
    losses = np.full(2000, 2.0)
    steps = cj.plan(losses, cj.policies.coci_paper(3600.0), step_time_s=1.0, checkpoint_cost_s=10.0)
    young = round(math.sqrt(2 * 10.0 * 3600.0))
    assert steps[0] == _paper.PROFILE_SAVE_STEP
    np.testing.assert_array_equal(np.diff(steps[1:]), young)
