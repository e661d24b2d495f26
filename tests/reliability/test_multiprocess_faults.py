"""Two JAX processes on 127.0.0.1 that go wrong: different steps, and a process that dies.

``_mp_faults.py`` runs the processes. Each regression here was a hang or an abort before: with
different steps, one process waited in Orbax's sync for ever (its peer in a broadcast) and
otherwise gloo aborted on mismatched collectives; a survivor's ``close()`` waited in Orbax's
barrier until JAX's heartbeat timeout aborted it. Each test therefore runs its processes under a
subprocess timeout, and fails on it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_helpers import launch_job

import cocijax as cj

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("reliability-multiprocess")]

# A hang guard: the processes take seconds (start-up included) when they end by themselves.
TIMEOUT_S = 120.0


def _run(cfg: dict[str, Any], n: int = 2) -> list[subprocess.CompletedProcess[str]]:
    """Runs ``n`` processes of ``_mp_faults.py`` together; fails if any outlives TIMEOUT_S."""
    return launch_job("_mp_faults.py", cfg, n, devices=1, timeout=TIMEOUT_S, check=False)


def test_processes_at_different_steps_all_raise_naming_the_steps(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cfg = {"mode": "wrong_step", "directory": str(tmp_path / "ckpt"), "out": str(out)}
    done = _run(cfg)
    for i, proc in enumerate(done):
        assert proc.returncode == 0, f"process {i} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    records = [json.loads((out / f"wrong_step_{i}.json").read_text()) for i in range(2)]
    for i, record in enumerate(records):
        error = record["error"]
        assert error is not None, f"process {i} saved on: {record}"
        assert error["type"] == "StepMismatchError", error
        # Both processes' steps are named, on both (process 1 skipped step 4).
        assert "(process 0: step 4; process 1: step 5)" in error["message"], error
        assert record["committed"] == [], record  # nothing of those steps was saved
    # At the same call: process 0's fourth step, process 1's fourth (step 5).
    assert [r["step"] for r in records] == [4, 5]
    assert issubclass(cj.manager.StepMismatchError, ValueError)


def test_survivor_of_a_dead_process_closes_within_its_timeout(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    directory = tmp_path / "ckpt"
    cfg = {"mode": "peer_dies", "directory": str(directory), "out": str(out)}
    cfg["close_timeout_s"] = 5.0
    done = _run(cfg)
    assert done[1].returncode == 3  # it died as told
    assert done[0].returncode == 0, done[0].stderr[-3000:]
    record = json.loads((out / "peer_dies_0.json").read_text())
    assert record["committed"] == [4]
    assert record["save_error"] is not None  # its next check needs the dead process
    error = record["close_error"]
    assert error is not None and error["type"] == "TimeoutError", record
    assert "step 8" in error["message"] and "timeout_s=5" in error["message"], error
    assert "Abandoned" in error["message"], error
    assert record["close_s"] < 60.0, record  # a hang guard; the bound itself is 5 s
    # The abandoned step is not committed; the lock was released (a new writer opens).
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(4)) as mngr:
        assert mngr.all_steps() == [4]
        restored = mngr.restore(4)
    np.testing.assert_array_equal(restored["w"], np.arange(8.0))
