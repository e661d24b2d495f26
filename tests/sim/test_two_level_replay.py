"""cj.sim.replay of a two-level job: recorded failures of two classes, each rolling the job back
to its own level, checked by hand, against the one-level replay, and on average against the
exact two-level expectation."""

import math

import numpy as np
import pytest

from cocijax import sim
from cocijax.sim import Schedule

# 100 steps of 1 s; level-1 saves stall 1 s, level-2 ones 2 s; recoveries 5 s and 8 s.
JOB = dict(n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0, recovery_s=5.0)
TWO = dict(persist_cost_s=2.0, machine_recovery_s=8.0)
# Level 2 at step 30 (ends at 32 s), level 1 at step 60 (ends at 63 s), level 2 at 100.
SCHEDULE = Schedule([30, 60, 100], [2, 1, 2])


@pytest.mark.parametrize(
    ("failures", "machine", "expected"),
    [
        # (failures, stall, recomputed, recovery)
        ([], [], (0, 5.0, 0.0, 0.0)),
        # A process failure at 70 s (step 67): back to the level-1 save at step 60.
        ([70.0], [False], (1, 5.0, 7.0, 5.0)),
        # A machine failure at 70 s: the level-1 save is lost with the machine, back to step 30.
        ([70.0], [True], (1, 5.0 + 1.0, 37.0, 8.0)),
        # A machine failure 2 s into the process failure's recovery: a machine recovery from
        # then on, and the job goes back to step 30.
        ([70.0, 72.0], [False, True], (2, 5.0 + 1.0, 37.0, 2.0 + 8.0)),
        # A process failure during a machine recovery restarts it, still a machine one.
        ([70.0, 72.0], [True, False], (2, 5.0 + 1.0, 37.0, 2.0 + 8.0)),
    ],
)
def test_two_level_replay_by_hand(failures, machine, expected):
    res = sim.replay(SCHEDULE, failures, machine_failures=machine, **JOB, **TWO)
    assert (res.failures, res.stall_s, res.recompute_s, res.recovery_s) == pytest.approx(expected)
    assert res.n_saves == 3


def test_a_machine_failure_before_the_durable_commit_rolls_back_to_the_level_2_save_before():
    steps = Schedule([30, 60, 100], [2, 2, 2])  # level-2 saves end at 32, 64 and 106 s
    kw = dict(machine_failures=[True], persist_commit_s=10.0, **JOB, **TWO)
    # At 70 s the save of step 60 has committed locally but not on the durable tier (74 s).
    assert sim.replay(steps, [70.0], **kw).recompute_s == pytest.approx(66.0 - 30.0)
    assert sim.replay(steps, [75.0], **kw).recompute_s == pytest.approx(71.0 - 60.0)
    # A process failure needs the local commit only.
    kw["machine_failures"] = [False]
    assert sim.replay(steps, [70.0], **kw).recompute_s == pytest.approx(66.0 - 60.0)


@pytest.mark.parametrize("failures", [[], [45.0], [45.0, 47.0, 90.0], [31.5, 70.0]])
def test_all_level_2_with_process_failures_is_the_one_level_replay(failures):
    one = sim.replay([30, 60, 100], failures, commit_s=2.0, **JOB)
    two = sim.replay(
        [30, 60, 100], failures, commit_s=2.0, machine_failures=[False] * len(failures),
        persist_cost_s=JOB["checkpoint_cost_s"], machine_recovery_s=99.0, **JOB,
    )  # fmt: skip
    assert two == pytest.approx(one)


def test_replays_of_two_classes_of_poisson_failures_average_to_the_exact_expectation():
    rng = np.random.default_rng(5)
    kw = dict(n_steps=300, step_time_s=1.0, checkpoint_cost_s=1.0, recovery_s=6.0)
    two = dict(persist_cost_s=4.0, machine_recovery_s=15.0)
    steps = np.arange(20, 301, 20)
    schedule = Schedule(steps, np.where(steps % 80 == 0, 2, 1))
    m1, m2 = 80.0, 200.0
    walls = []
    for _ in range(3000):
        # Two Poisson processes merged: each failure's class is machine with odds m1 / m2.
        times = np.cumsum(rng.exponential(1.0 / (1 / m1 + 1 / m2), 60))
        machine = rng.random(60) < m1 / (m1 + m2)
        res = sim.replay(schedule, times, machine_failures=machine, **kw, **two)
        walls.append(res.wall_overhead_s)
    exact = sim.expected_overhead(schedule, mtbf_s=m1, machine_mtbf_s=m2, **kw, **two).wall_s
    se = np.std(walls) / math.sqrt(len(walls))
    assert np.mean(walls) == pytest.approx(exact, abs=4 * se)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(machine_failures=[True]), "persist_cost_s"),
        (dict(machine_failures=[True], persist_cost_s=1.0), "machine_recovery_s"),
        (dict(machine_failures=[True, False], **TWO), "one bool per failure"),
        (dict(machine_failures=[1], **TWO), "one bool per failure"),
        (dict(persist_commit_s=-1.0, **TWO), "persist_commit_s"),
    ],
)
def test_two_level_replay_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sim.replay(SCHEDULE, [70.0], **JOB, **kwargs)
