"""``cj.plan``: inputs, outputs and errors."""

import numpy as np
import pytest

import cocijax as cj

FIXED = cj.policies.fixed(3)


def test_plan_returns_one_based_save_steps():
    out = cj.plan(np.ones(10), FIXED, step_time_s=1.0, checkpoint_cost_s=1.0)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, [3, 6, 9])
    assert cj.plan(np.ones(0), FIXED, step_time_s=1.0, checkpoint_cost_s=1.0).size == 0


def test_plan_takes_per_step_times_and_costs():
    young = cj.policies.young(100.0)  # sqrt(2 * 2 * 100) = 20 s
    times = np.concatenate([np.full(50, 1.0), np.full(50, 4.0)])
    out = cj.plan(np.ones(100), young, step_time_s=times, checkpoint_cost_s=np.full(100, 2.0))
    assert out[0] == 20
    assert np.diff(out)[-1] == 5  # 5 steps of 4 s


def test_plan_rejects_bad_shapes():
    with pytest.raises(ValueError, match="losses"):
        cj.plan(np.ones((3, 3)), FIXED, step_time_s=1.0, checkpoint_cost_s=1.0)
    with pytest.raises(ValueError, match="step_time_s"):
        cj.plan(np.ones(10), FIXED, step_time_s=np.ones(9), checkpoint_cost_s=1.0)
    with pytest.raises(ValueError, match="checkpoint_cost_s"):
        cj.plan(np.ones(10), FIXED, step_time_s=1.0, checkpoint_cost_s=np.ones(11))
