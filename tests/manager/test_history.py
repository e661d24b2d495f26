"""The job history a checkpoint directory keeps (failures, uptime, MTBF, recovery), and its use."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import cocijax as cj
from cocijax.manager._history import MARKER, RunHistory, process_age_s


class Clock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def test_a_fresh_directory_has_no_failure_and_the_prior_mtbf(tmp_path):
    clock = Clock()
    h = RunHistory(tmp_path, clock=clock)
    h.adopt(None)
    assert (tmp_path / MARKER).exists()
    assert h.failures == 0 and h.mtbf_s(3600.0) == 3600.0
    clock.t += 600.0
    assert h.uptime_s == 600.0
    assert h.mtbf_s(3600.0) == pytest.approx(4200.0)  # (prior + uptime) / (1 + 0)
    h.close()
    assert not (tmp_path / MARKER).exists()


def test_a_run_that_did_not_close_counts_one_failure_once(tmp_path):
    clock = Clock()
    first = RunHistory(tmp_path, clock=clock)
    first.adopt(None)
    clock.t += 1000.0
    saved = first.to_json()  # what the last checkpoint recorded; then the process dies
    second = RunHistory(tmp_path, clock=clock)
    second.adopt(saved)
    assert second.failures == 1
    assert second.mtbf_s(3600.0) == pytest.approx((3600.0 + 1000.0) / 2.0)
    recorded = second.to_json()
    second.recorded()  # a checkpoint carrying `recorded` committed
    second.close()
    assert not (tmp_path / MARKER).exists()
    third = RunHistory(tmp_path, clock=clock)
    third.adopt(recorded)
    assert third.failures == 1  # the clean close added none


def test_a_failure_no_checkpoint_recorded_yet_is_kept_for_the_next_run(tmp_path):
    clock = Clock()
    RunHistory(tmp_path, clock=clock).adopt(None)  # then the process dies: no close
    second = RunHistory(tmp_path, clock=clock)
    second.adopt(None)
    assert second.failures == 1
    second.close()  # no save of this run committed: the failure is only in the marker
    assert (tmp_path / MARKER).exists()
    third = RunHistory(tmp_path, clock=clock)
    third.adopt(None)
    assert third.failures == 1  # the same failure, counted once
    third.recorded()
    third.close()
    assert not (tmp_path / MARKER).exists()


def test_a_corrupt_marker_is_one_failure_with_a_warning(tmp_path):
    (tmp_path / MARKER).write_bytes(b"\x00\xff not json")
    with pytest.warns(RuntimeWarning, match="corrupt"):
        h = RunHistory(tmp_path, clock=Clock())
    h.adopt({"failures": 2, "uptime_s": 50.0})
    assert h.failures == 3


def test_a_clock_going_backwards_never_makes_uptime_negative(tmp_path):
    clock = Clock(1000.0)
    h = RunHistory(tmp_path, clock=clock)
    h.adopt({"uptime_s": 300.0, "failures": 0})
    clock.t = 10.0  # backwards
    assert h.uptime_s == 300.0


def test_recovery_is_timed_from_the_process_start_to_the_first_step_after_a_restore(tmp_path):
    clock = Clock()
    h = RunHistory(tmp_path, clock=clock, opened_at_age_s=4.0)  # the process ran 4 s already
    h.adopt(None)
    assert math.isnan(h.recovery_s)
    h.step_done()  # no restore yet: nothing measured
    assert math.isnan(h.recovery_s)
    clock.t += 3.0
    h.restored()
    clock.t += 5.0
    h.step_done()
    assert h.recovery_s == pytest.approx(12.0)
    clock.t += 50.0
    h.step_done()  # later steps do not change it
    assert h.recovery_s == pytest.approx(12.0)
    assert h.to_json()["recovery_s"] == pytest.approx(12.0)


@pytest.mark.parametrize("bad", [{"uptime_s": -5.0}, {"uptime_s": "x"}, {"failures": math.nan}])
def test_bad_saved_values_fall_back_to_none_known(tmp_path, bad):
    h = RunHistory(tmp_path, clock=Clock())
    h.adopt(bad)
    assert h.uptime_s >= 0.0 and h.failures == 0


def test_readers_do_not_mark_the_directory(tmp_path):
    RunHistory(tmp_path, clock=Clock(), writer=False)
    assert not (tmp_path / MARKER).exists()


_KILLED_RUN = """
import os, sys
import jax.numpy as jnp
import cocijax as cj

policy = cj.policies.young(prior_mtbf_s=7200.0, cost_prior_s=1.0)
mngr = cj.CheckpointManager(sys.argv[1], policy=policy, prior_mtbf_s=7200.0)
for step in range(1, 4):
    mngr.save(step, {"x": jnp.ones(2)}, loss=1.0, force=step == 3)
mngr.wait_until_finished()
os.kill(os.getpid(), 9)  # a node failure: no close, no atexit
"""


def test_the_manager_learns_a_failure_and_passes_mtbf_and_recovery_to_the_policy(tmp_path):
    killed = subprocess.run([sys.executable, "-c", _KILLED_RUN, str(tmp_path)], timeout=300)
    assert killed.returncode == -9
    assert (tmp_path / MARKER).exists()  # the killed run left its marker

    policy = cj.policies.young(prior_mtbf_s=7200.0, cost_prior_s=1.0)
    with cj.CheckpointManager(tmp_path, policy=policy, prior_mtbf_s=7200.0) as mngr:
        m = mngr.measurements
        assert m.failures == 1
        # (prior + uptime) / (1 + failures); the killed run trained for seconds at most.
        assert 3600.0 < m.mtbf_s < 3600.0 + 60.0
        assert math.isnan(m.recovery_s)  # nothing restored yet
        mngr.restore(target={"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
        mngr.save(4, {"x": jnp.ones(2)}, loss=1.0)
        # From this process's start (imports, opening, restore) to the first step after it. The
        # process is pytest's, which may have run other tests for minutes before this one.
        age = process_age_s()
        assert 0.0 < mngr.measurements.recovery_s <= (300.0 if age is None else age)
        mngr.save(5, {"x": jnp.ones(2)}, loss=1.0, force=True)
    assert not (tmp_path / MARKER).exists()  # a clean close
    with cj.CheckpointManager(tmp_path, policy=policy, prior_mtbf_s=7200.0) as mngr:
        assert mngr.measurements.failures == 1  # the failure travelled with the checkpoint
        assert 0.0 < mngr.measurements.recovery_s < 300.0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "4h"])
def test_a_bad_prior_mtbf_is_refused_by_name(tmp_path, bad):
    with pytest.raises(ValueError, match="prior_mtbf_s"):
        cj.CheckpointManager(tmp_path, prior_mtbf_s=bad)
    assert not (tmp_path / MARKER).exists()  # refused before anything was marked
