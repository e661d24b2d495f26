"""Tests of cocijax.SaveDecisionPolicy, alone and inside a plain ocp.CheckpointManager."""

from __future__ import annotations

import datetime
import json
import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from manager_helpers import FakeClock, recording  # pytest puts tests/ on sys.path

import cocijax as cj

CONTEXT = SimpleNamespace(is_saving_in_progress=False, reached_preemption=False)


def info(step, metrics=None):
    return SimpleNamespace(step=step, metrics=metrics, time=datetime.datetime.now())


def test_drives_a_plain_orbax_manager(tmp_path):
    sdp = cj.SaveDecisionPolicy(cj.policies.fixed(3))
    assert isinstance(sdp, ocp.checkpoint_managers.SaveDecisionPolicy)
    options = ocp.CheckpointManagerOptions(save_decision_policy=sdp)
    with ocp.CheckpointManager(tmp_path / "ck", options=options) as mngr:
        saved = []
        for step in range(1, 10):
            sdp.observe(jnp.float32(1.0 / step))
            if mngr.save(step, args=ocp.args.StandardSave({"x": np.full(3, step)})):
                saved.append(step)
        mngr.wait_until_finished()
        assert saved == [3, 6, 9]
        assert list(mngr.all_steps()) == [3, 6, 9]


def test_a_plain_orbax_manager_saves_the_last_step_of_a_known_length_job(tmp_path):
    coci = cj.policies.coci(mtbf_s=1e8, recovery_s=0.0, total_steps=12, cost_prior_s=1.0)
    sdp = cj.SaveDecisionPolicy(coci)
    options = ocp.CheckpointManagerOptions(save_decision_policy=sdp)
    with ocp.CheckpointManager(tmp_path / "ck", options=options) as mngr:
        for step in range(1, 13):
            sdp.observe(1.0 / step)
            mngr.save(step, args=ocp.args.StandardSave({"x": np.full(3, step)}))
        mngr.wait_until_finished()
        # An MTBF of years: only the final model, and step 2, the early save that measured
        # the cost (steps 1 and 2 are not timed with a save in them).
        assert list(mngr.all_steps()) == [2, 12]


def test_measures_times_and_splits_off_the_save_cost():
    clock = FakeClock()
    sdp = cj.SaveDecisionPolicy(recording(2), clock=clock)
    for step, (dt, loss) in enumerate([(1.0, 4.0), (1.0, 3.0), (3.5, 2.0), (1.0, 1.0)], start=1):
        clock.advance(dt)
        sdp.observe(loss)
        sdp.should_save(info(step), [], context=CONTEXT)
        if step == 2:
            seen = sdp.state
            # One step time is measured (1 s), not given until a second confirms it.
            assert math.isnan(seen.step_time) and math.isnan(seen.cost)
            assert float(seen.loss) == 4.0  # step 1's loss, read one step late
    seen = sdp.state
    # Step 2 saved; the interval before step 3 (3.5 s) holds a 1 s step and a 2.5 s save.
    assert float(seen.cost) == 2.5
    assert float(seen.step_time) == 1.0
    assert float(seen.loss) == 2.0
    assert int(seen.calls) == 4


def test_reads_loss_from_metrics_and_answers_repeats_once():
    clock = FakeClock(tick=1.0)
    sdp = cj.SaveDecisionPolicy(recording(2), metric="train_loss", clock=clock)
    assert sdp.should_save(info(1, {"train_loss": 0.75}), [], context=CONTEXT) is False
    assert float(sdp.state.loss) == 0.75
    assert sdp.should_save(info(2, {"train_loss": 0.5}), [], context=CONTEXT) is True
    # Orbax may ask again for the same step: same answer, the policy is not fed twice.
    assert sdp.should_save(info(2, {"train_loss": 0.5}), [], context=CONTEXT) is True
    assert int(sdp.state.calls) == 2
    with pytest.raises(ValueError, match="step: 1"):
        sdp.should_save(info(1), [], context=CONTEXT)


def test_bad_arguments():
    with pytest.raises(TypeError, match="policy"):
        cj.SaveDecisionPolicy(lambda: None)
    with pytest.raises(TypeError, match="metric"):
        cj.SaveDecisionPolicy(cj.policies.fixed(1), metric=3)
    sdp = cj.SaveDecisionPolicy(cj.policies.fixed(1))
    with pytest.raises(ValueError, match="loss"):
        sdp.observe(np.ones((2, 2)))


def test_state_json_continues_the_schedule():
    def policy():
        return cj.policies.coci(mtbf_s=30.0, min_points=8)

    losses = 0.2 + 3.0 * np.exp(-np.arange(40) / 10.0)

    def run(steps, state=None):
        clock = FakeClock()
        sdp = cj.SaveDecisionPolicy(policy(), clock=clock)
        if state is not None:
            sdp.load_state_json(json.loads(json.dumps(state)))  # survives a JSON round trip
        decisions, saved = [], False
        for step in steps:
            clock.advance(3.0 if saved else 1.0)  # 1 s steps; a save blocks for 2 s more
            sdp.observe(float(losses[step - 1]))
            saved = sdp.should_save(info(step), [], context=CONTEXT)
            decisions.append(saved)
        return decisions, sdp.state_json()

    whole, _ = run(range(1, 41))
    assert 2 <= sum(whole) < 20, whole  # a real schedule
    # Cut after a step that did not save, once a save has been timed.
    first_save = whole.index(True) + 1
    cut = next(s for s in range(first_save + 2, 40) if not whole[s - 1])
    head, state = run(range(1, cut + 1))
    tail, _ = run(range(cut + 1, 41), state)
    assert head + tail == whole


def test_a_first_save_decision_does_not_leave_it_without_a_step_time():
    """Found by a user: a policy whose first decision is "save" saved every step for ever
    (40 of 40, step time and cost unknown throughout). The interval after a save now stands
    for the step time until a clean one is measured. (CheckFreq saves at the untimed first
    step: at the 1 s step-time prior, one step covers its stall budget; ``coci`` did too
    while it assumed a 60 s recovery at this 10 s MTBF.)"""
    clock = FakeClock()
    policy = cj.policies.checkfreq(0.05, cost_prior_s=0.05)
    sdp = cj.SaveDecisionPolicy(policy, clock=clock)
    saves = []
    for step in range(1, 41):
        clock.advance(0.002)  # the training step
        if sdp.should_save(info(step), [], context=CONTEXT):
            saves.append(step)
            clock.advance(0.02)  # the save Orbax makes after a "yes"
    measured = json.loads(sdp.state_json())
    assert measured["step_time_s"] == pytest.approx(0.002, rel=1e-6)
    # Until a step time is given (from the second measured, step 3's), CheckFreq checks at
    # every step and saves (step 2 too). The intervals after those saves are all the step
    # time there is (upper bounds); the first clean one (step 4's) replaces them, and the
    # early save after it measures the cost: 20 ms, split off a 2 ms step. The 5% stall
    # budget is then 200 steps: no save is due within 40 steps.
    assert measured["cost_s"] == pytest.approx(0.02, rel=1e-6)
    assert saves == [1, 2, 4], saves


def test_the_readme_example_saves_early_and_measures_the_cost(tmp_path):
    """The first hour: SaveDecisionPolicy as in the README saved nothing in 300 steps."""
    clock = FakeClock()
    sdp = cj.SaveDecisionPolicy(cj.policies.coci(mtbf_s=4 * 3600.0), clock=clock)
    options = ocp.CheckpointManagerOptions(save_decision_policy=sdp)
    with ocp.CheckpointManager(tmp_path / "ck", options=options) as mngr:
        for step in range(1, 301):
            clock.advance(0.1)  # the training step
            sdp.observe(1.0 / step)
            if mngr.save(step, args=ocp.args.StandardSave({"x": np.full(3, step)})):
                clock.advance(0.05)  # the save
        mngr.wait_until_finished()
        assert min(mngr.all_steps()) == 2
    assert json.loads(sdp.state_json())["cost_s"] == pytest.approx(0.05)
