"""Tests of cocijax.torch: DCP round trips, policy parity with JAX, retention, bad input."""

import copy
import json
import math
import random
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from torch_helpers import ManualClock, SlowStaging, replay

import cocijax as cj
import cocijax.torch as cjt
from cocijax.core._policy_inputs import PRIOR_FIXED_S, PRIOR_WRITE_RATE_BPS, prior_cost_s
from cocijax.manager import DirectoryLockedError
from cocijax.torch._state import tree_nbytes as _nbytes

# cocijax.torch silences this DCP warning at import; pytest resets filters for each test.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")


def _make(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.25), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt) -> float:
    # Draws from all three RNGs, so a wrong RNG restore changes the losses.
    x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
    loss = (model(x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _assert_same_state(a, b):
    (ma, oa), (mb, ob) = a, b
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for name, v in oa["state"][i].items():
            assert torch.equal(v, ob["state"][i][name]), (i, name)


def test_round_trip_and_training_after_restore_match_uninterrupted(tmp_path):
    model, opt = _make(0)
    np.random.seed(0)
    random.seed(0)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(3)) as mngr:
        for step in range(1, 7):
            _train_step(model, opt)
            mngr.save(step, {"model": model, "optimizer": opt, "extra": {"n": step}}, loss=0.5)
            if step == 6:
                at_save = _snapshot(model, opt)
                rng_at_save = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        assert mngr.all_steps() == [3, 6]
    uninterrupted = [_train_step(model, opt) for _ in range(4)]
    final = _snapshot(model, opt)

    # A "new process": other weights, a fresh optimizer, scrambled RNGs.
    model2, opt2 = _make(123)
    np.random.seed(99)
    random.seed(99)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(3)) as mngr:
        assert mngr.latest_step() == 6
        out = mngr.restore(target={"model": model2, "optimizer": opt2, "extra": {"n": 0}})
    assert out["extra"] == {"n": 6}
    assert out["model"] is model2
    _assert_same_state(at_save, _snapshot(model2, opt2))
    assert torch.equal(torch.get_rng_state(), rng_at_save[0])
    np_now = np.random.get_state()
    assert np_now[0] == rng_at_save[1][0] and np.array_equal(np_now[1], rng_at_save[1][1])
    assert np_now[2:] == rng_at_save[1][2:]
    assert random.getstate() == rng_at_save[2]
    resumed = [_train_step(model2, opt2) for _ in range(4)]
    assert resumed == uninterrupted
    _assert_same_state(final, _snapshot(model2, opt2))


def _drive(mngr, clock, state, steps, step_times, losses):
    decisions = []
    for s in steps:
        clock.t += step_times[s - 1]
        decisions.append(mngr.save(s, state, loss=losses[s - 1]))
    return decisions


@pytest.mark.parametrize("name", ["young", "coci"])
def test_policy_decisions_match_jax_policy(tmp_path, name):
    n, cost_s = 80, 4.0
    rng = np.random.default_rng(1)
    step_times = np.round(rng.uniform(2.0, 6.0, n) * 64) / 64  # dyadic: sums stay exact
    losses = 2.0 * np.exp(-np.arange(n) / 20.0) + rng.normal(0, 0.01, n)
    losses[[5, 17, 40]] = np.nan  # NaN losses are passed on and ignored, never a crash
    losses[23] = np.inf
    policy = (
        cj.policies.young(mtbf_s=600.0)
        if name == "young"
        else cj.policies.coci(mtbf_s=600.0, total_steps=n)
    )
    clock = ManualClock()
    model, opt = _make(0)
    state = {"model": model, "optimizer": opt, "slow": SlowStaging(clock, cost_s)}
    prior = prior_cost_s(_nbytes(state))
    assert prior == PRIOR_FIXED_S + 161 * 4 / PRIOR_WRITE_RATE_BPS  # the model's parameters
    expected, expected_state = replay(policy, step_times, losses, cost_s, n, cost_prior_s=prior)
    assert 1 < sum(expected) < n  # the case exercises both decisions
    if name == "coci":
        # coci knows total_steps: the manager saves the final step, which the policy itself
        # would not; the policy state is the policy's own all the same.
        assert not expected[-1]
        expected[-1] = True

    with cjt.CheckpointManager(tmp_path, policy=policy, clock=clock) as mngr:
        got = _drive(mngr, clock, state, range(1, n + 1), step_times, losses)
        assert mngr.checkpoint_cost_s == cost_s
        last = mngr.measurements
        median = sorted(step_times[-3:])[1]
        assert (last.step_time_s, last.cost_estimate_s) == (median, cost_s)
        assert last.loss == np.float32(losses[-1])
        final_state = mngr.policy_state
    assert got == expected
    # The manager feeds the policy in batches (one scan per check step): XLA may round a
    # float32 differently there than in one call per step, by an ulp at most.
    for a, b in zip(jax.tree.leaves(final_state), jax.tree.leaves(expected_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def test_schedule_continues_after_reopen(tmp_path):
    n, cost_s = 80, 3.0
    # Steady steps: the first step after the reopen is not timed and is given the step time
    # saved with the checkpoint, which then equals the uninterrupted run's.
    step_times = np.full(n, 2.5)
    losses = np.linspace(2.0, 1.0, n)
    policy = cj.policies.young(mtbf_s=300.0)
    clock = ManualClock()
    model, opt = _make(0)
    state = {"model": model, "optimizer": opt, "slow": SlowStaging(clock, cost_s)}
    prior = prior_cost_s(_nbytes(state))
    expected, _ = replay(policy, step_times, losses, cost_s, n, cost_prior_s=prior)
    assert expected[1]  # step 2, the early save
    k = [s for s in range(1, n + 1) if expected[s - 1]][2]  # the policy's second save: stop
    with cjt.CheckpointManager(tmp_path, policy=policy, clock=clock) as mngr:
        first = _drive(mngr, clock, state, range(1, k + 1), step_times, losses)
    # The restarted job's first step time counts from the manager's construction.
    with cjt.CheckpointManager(tmp_path, policy=policy, clock=clock) as mngr:
        assert mngr.latest_step() == k
        mngr.restore(target=state)
        second = _drive(mngr, clock, state, range(k + 1, n + 1), step_times, losses)
        steps = mngr.all_steps()
    assert first + second == expected
    assert steps == [s for s in range(1, n + 1) if expected[s - 1]]


def test_max_to_keep_removes_old_steps(tmp_path):
    model, opt = _make(0)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1), max_to_keep=2) as mngr:
        for step in range(1, 6):
            assert mngr.save(step, {"model": model, "optimizer": opt}, loss=1.0)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 5]
        with pytest.raises(FileNotFoundError, match="step 3"):
            mngr.restore(step=3, target={"model": model, "optimizer": opt})
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["4", "5"]


def test_a_second_writer_on_a_directory_gets_a_clear_error(tmp_path):
    # Without the lock, the second manager's start-up clean-up would remove the first one's
    # save in flight.
    with (
        cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)),
        pytest.raises(DirectoryLockedError, match=str(tmp_path)),
    ):
        cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1))
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:  # released
        assert mngr.all_steps() == []


def test_nan_and_inf_losses_still_save(tmp_path):
    model, _ = _make(0)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(2)) as mngr:
        got = [
            mngr.save(s, {"model": model}, loss=loss)
            for s, loss in enumerate(
                [math.nan, torch.tensor(float("nan")), math.inf, -math.inf], start=1
            )
        ]
        with pytest.raises(ValueError, match=r"one element, got shape \(2,\)"):
            mngr.save(5, {"model": model}, loss=torch.ones(2))
        mngr.wait_until_finished()
    assert got == [False, True, False, True]
    meta = json.loads((tmp_path / "4" / cjt.METADATA_NAME).read_text())
    assert meta["step"] == 4 and meta["policy"]["loss"] == -math.inf


def test_step_not_after_latest_is_an_error(tmp_path):
    model, _ = _make(0)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(5, {"model": model}, loss=1.0)
        with pytest.raises(ValueError, match=r"step: 5 is not after the latest saved step 5"):
            mngr.save(5, {"model": model}, loss=1.0)
        with pytest.raises(ValueError, match="step: must be >= 1"):
            mngr.save(0, {"model": model}, loss=1.0)
        with pytest.raises(ValueError, match="reserved"):
            mngr.save(6, {"cocijax": 1}, loss=1.0)
    with (
        cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr,
        pytest.raises(ValueError, match=r"step: 3 is not after the latest saved step 5"),
    ):
        mngr.save(3, {"model": model}, loss=1.0)


def test_optimizer_params_outside_state_modules_is_an_error(tmp_path):
    model, _ = _make(0)
    stray = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with (
        cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr,
        pytest.raises(ValueError, match=r"optimizer 'opt'.*shape \(3,\)"),
    ):
        mngr.save(1, {"model": model, "opt": opt}, loss=1.0)


def test_restore_errors_name_the_step(tmp_path):
    model, _ = _make(0)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        with pytest.raises(FileNotFoundError, match="no committed step"):
            mngr.restore(target={"model": model})
        mngr.save(1, {"model": model}, loss=1.0)
        with pytest.raises(ValueError, match=r"cannot restore step 1 .*Missing key.*: ema\.$"):
            mngr.restore(target={"model": model, "ema": torch.zeros(3)})
        with pytest.raises(ValueError, match="target is required"):
            mngr.restore()


def test_foreign_directory_and_crash_leftovers(tmp_path):
    (tmp_path / ".tmp-7-abc").mkdir()  # a save that crashed before its commit
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        assert mngr.all_steps() == []
    assert not (tmp_path / ".tmp-7-abc").exists()
    (tmp_path / "5").mkdir()  # e.g. an Orbax step directory
    with pytest.raises(ValueError, match=r"5 has no cocijax.json.*not written by cocijax.torch"):
        cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1))


def test_import_cocijax_does_not_import_torch():
    code = "import sys, cocijax, cocijax.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_without_torch_names_the_extra():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import cocijax.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'cocijax[torch]'" in out.stdout


def test_a_damaged_policy_entry_changes_nothing(tmp_path):
    """Finding 21 for the PyTorch manager, whose policy entry had no digest: a count changed
    on disk (here 5000 failures) was believed and written into every later checkpoint."""
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, {"w": torch.ones(2)}, loss=1.0)
    path = tmp_path / "1" / cjt.METADATA_NAME
    meta = json.loads(path.read_text())
    meta["policy"]["history"]["failures"] = 5000
    path.write_text(json.dumps(meta))
    with (
        pytest.warns(RuntimeWarning, match="does not match its digest"),
        cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr,
    ):
        assert mngr.measurements.failures == 0
        mngr.save(2, {"w": torch.ones(2)}, loss=1.0)
    assert (
        json.loads((tmp_path / "2" / cjt.METADATA_NAME).read_text())["policy"]["history"][
            "failures"
        ]
        == 0
    )
