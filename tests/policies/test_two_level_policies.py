"""The two-level policies: levels through plan and the Runner, a level-2 save counting as a
level-1 one, Young's interval per level, and coci_two_level against it in the two-level
model."""

import jax
import numpy as np
import pytest

import cocijax as cj
from cocijax.sim import Schedule

N = 3000
TAU = 5.0
SC = dict(checkpoint_cost_s=0.5, persist_cost_s=30.0)  # what plan feeds the policies
JOB = dict(n_steps=N, step_time_s=TAU, mtbf_s=7200.0, recovery_s=15.0, machine_mtbf_s=43200.0,
           machine_recovery_s=120.0, **SC)  # fmt: skip
LOSSES = 3.0 + 5.0 / np.sqrt(np.arange(1, N + 1))


def coci2(**kw):
    return cj.policies.coci_two_level(
        7200.0, 15.0, total_steps=N, machine_mtbf_s=43200.0, machine_recovery_s=120.0, **kw
    )


# Built once: plan caches its compiled scan per policy object.
COCI2 = coci2()
YOUNG2 = cj.policies.young_two_level(7200.0, 43200.0)


@pytest.mark.parametrize("policy", [COCI2, YOUNG2], ids=["coci", "young"])
def test_two_level_policies_plan_both_levels(policy):
    assert policy.levels == 2
    s = cj.plan(LOSSES, policy, step_time_s=TAU, **SC)
    assert isinstance(s, Schedule)
    assert np.all(np.diff(s.steps) > 0)
    n1, n2 = int((s.levels == 1).sum()), int((s.levels == 2).sum())
    assert n1 > 5 * n2 > 0, (n1, n2)  # C1 is 60 times cheaper and process failures 6 times likelier


def test_young_two_level_saves_at_young_s_interval_per_level():
    s = cj.plan(np.ones(N), YOUNG2, step_time_s=TAU, **SC)
    every1 = round(cj.policies.young_interval(0.5, 7200.0) / TAU)  # 17 steps
    every2 = round(cj.policies.young_interval(30.0, 43200.0) / TAU)  # 322 steps
    gaps = np.diff(np.concatenate([[0], s.steps]))
    # Level-1 saves every 17 steps since the last save of either level.
    np.testing.assert_array_equal(gaps[s.levels == 1], every1)
    np.testing.assert_array_equal(np.diff(s.steps[s.levels == 2]), every2)
    assert (every1, every2) == (17, 322)


def test_young_two_level_persists_on_time_when_steps_are_longer_than_its_interval():
    # 248 s steps, a save at each (the level-1 interval is 85 s): a level-2 save every 6
    # steps (1488 s against sqrt(2 C2 M2) = 1610 s).
    s = cj.plan(np.ones(200), YOUNG2, step_time_s=248.0, **SC)
    np.testing.assert_array_equal(s.steps, np.arange(1, 201))
    np.testing.assert_array_equal(np.diff(s.steps[s.levels == 2]), 6)


@pytest.mark.parametrize("policy", [COCI2, YOUNG2], ids=["coci", "young"])
def test_a_level_2_save_counts_as_a_level_1_save(policy):
    """After a level-2 save the level-1 policy waits a full interval again, not saving at once
    where its own clock (ignorant of the level-2 save) said it was due."""
    s = cj.plan(LOSSES, policy, step_time_s=TAU, **SC)
    gaps = np.diff(s.steps)  # gaps[i]: from save i to save i + 1
    checked = 0
    for i in np.flatnonzero(s.levels[:-1] == 2):
        # The level-1 gaps around it, but not those into and out of the level-2 save.
        around = [gaps[j] for j in (i - 3, i - 2, i + 1, i + 2) if 0 <= j < gaps.size]
        assert gaps[i] >= 0.6 * np.median(around), (i, gaps[i - 3 : i + 3])
        checked += 1
    assert checked >= 4


def test_the_runner_decides_the_levels_plan_does():
    # Young's: compiling coci_two_level's batched update takes longer than all the rest.
    s = cj.plan(LOSSES[:800], YOUNG2, step_time_s=TAU, **SC)
    runner = cj.policies.Runner(YOUNG2)
    got = {}
    for step in range(1, 801):
        level = runner.decide(step, loss=jax.numpy.float32(LOSSES[step - 1]), step_time_s=TAU, **SC)
        if level:
            got[step] = level
    assert got == dict(zip(s.steps.tolist(), s.levels.tolist(), strict=True))
    assert set(got.values()) == {1, 2}


def test_coci_two_level_beats_the_classic_rule_on_a_converging_job():
    w = cj.sim.progress_weights(LOSSES, 0.25)
    score = lambda policy: (
        cj.sim.expected_overhead(
            cj.plan(LOSSES, policy, step_time_s=TAU, **SC), weights=w, **JOB
        ).weighted_s
    )
    bound = cj.sim.expected_overhead(
        cj.sim.optimal_schedule(w, **{k: v for k, v in JOB.items() if k != "n_steps"}),
        weights=w, **JOB,
    ).weighted_s  # fmt: skip
    coci, classic = score(COCI2), score(YOUNG2)
    assert bound <= coci < classic
    assert (classic - coci) / (classic - bound) > 0.8  # measured: 0.95


def test_the_caller_s_machine_mtbf_is_used_when_none_is_built_in():
    policy = cj.policies.young_two_level(7200.0)  # machine MTBF from the caller
    rare = cj.plan(np.ones(N), policy, step_time_s=TAU, machine_mtbf_s=10 * 43200.0, **SC)
    often = cj.plan(np.ones(N), policy, step_time_s=TAU, machine_mtbf_s=43200.0 / 10, **SC)
    assert (rare.levels == 2).sum() < (often.levels == 2).sum()


def test_two_level_policies_are_found_by_name():
    assert cj.policies.names(levels=2) == ("young_two_level", "coci_two_level")
    assert set(cj.policies.names()) == set(cj.policies.names(levels=1)) | {
        "young_two_level",
        "coci_two_level",
    }
    policy = cj.policies.by_name("coci-two-level", mtbf_s=3600.0, machine_mtbf_s=7200.0)
    assert policy.levels == 2
    with pytest.raises(ValueError, match="levels: expected 1, 2 or None"):
        cj.policies.names(levels=3)
    with pytest.raises(ValueError, match="prior_machine_mtbf_s"):
        cj.policies.young_two_level(prior_machine_mtbf_s=-1.0)
    with pytest.raises(ValueError, match="time_weight"):
        coci2(time_weight=2.0)
