"""The job history a checkpoint directory keeps (failures, uptime, MTBF, recovery), and its use."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cocijax as cj
from cocijax._digest import DIGEST_KEY, with_digest
from cocijax.core._history import (
    MARKER,
    MAX_FAILURES,
    MAX_SECONDS,
    MIN_MTBF_S,
    RunHistory,
    process_age_s,
)


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


def test_a_crash_loop_counts_every_failure_until_a_save_records_them(tmp_path):
    """Issue 30: four kills within seconds of the start, before any save, counted as one (the
    marker held no count), so the MTBF estimate stayed at its prior."""
    clock = Clock()
    for _ in range(4):
        RunHistory(tmp_path, clock=clock).adopt(None)  # then killed: no close, no save
    fifth = RunHistory(tmp_path, clock=clock)
    fifth.adopt(None)
    assert fifth.failures == 4
    assert fifth.mtbf_s(3600.0) == pytest.approx(3600.0 / 5)
    fifth.close()  # a clean close, but no save recorded them: the next run counts them, once
    assert json.loads((tmp_path / MARKER).read_text())["closed"] is True
    sixth = RunHistory(tmp_path, clock=clock)
    sixth.adopt(None)
    assert sixth.failures == 4
    saved = sixth.to_json()
    sixth.recorded()  # a checkpoint carrying `saved` committed
    sixth.close()
    assert not (tmp_path / MARKER).exists()
    seventh = RunHistory(tmp_path, clock=clock)
    seventh.adopt(saved)
    assert seventh.failures == 4  # recorded, not counted again
    seventh.recorded()  # recorded again, then killed
    eighth = RunHistory(tmp_path, clock=clock)
    eighth.adopt(saved)
    assert eighth.failures == 5


@pytest.mark.parametrize(
    "bad",
    [
        {"uptime_s": -5.0},
        {"uptime_s": "x"},
        {"failures": math.nan},
        {"failures": 5000.0},
        {"failures": 1e300},
        {"failures": 10**7},
        {"failures": True},
        {"uptime_s": 1e300},
        {"recovery_s": math.inf},
        ["not", "a", "history"],
    ],
)
def test_a_history_no_job_can_have_is_refused_whole(tmp_path, bad):
    h = RunHistory(tmp_path, clock=Clock())
    reason = h.adopt(
        {"failures": 2, "uptime_s": 50.0, "recovery_s": 3.0, **bad}
        if isinstance(bad, dict)
        else bad
    )
    assert reason  # said why
    assert h.uptime_s == 0.0 and h.failures == 0 and math.isnan(h.recovery_s)
    assert h.mtbf_s(3600.0) == 3600.0


def test_the_learned_mtbf_stays_within_bounds(tmp_path):
    """Finding 21: a history made the MTBF 8.6e-296 s, 0 in float32, where coci takes it for
    "unknown" and falls back on its 24 h prior: 0 saves in 300 steps."""
    h = RunHistory(tmp_path, clock=Clock())
    assert h.adopt({"failures": MAX_FAILURES, "uptime_s": 0.0}) == ""
    assert h.mtbf_s(3600.0) == MIN_MTBF_S  # 3600 / 10^6 would be 3.6 ms
    assert h.adopt({"failures": 0, "uptime_s": MAX_SECONDS}) == ""
    assert h.mtbf_s(3600.0) == pytest.approx(MAX_SECONDS + 3600.0)
    assert np.float32(h.mtbf_s(3600.0)) < np.inf


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
        assert 0.0 < mngr.measurements.recovery_s <= (300.0 if age is None else age)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "4h"])
def test_a_bad_prior_mtbf_is_refused_by_name(tmp_path, bad):
    with pytest.raises(ValueError, match="prior_mtbf_s"):
        cj.CheckpointManager(tmp_path, prior_mtbf_s=bad)
    assert not (tmp_path / MARKER).exists()  # refused before anything was marked


@pytest.mark.parametrize("damage", ["no format, no digest", "a count no job has"])
def test_a_damaged_policy_item_changes_no_history(tmp_path, damage):
    """Finding 21: an item that `adopt` refused ("not a cocijax policy state") still gave the
    policy its history: "failures": 5000 made the MTBF 17 s, 1e300 made it 8.6e-296 s, and
    every later checkpoint carried the count on."""
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, {"x": jnp.ones(2)}, loss=1.0)
    item = tmp_path / "1" / "policy" / "policy_state.json"
    if damage == "no format, no digest":
        item.write_text(json.dumps({"history": {"failures": 5000, "uptime_s": 0.0}}))
    else:  # a well-formed item with its digest, whose history no job can have
        good = {k: v for k, v in json.loads(item.read_text()).items() if k != DIGEST_KEY}
        item.write_text(json.dumps(with_digest({**good, "history": {"failures": 10**9}})))
    policy = cj.policies.young(prior_mtbf_s=7200.0)
    with (
        pytest.warns(RuntimeWarning, match="1/policy.*(not a cocijax policy|history)"),
        cj.CheckpointManager(tmp_path, policy=policy, prior_mtbf_s=7200.0) as mngr,
    ):
        assert mngr.measurements.failures == 0
        assert 7200.0 <= mngr.measurements.mtbf_s < 7200.0 + 60.0
        mngr.save(2, {"x": jnp.ones(2)}, loss=1.0, force=True)
    saved = json.loads((tmp_path / "2" / "policy" / "policy_state.json").read_text())
    assert saved["history"]["failures"] == 0  # the damage is not written on
