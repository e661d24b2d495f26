"""``coci``: reduces to Young, protects fast progress, respects its clamps and the job end."""

import math
from pathlib import Path

import numpy as np
import pytest

import cocijax as cj

DATA = Path(__file__).resolve().parents[1] / "data" / "wrn-40-4_cifar10_loss.csv"


def _curve(n, seed=0):
    rng = np.random.default_rng(seed)
    k = np.arange(1, n + 1)
    return 2.0 + 6.0 / np.sqrt(k) + 0.02 * rng.standard_normal(n)


@pytest.mark.parametrize(("cost", "mtbf"), [(10.0, 3600.0), (30.0, 7200.0)])
def test_time_weight_one_is_young_within_one_step(cost, mtbf):
    losses = _curve(6000)
    young = cj.plan(losses, cj.policies.young(mtbf), step_time_s=1.0, checkpoint_cost_s=cost)
    coci = cj.plan(
        losses, cj.policies.coci(mtbf, time_weight=1.0), step_time_s=1.0, checkpoint_cost_s=cost
    )
    assert coci.size == young.size
    assert np.max(np.abs(coci - young)) <= 1


def test_fast_progress_is_protected_and_slow_progress_saves_less():
    n, cost, mtbf = 20000, 10.0, 3600.0
    losses = _curve(n)
    young_s = math.sqrt(2 * cost * mtbf)  # 268 steps of 1 s
    steps = cj.plan(
        losses, cj.policies.coci(mtbf, total_steps=n), step_time_s=1.0, checkpoint_cost_s=cost
    )
    gaps = np.diff(np.concatenate([[0], steps]))
    assert gaps[0] < young_s / 2  # the steep start is saved early
    assert np.median(gaps[len(gaps) // 2 :]) > 1.3 * young_s  # the flat tail less often
    # Density clamps: w in [1/4, 16] -> interval in [Young / 4, 2 Young] (to the step).
    assert gaps.min() >= young_s / 4 - 1
    assert gaps.max() <= 2 * young_s + 1


def test_no_save_where_the_job_ends_too_soon_to_pay_it_back():
    n = 3000
    losses = _curve(n)
    steps = cj.plan(
        losses, cj.policies.coci(3600.0, total_steps=n), step_time_s=1.0, checkpoint_cost_s=10.0
    )
    # With 1 s steps a save at step s protects at most 2 Young intervals (536 s) of work against
    # a failure in the n - s seconds left: worth its 10 s only if (1 - e^{-(n-s)/M}) 536 >= 10.
    last_ok = n - math.ceil(-3600.0 * math.log(1 - 10.0 / 536.0))
    assert steps[-1] <= last_ok
    assert n not in steps


def test_without_total_steps_the_forecast_stands_alone():
    losses = _curve(8000)
    steps = cj.plan(losses, cj.policies.coci(3600.0), step_time_s=1.0, checkpoint_cost_s=10.0)
    gaps = np.diff(np.concatenate([[0], steps]))
    # The job length is guessed from the forecast (see CONVERGED_FRACTION): the start is still
    # saved sooner than the flat tail, within the clamps [Young / 4, 2 Young].
    assert gaps[0] < 0.8 * gaps[-5:].mean()
    assert gaps[-5:].mean() > 268
    assert gaps.min() >= 67 - 1 and gaps.max() <= 2 * 268 + 1


def test_real_curve_and_hindsight_weights_agree_on_where_to_save():
    """On a real curve (WRN on CIFAR-10, step decay), coci saves more where progress is fast."""
    rows = np.genfromtxt(DATA, delimiter=",", names=True)
    losses = rows["loss"]
    n = losses.size
    tau, cost, mtbf = 8 * 3600.0 / n, 30.0, 7200.0
    steps = cj.plan(
        losses,
        cj.policies.coci(mtbf, 120.0, 0.25, total_steps=n),
        step_time_s=tau,
        checkpoint_cost_s=cost,
    )
    w = cj.sim.progress_weights(losses, 0.25)
    fast = w > 1.0
    # Saves per step where hindsight progress is fast vs slow.
    rate_fast = np.isin(np.flatnonzero(fast) + 1, steps).mean()
    rate_slow = np.isin(np.flatnonzero(~fast) + 1, steps).mean()
    assert rate_fast > 1.5 * rate_slow
    kw = dict(
        n_steps=n,
        step_time_s=tau,
        checkpoint_cost_s=cost,
        recovery_s=120.0,
        mtbf_s=mtbf,
        weights=w,
        trials=400,
        seed=3,
    )
    young = cj.plan(losses, cj.policies.young(mtbf), step_time_s=tau, checkpoint_cost_s=cost)
    ours, theirs = cj.sim.simulate(steps, **kw), cj.sim.simulate(young, **kw)
    assert ours.weighted_overhead_s < theirs.weighted_overhead_s
    assert ours.wall_overhead_s < 1.4 * theirs.wall_overhead_s
