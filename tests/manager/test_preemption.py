"""Preemption signals of cj.CheckpointManager, the final step of a known-length job, forced
saves' costs, and the policy warning said once (real files, real signals). What both managers
do alike (a SIGTERM save, a manager opened outside the main thread) is in test_contract.py."""

from __future__ import annotations

import os
import signal
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from manager_helpers import recording  # pytest puts tests/ on sys.path

import cocijax as cj

STATE = {"w": jnp.arange(4.0)}


def test_other_signals_and_no_signals(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with cj.CheckpointManager(tmp_path / "a", preemption_signals=()) as mngr:
        assert signal.getsignal(signal.SIGTERM) is before
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    with cj.CheckpointManager(
        tmp_path / "b",
        policy=cj.policies.fixed(10**6),
        preemption_signals=(signal.SIGUSR1,),
        exit_on_preemption=False,  # SIGUSR1's default action would end the test's process
    ) as mngr:
        assert signal.getsignal(signal.SIGTERM) is before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mngr.save(1, STATE, loss=1.0) and mngr.reached_preemption
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


@pytest.mark.parametrize(
    ("signals", "error", "match"),
    [
        ((signal.SIGKILL,), ValueError, "SIGKILL cannot be caught"),
        ((9999,), ValueError, "9999 is not a signal"),
        ("SIGTERM", TypeError, "expected a tuple of signals"),
        ((1.5,), TypeError, "1.5 is not a signal number"),
    ],
    ids=["sigkill", "no-such-signal", "string", "float"],
)
def test_bad_preemption_signals_are_named(tmp_path, signals, error, match):
    with pytest.raises(error, match=f"preemption_signals: {match}"):
        cj.CheckpointManager(tmp_path, preemption_signals=signals)


def test_a_policy_that_knows_total_steps_saves_the_last_step(tmp_path):
    # An MTBF of years: coci would not save at all in 30 steps, but the last step is saved
    # (and step 2, the early save that measures the cost).
    coci = cj.policies.coci(mtbf_s=1e8, recovery_s=0.0, total_steps=30, cost_prior_s=1.0)
    with cj.CheckpointManager(tmp_path, policy=coci) as mngr:
        saved = [s for s in range(1, 31) if mngr.save(s, STATE, loss=1.0 / s)]
        mngr.wait_until_finished()
        assert saved == [2, 30] and mngr.all_steps() == [2, 30]
    # Without total_steps nothing says which step is the last: force=True saves it.
    with cj.CheckpointManager(tmp_path / "open", policy=cj.policies.fixed(10**6)) as mngr:
        saved = [s for s in range(1, 31) if mngr.save(s, STATE, loss=1.0, force=s == 30)]
        assert saved == [30]


def test_a_forced_save_s_cost_reaches_the_policy(tmp_path):
    # Never saves by itself, and records what it is fed; without an early save (it says it
    # does not use the cost), the forced save is the first one timed.
    policy = recording(10**6, uses_cost=False)
    with cj.CheckpointManager(tmp_path, policy=policy) as mngr:
        for step in (1, 2):
            mngr.save(step, STATE, loss=1.0)
        assert np.isnan(mngr.policy_state.cost)
        assert mngr.save(3, {"w": jnp.ones(1 << 20)}, loss=1.0, force=True)
        forced = mngr.measurements.last_save_s
        mngr.save(4, STATE, loss=1.0)
        assert forced > 0 and np.float32(mngr.policy_state.cost) == np.float32(forced)


def _save_steps(directory, policy, steps) -> None:
    with cj.CheckpointManager(directory, policy=policy) as mngr:
        for step in steps:
            mngr.save(step, STATE, loss=1.0 / step, force=True)


def test_a_policy_of_another_kind_is_said_once_per_manager_however_many_restores(tmp_path):
    _save_steps(tmp_path, cj.policies.fixed(5), (1, 2, 3))
    coci = cj.policies.coci(mtbf_s=60.0, recovery_s=0.0, total_steps=50)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with cj.CheckpointManager(tmp_path, policy=coci) as mngr:
            for step in (1, 2, 3, 3):
                mngr.restore(step)
    policy_warnings = [w for w in said if "policy" in str(w.message)]
    assert len(policy_warnings) == 1, [str(w.message) for w in policy_warnings]
    assert "another policy" in str(policy_warnings[0].message)
    assert "starts its schedule fresh" in str(policy_warnings[0].message)
