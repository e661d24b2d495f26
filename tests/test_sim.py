"""The fault-injection simulator against closed forms, and the hindsight weights."""

import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cocijax as cj
from cocijax import sim
from cocijax.sim import _model, _montecarlo

DATA = Path(__file__).resolve().parent / "data" / "wrn-40-4_cifar10_loss.csv"

KW = dict(n_steps=5000, step_time_s=1.5, checkpoint_cost_s=20.0, recovery_s=90.0, mtbf_s=3000.0)


@pytest.mark.parametrize("every", [40, 150, 1000])
def test_periodic_schedule_matches_the_poisson_closed_form(every):
    steps = np.arange(every, KW["n_steps"] + 1, every)
    res = sim.simulate(steps, trials=3000, seed=7, **KW)
    exact = sim.expected_overhead_periodic(every, **KW)
    assert res.wall_overhead_s == pytest.approx(
        exact, rel=max(0.03, 4 * res.wall_overhead_se / exact)
    )
    # weights=None: every recomputed second counts 1, so both currencies agree.
    assert res.weighted_overhead_s == pytest.approx(res.wall_overhead_s)
    assert res.wall_overhead_s == pytest.approx(res.stall_s + res.recompute_s + res.recovery_s)


def test_closed_form_by_hand():
    # One segment of D = 100 s, no stall, no recovery, MTBF 1000 s: M (e^{D/M} - 1) - D.
    got = sim.expected_overhead_periodic(
        100, n_steps=100, step_time_s=1.0, checkpoint_cost_s=0.0, recovery_s=0.0, mtbf_s=1000.0
    )
    assert got == pytest.approx(1000.0 * math.expm1(0.1) - 100.0)


def test_without_failures_the_overhead_is_the_stalls():
    res = sim.simulate(
        [10, 20, 30, 30, 0, 999],
        n_steps=50,
        step_time_s=1.0,
        checkpoint_cost_s=3.0,
        recovery_s=5.0,
        mtbf_s=1e12,
        trials=20,
    )
    assert res.n_saves == 3  # duplicates and out-of-range steps dropped
    assert res.wall_overhead_s == pytest.approx(9.0)
    assert res.weighted_overhead_s == pytest.approx(9.0)
    assert res.failures == 0.0


def test_weights_scale_only_recomputation():
    steps = np.arange(100, 5001, 100)
    base = sim.simulate(steps, trials=500, seed=3, **KW)
    twice = sim.simulate(steps, trials=500, seed=3, weights=np.full(5000, 2.0), **KW)
    ones = sim.simulate(steps, trials=500, seed=3, weights=np.ones(5000), **KW)
    assert ones == base  # weights=None means all ones; same seed, same draws
    assert twice.wall_overhead_s == base.wall_overhead_s
    assert twice.weighted_overhead_s == pytest.approx(
        base.stall_s + base.recovery_s + 2.0 * base.recompute_s
    )
    # Weights on the first half only: recomputation there costs double.
    w = np.where(np.arange(5000) < 2500, 3.0, 0.0)
    half = sim.simulate(steps, trials=500, seed=3, weights=w, **KW)
    assert base.stall_s + base.recovery_s < half.weighted_overhead_s


@pytest.mark.parametrize("shape", [0.7, 1.0, 1.5])
def test_failure_count_follows_the_renewal_rate(shape):
    # Long-run renewal rate is 1 / MTBF whatever the shape: failures ~ total wall time / MTBF.
    res = sim.simulate(
        [],
        n_steps=1,
        step_time_s=1.0,
        checkpoint_cost_s=0.0,
        recovery_s=200.0,
        mtbf_s=100.0,
        weibull_shape=shape,
        trials=4000,
        seed=1,
    )
    assert res.failures > 0
    steps = np.arange(50, 20001, 50)
    res = sim.simulate(
        steps,
        n_steps=20000,
        step_time_s=1.0,
        checkpoint_cost_s=5.0,
        recovery_s=10.0,
        mtbf_s=2000.0,
        weibull_shape=shape,
        trials=400,
        seed=2,
    )
    wall = 20000.0 + res.wall_overhead_s
    assert res.failures == pytest.approx(wall / 2000.0, rel=0.08)


def test_common_random_numbers():
    a = sim.simulate([100, 200], trials=200, seed=5, **KW)
    b = sim.simulate([100, 200], trials=200, seed=5, **KW)
    c = sim.simulate([100, 200], trials=200, seed=6, **KW)
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("arg", "value"),
    [
        ("n_steps", 0),
        ("step_time_s", -1.0),
        ("mtbf_s", 0.0),
        ("checkpoint_cost_s", -1.0),
        ("recovery_s", math.nan),
        ("weibull_shape", 0.0),
        ("trials", 0),
    ],
)
def test_bad_arguments_name_the_parameter(arg, value):
    kw = dict(KW, trials=10)
    kw[arg] = value
    with pytest.raises(ValueError, match=arg):
        sim.simulate([1], **kw)


def test_weights_must_match_the_job():
    with pytest.raises(ValueError, match="weights"):
        sim.simulate([1], weights=np.ones(3), trials=2, **KW)


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.integers(-5, 600), max_size=40), seed=st.integers(0, 10))
def test_overheads_are_bounded_below_by_the_stalls(steps, seed):
    res = sim.simulate(
        steps,
        n_steps=500,
        step_time_s=2.0,
        checkpoint_cost_s=4.0,
        recovery_s=30.0,
        mtbf_s=800.0,
        trials=50,
        seed=seed,
    )
    assert res.stall_s >= 4.0 * res.n_saves - 1e-9
    assert res.wall_overhead_s >= res.stall_s
    # Each failure costs at most one full recovery (a failure inside a recovery cuts it short).
    assert res.recovery_s <= 30.0 * res.failures + 1e-6
    assert (res.recovery_s > 0) == (res.failures > 0)
    assert np.isfinite(res.wall_overhead_se)


# --- progress_weights -------------------------------------------------------------------------


def test_progress_weights_have_mean_one_and_follow_progress():
    k = np.arange(1, 4001)
    y = 1.0 + 5.0 / np.sqrt(k)
    w = sim.progress_weights(y, 0.25)
    assert w.mean() == pytest.approx(1.0)
    assert w.min() >= 0.25 - 1e-12
    assert w[50] > 5 * w[-50]  # fast progress early weighs more


def test_progress_weights_edge_cases():
    assert np.allclose(sim.progress_weights(np.full(100, 3.0), 0.25), 1.0)  # no progress
    assert np.allclose(sim.progress_weights(np.linspace(3, 1, 1000)[::-1], 0.0), 1.0)  # rising
    assert np.allclose(sim.progress_weights(np.linspace(3.0, 1.0, 999), 1.0), 1.0)
    # A straight line falls at a constant rate: v = 1 away from the first window.
    w = sim.progress_weights(np.linspace(3.0, 1.0, 2000), 0.0)
    assert np.allclose(w[20:-20], w[1000], rtol=1e-6)
    y = 1.0 + 5.0 / np.sqrt(np.arange(1, 501))
    y[[3, 100, 200]] = [np.nan, np.inf, -np.inf]
    w = sim.progress_weights(y, 0.25)
    assert np.all(np.isfinite(w)) and w.mean() == pytest.approx(1.0)
    assert np.allclose(sim.progress_weights(np.full(10, np.nan), 0.5), 1.0)
    with pytest.raises(ValueError, match="time_weight"):
        sim.progress_weights(y, 1.5)
    with pytest.raises(ValueError, match="1-D"):
        sim.progress_weights(np.ones((2, 2)), 0.5)


# --- exact expectation, optimal schedule, bounded work -------------------------------------

EXACT = dict(step_time_s=60.0, checkpoint_cost_s=30.0, recovery_s=120.0, mtbf_s=1800.0)


@pytest.mark.parametrize("seed", range(3))
def test_expected_overhead_agrees_with_the_monte_carlo(seed):
    rng = np.random.default_rng(seed)
    n = 40
    weights = rng.gamma(0.5, 2.0, size=n)
    saves = np.sort(rng.choice(np.arange(1, n), size=6, replace=False))
    exact = cj.sim.expected_overhead(saves, n_steps=n, weights=weights, **EXACT)
    mc = cj.sim.simulate(saves, n_steps=n, weights=weights, trials=100_000, seed=seed, **EXACT)
    assert abs(mc.weighted_overhead_s - exact.weighted_s) < 4 * mc.weighted_overhead_se
    assert abs(mc.wall_overhead_s - exact.wall_s) < 4 * mc.wall_overhead_se


def test_expected_overhead_of_a_periodic_schedule_is_the_closed_form():
    n, every = 1000, 37
    exact = cj.sim.expected_overhead(range(every, n + 1, every), n_steps=n, **EXACT)
    closed = cj.sim.expected_overhead_periodic(every, n_steps=n, **EXACT)
    assert exact.wall_s == pytest.approx(closed, rel=1e-9)
    assert exact.weighted_s == pytest.approx(closed, rel=1e-9)  # weights None: all 1


@pytest.mark.parametrize("seed", range(4))
def test_optimal_schedule_is_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    n = 11
    weights = rng.gamma(0.5, 2.0, size=n) if seed else np.ones(n)
    score = lambda s: cj.sim.expected_overhead(s, n_steps=n, weights=weights, **EXACT).weighted_s
    best = min(
        (list(c) for r in range(n) for c in itertools.combinations(range(1, n), r)), key=score
    )
    dp = cj.sim.optimal_schedule(weights, **EXACT)
    assert score(dp) == pytest.approx(score(best), rel=1e-9)


@pytest.mark.parametrize(("cost", "mtbf"), [(10.0, 3600.0), (30.0, 7200.0), (5.0, 300.0)])
def test_optimal_schedule_of_uniform_weights_is_the_periodic_optimum(cost, mtbf):
    n = 5000
    kw = dict(step_time_s=1.0, checkpoint_cost_s=cost, recovery_s=60.0, mtbf_s=mtbf)
    dp = cj.sim.optimal_schedule(np.ones(n), **kw)
    periodic = min(cj.sim.expected_overhead_periodic(e, n_steps=n, **kw) for e in range(10, 2000))
    # The DP may space its saves unevenly near the end; it is never worse.
    assert cj.sim.expected_overhead(dp, n_steps=n, **kw).wall_s <= periodic * (1 + 1e-9)
    assert cj.sim.expected_overhead(dp, n_steps=n, **kw).wall_s >= periodic * 0.99


def test_optimal_schedule_beats_every_policy_on_a_real_curve():
    rows = np.genfromtxt(DATA, delimiter=",", names=True)
    losses = rows["loss"]
    n = losses.size
    weights = cj.sim.progress_weights(losses, 0.25)
    kw = dict(step_time_s=144.0, checkpoint_cost_s=30.0, recovery_s=120.0, mtbf_s=7200.0)
    best = cj.sim.expected_overhead(
        cj.sim.optimal_schedule(weights, **kw), n_steps=n, weights=weights, **kw
    ).weighted_s
    for policy in (cj.policies.young(7200.0), cj.policies.coci(7200.0, 120.0, total_steps=n)):
        steps = cj.plan(losses, policy, step_time_s=144.0, checkpoint_cost_s=30.0)
        assert cj.sim.expected_overhead(steps, n_steps=n, weights=weights, **kw).weighted_s > best


def test_a_schedule_that_cannot_finish_is_reported_in_seconds_not_simulated_forever():
    """The CLI case that once spun for ever: a 5-hour job, MTBF 10 min, one save."""
    rows = np.genfromtxt(DATA, delimiter=",", names=True)
    n = rows["loss"].size
    kw = dict(n_steps=n, step_time_s=90.0, checkpoint_cost_s=20.0, recovery_s=0.0, mtbf_s=600.0)
    start = time.perf_counter()
    rarely = cj.sim.simulate([100], trials=200, **kw)
    often = cj.sim.simulate(np.arange(2, n + 1, 2), trials=200, **kw)
    assert time.perf_counter() - start < 20.0
    assert rarely.finished == 0.0 and often.finished == 1.0
    # Abandoned trials count what they had lost by then: at least the cap.
    assert rarely.wall_overhead_s >= cj.sim.MAX_OVERHEAD_FACTOR * n * 90.0
    # The exact expectation agrees that it is hopeless: over 10^9 s (decades) for 5 hours.
    assert cj.sim.expected_overhead([100], **kw).wall_s > 1e9


# A job of 100 one-second steps saving after steps 50 and 100 (1 s stalls), 5 s recoveries.
REPLAY = dict(n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0, recovery_s=5.0)


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        # (failures, stall, recomputed, recovery)
        ([], (0, 2.0, 0.0, 0.0)),
        # 19 s after the save at step 50 (which ended at 51 s) are lost.
        ([70.0], (1, 2.0, 19.0, 5.0)),
        # In the stall of step 50: that save never completed, all 50 steps are redone; the
        # half second of stall is stall.
        ([50.5], (1, 2.5, 50.0, 5.0)),
        # The second failure strikes 2 s into the recovery, which starts again.
        ([70.0, 72.0], (2, 2.0, 19.0, 7.0)),
        # The job ends at 126 s: a later failure does not count.
        ([70.0, 500.0], (1, 2.0, 19.0, 5.0)),
        # Two failures in one segment: 19 s lost, then the redone 19 s and 6 more.
        ([70.0, 100.0], (2, 2.0, 19.0 + 25.0, 10.0)),
    ],
)
def test_replay_by_hand(failures, expected):
    res = sim.replay([50, 100], failures, **REPLAY)
    assert (res.failures, res.stall_s, res.recompute_s, res.recovery_s) == pytest.approx(expected)
    assert res.wall_overhead_s == pytest.approx(sum(expected[1:]))
    assert res.n_saves == 2 and res.finished == 1.0


def test_replay_weighs_the_recomputed_steps():
    w = np.where(np.arange(100) < 60, 3.0, 0.5)  # steps 1-60 weigh 3, later ones 0.5
    res = sim.replay([50, 100], [70.0], weights=w, **REPLAY)
    # Steps 51-60 lost (10 s at weight 3) and 61-69 (9 s at 0.5): 34.5 weighted seconds.
    assert res.weighted_overhead_s == pytest.approx(2.0 + 5.0 + 30.0 + 4.5)


def test_replays_of_poisson_failures_average_to_the_exact_expectation():
    rng = np.random.default_rng(11)
    kw = dict(n_steps=300, step_time_s=1.0, checkpoint_cost_s=4.0, recovery_s=6.0)
    steps = np.arange(40, 301, 40)
    # Enough failures for any run: 40 gaps of mean 60 s cover 2400 s, ~8x the job.
    walls = [
        sim.replay(steps, np.cumsum(rng.exponential(60.0, 40)), **kw).wall_overhead_s
        for _ in range(3000)
    ]
    exact = sim.expected_overhead(steps, mtbf_s=60.0, **kw).wall_s
    se = np.std(walls) / math.sqrt(len(walls))
    assert np.mean(walls) == pytest.approx(exact, abs=4 * se)


@settings(max_examples=200, deadline=None)
@example(steps=[1, 34], gaps=[1.9375, 1.5, 40.0], weights=[0.0] * 60)
@given(
    steps=st.lists(st.integers(1, 60), max_size=8),
    # Gaps in sixteenths of a second: every time on both paths is then exact in floating point,
    # so a failure that falls exactly at the end of a stall is the same tie for both (with any
    # float, the replay's cumulative sums and the walk's own sums round differently there).
    gaps=st.lists(st.integers(2, 640).map(lambda k: k / 16), max_size=6),
    weights=st.lists(st.floats(0.0, 4.0), min_size=60, max_size=60),
)
def test_replay_with_instant_commits_is_the_simulators_walk(steps, gaps, weights):
    # The replay's event loop against the segment walk of `simulate`, fed the same gaps.
    kw = dict(n_steps=60, step_time_s=1.0, checkpoint_cost_s=1.5, recovery_s=3.0)
    got = sim.replay(steps, np.cumsum(gaps), weights=weights, **kw)
    it = iter(gaps)
    draw = lambda k: np.array([next(it, math.inf) for _ in range(k)])
    walked = _montecarlo._Trials(1, draw(1), math.inf)
    _montecarlo._walk(
        walked, _model._save_steps(steps, 60), 60, 1.0, 1.5, 3.0, np.asarray(weights), draw
    )
    assert got == pytest.approx(walked.result(got.n_saves))


@pytest.mark.parametrize(
    ("failures", "recomputed"),
    [
        # The save at step 50 stalls until 51 s and commits at 54 s: a failure at 52 s rolls
        # back to the start (50 steps and 1 s lost), one at 54 s to step 50 (3 s lost).
        ([52.0], 51.0),
        ([54.0], 3.0),
        # In the stall of step 100 (ends at 102 s, the job's end): step 50 is committed.
        ([101.5], 50.0),
        # After a rollback the save at step 50 is made again (at 108 s, committed at 111 s):
        # the second failure, at 110 s, rolls back to the start again.
        ([52.0, 110.0], 51.0 + 52.0),
    ],
)
def test_replay_rolls_back_past_a_save_that_had_not_committed(failures, recomputed):
    res = sim.replay([50, 100], failures, commit_s=3.0, **REPLAY)
    assert res.recompute_s == pytest.approx(recomputed)
    assert res.failures == len(failures)


@pytest.mark.parametrize("commit_s", [-1.0, math.nan, math.inf])
def test_replay_refuses_a_commit_time_out_of_range(commit_s):
    with pytest.raises(ValueError, match="commit_s"):
        sim.replay([50], [], commit_s=commit_s, **REPLAY)


@pytest.mark.parametrize("times", [[5.0, 3.0], [-1.0], [math.nan], [[1.0, 2.0]]])
def test_replay_refuses_failure_times_that_are_not_a_timeline(times):
    with pytest.raises(ValueError, match="failure_times_s"):
        sim.replay([50], times, **REPLAY)
