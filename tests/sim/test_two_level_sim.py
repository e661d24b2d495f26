"""The two-level model of cj.sim: Monte Carlo against the exact expectation, the exact optimum
against brute force and against the one-level optimum when one class of failures is absent."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cocijax import sim
from cocijax.sim import Schedule

TWO = dict(
    step_time_s=2.0, checkpoint_cost_s=1.0, recovery_s=15.0, mtbf_s=1500.0,
    persist_cost_s=30.0, machine_mtbf_s=6000.0, machine_recovery_s=120.0,
)  # fmt: skip
STEPS = np.arange(20, 2001, 20)
MIXED = Schedule(STEPS, np.where(STEPS % 200 == 0, 2, 1))


def weights(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    losses = 3.0 + 5.0 / np.sqrt(np.arange(1, n + 1)) + 0.01 * rng.standard_normal(n)
    return sim.progress_weights(losses, 0.25)


@pytest.mark.parametrize(
    "job",
    [
        TWO,
        # Recoveries long against the MTBFs: failures during recoveries, level-1 recoveries that
        # a machine failure turns into level-2 ones, machine failures rolling back far.
        {**TWO, "mtbf_s": 300.0, "machine_mtbf_s": 700.0, "recovery_s": 90.0,
         "machine_recovery_s": 200.0},
    ],
)  # fmt: skip
def test_monte_carlo_matches_the_exact_two_level_expectation(job):
    w = weights(2000)
    exact = sim.expected_overhead(MIXED, n_steps=2000, weights=w, **job)
    mc = sim.simulate(MIXED, n_steps=2000, weights=w, trials=3000, seed=1, **job)
    assert mc.finished == 1.0
    assert mc.wall_overhead_s == pytest.approx(exact.wall_s, abs=4 * mc.wall_overhead_se)
    assert mc.weighted_overhead_s == pytest.approx(
        exact.weighted_s, abs=4 * mc.weighted_overhead_se
    )
    assert mc.wall_overhead_s == pytest.approx(mc.stall_s + mc.recompute_s + mc.recovery_s)
    assert mc.n_saves == STEPS.size


def test_without_failures_the_overhead_is_the_stalls():
    job = {**TWO, "mtbf_s": math.inf, "machine_mtbf_s": math.inf}
    e = sim.expected_overhead(MIXED, n_steps=2000, **job)
    stalls = 90 * 1.0 + 10 * 30.0 - 30.0  # the last save, at the end of the job, included
    assert e.wall_s == pytest.approx(stalls + 30.0)
    assert sim.simulate(MIXED, n_steps=2000, trials=5, **job).wall_overhead_s == e.wall_s


@pytest.mark.parametrize("absent", ["machine", "process"])
def test_one_class_of_failures_reduces_to_the_one_level_model(absent):
    w = weights(2000)
    if absent == "machine":  # level-1 saves only, as one-level saves of cost C1
        job, schedule = {**TWO, "machine_mtbf_s": math.inf}, Schedule(STEPS, np.ones_like(STEPS))
        one = dict(checkpoint_cost_s=1.0, recovery_s=15.0, mtbf_s=1500.0)
    else:  # plain steps are level-2 saves: one-level saves of cost C2 against machine failures
        job, schedule = {**TWO, "mtbf_s": math.inf}, STEPS
        one = dict(checkpoint_cost_s=30.0, recovery_s=120.0, mtbf_s=6000.0)
    two = sim.expected_overhead(schedule, n_steps=2000, weights=w, **job)
    ref = sim.expected_overhead(STEPS, n_steps=2000, weights=w, step_time_s=2.0, **one)
    assert two.wall_s == pytest.approx(ref.wall_s, rel=1e-9)
    assert two.weighted_s == pytest.approx(ref.weighted_s, rel=1e-9)


def brute_force(w, job) -> float:
    """The least expected weighted overhead over every two-level schedule of ``w``'s steps."""
    n = w.size
    best = math.inf
    for levels in itertools.product((0, 1, 2), repeat=n):
        steps = np.array([i + 1 for i in range(n) if levels[i]], np.int64)
        chosen = Schedule(steps, np.array([v for v in levels if v], np.int64))
        best = min(best, sim.expected_overhead(chosen, n_steps=n, weights=w, **job).weighted_s)
    return best


@settings(max_examples=25, deadline=None)
@given(
    w=st.lists(st.floats(0.05, 5.0), min_size=1, max_size=6),
    tau=st.floats(1.0, 60.0),
    c1=st.floats(0.0, 20.0),
    c2=st.floats(0.0, 80.0),
    r1=st.floats(0.0, 60.0),
    r2=st.floats(0.0, 200.0),
    m1=st.floats(20.0, 500.0),
    m2=st.floats(20.0, 1000.0),
)
def test_the_two_level_optimum_is_the_brute_force_optimum(w, tau, c1, c2, r1, r2, m1, m2):
    w = np.asarray(w)
    job = dict(step_time_s=tau, checkpoint_cost_s=c1, recovery_s=r1, mtbf_s=m1,
               persist_cost_s=c2, machine_mtbf_s=m2, machine_recovery_s=r2)  # fmt: skip
    found = sim.optimal_schedule(w, **job)
    assert isinstance(found, Schedule)
    got = sim.expected_overhead(found, n_steps=w.size, weights=w, **job).weighted_s
    assert got == pytest.approx(brute_force(w, job), rel=1e-9)


@pytest.mark.parametrize("absent", ["machine", "process"])
def test_the_two_level_optimum_matches_the_one_level_one_with_one_class_absent(absent):
    n = 600
    w = weights(n)
    job = {**TWO, "mtbf_s": 600.0, "machine_mtbf_s": 1200.0}
    if absent == "machine":
        job["machine_mtbf_s"] = math.inf
        one = dict(checkpoint_cost_s=1.0, recovery_s=15.0, mtbf_s=600.0)
    else:
        job["mtbf_s"] = math.inf
        one = dict(checkpoint_cost_s=30.0, recovery_s=120.0, mtbf_s=1200.0)
    two = sim.optimal_schedule(w, **job)
    ref = sim.optimal_schedule(w, step_time_s=2.0, **one)
    got = sim.expected_overhead(two, n_steps=n, weights=w, **job).weighted_s
    want = sim.expected_overhead(ref, n_steps=n, weights=w, step_time_s=2.0, **one).weighted_s
    assert got == pytest.approx(want, rel=1e-9)
    assert set(two.levels.tolist()) == {1 if absent == "machine" else 2}


def test_the_two_level_optimum_beats_the_best_one_level_schedule():
    n = 2000
    w = weights(n)
    both = sim.optimal_schedule(w, **TWO)
    only2 = sim.optimal_schedule(
        w, step_time_s=2.0, checkpoint_cost_s=30.0, recovery_s=120.0, mtbf_s=1200.0
    )  # every save level 2, against both classes (rates 1/1500 + 1/6000)
    score = lambda s: sim.expected_overhead(s, n_steps=n, weights=w, **TWO).weighted_s
    assert score(both) < 0.8 * score(only2)
    assert {1, 2} <= set(both.levels.tolist())


def test_two_level_arguments_are_checked():
    with pytest.raises(ValueError, match="machine_recovery_s"):
        sim.expected_overhead(STEPS, n_steps=2000, **{**TWO, "machine_recovery_s": None})
    with pytest.raises(ValueError, match="persist_cost_s"):
        sim.simulate(STEPS, n_steps=2000, **{**TWO, "persist_cost_s": -1.0})
    with pytest.raises(ValueError, match="machine_mtbf_s"):
        sim.optimal_schedule(np.ones(10), **{**TWO, "machine_mtbf_s": 0.0})
    with pytest.raises(ValueError, match="one-level"):
        sim.expected_overhead(
            MIXED, n_steps=2000, step_time_s=2.0, checkpoint_cost_s=1.0, recovery_s=1.0,
            mtbf_s=100.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"levels must be 1 or 2, got \[1, 3\]"):
        sim.expected_overhead(Schedule([5, 10], [1, 3]), n_steps=20, **TWO)
    with pytest.raises(ValueError, match="one level per step"):
        sim.simulate(Schedule([5, 10], [1]), n_steps=20, **TWO)


def test_a_step_given_twice_counts_at_its_highest_level():
    once = sim.expected_overhead(Schedule([100, 200], [2, 1]), n_steps=300, **TWO)
    twice = sim.expected_overhead(Schedule([200, 100, 100, 999], [1, 1, 2, 2]), n_steps=300, **TWO)
    assert once == twice
