"""A real SIGTERM to a training process: every manager saves, then the job ends as without cocijax.

Each case runs a child process that trains with the managers' defaults (no check of
``reached_preemption``: a loop ported as it was written for Orbax) and gets a SIGTERM from the
test once it is under way. Found by review: the manager's handler swallowed the signal, so such a
loop trained on to its end (exit 0), where Orbax's died at once (143); and with two managers in one
process only the one opened last saved. The in-process cases (a Python handler cocijax replaced,
``exit_on_preemption=False``) are in test_contract.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import cocijax as cj

# One process per case, each running until the test's SIGTERM ends it.
pytestmark = pytest.mark.xdist_group("signals")

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import cocijax as cj

    kind, ready, *dirs = sys.argv[1:]
    if kind == "torch":
        import torch
        import cocijax.torch as cjt

        make, state = cjt.CheckpointManager, lambda: {"w": torch.arange(3.0)}
    else:
        make, state = cj.CheckpointManager, lambda: {"w": np.arange(3.0)}
    managers = [make(d, policy=cj.policies.fixed(10**6)) for d in dirs]
    for step in range(1, 10**6):
        time.sleep(0.005)  # a training step
        for mngr in managers:
            mngr.save(step, state(), loss=1.0, force=step == 1)
        if step == 1:
            for mngr in managers:
                mngr.wait_until_finished()
            open(ready, "w").close()
    print("trained to the end: the signal was swallowed", flush=True)
    """
)


def _run_until_sigterm(tmp_path: Path, kind: str, dirs: list[Path]) -> subprocess.CompletedProcess:
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, kind, str(ready), *map(str, dirs)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never saved its first step"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _reopen(kind: str, directory: Path):
    if kind == "torch":
        import cocijax.torch as cjt

        return cjt.CheckpointManager(directory, policy=cj.policies.fixed(10**6))
    return cj.CheckpointManager(directory, policy=cj.policies.fixed(10**6))


@pytest.mark.parametrize("kind", ["jax", "torch"])
def test_sigterm_ends_a_loop_that_does_not_check_once_every_manager_has_saved(tmp_path, kind):
    if kind == "torch":
        pytest.importorskip("torch")
    dirs = [tmp_path / "train_state", tmp_path / "ema"]  # two managers in one process
    done = _run_until_sigterm(tmp_path, kind, dirs)
    # Ended by the signal, as without cocijax (a shell shows 143), not trained to the end.
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "trained to the end" not in done.stdout
    latest = []
    for directory in dirs:
        # Each manager took its preemption save, committed; and closed cleanly first: the next
        # run is not counted as recovering from a failure, and the directory is not locked.
        with _reopen(kind, directory) as again:
            latest.append(again.latest_step())
            assert again.measurements.failures == 0
        assert not (directory / ".cocijax-running").exists()
    # Each at its next save after the signal: the same step, or the next for the manager
    # whose save of the step the signal arrived after.
    assert min(latest) > 1 and max(latest) - min(latest) <= 1, latest


@pytest.mark.parametrize("kind", ["jax", "torch"])
def test_two_managers_in_one_process_both_take_their_preemption_save(tmp_path, kind):
    if kind == "torch":
        pytest.importorskip("torch")
        import torch

        import cocijax.torch as cjt

        make, state = cjt.CheckpointManager, lambda: {"w": torch.arange(3.0)}
    else:
        make, state = cj.CheckpointManager, lambda: {"w": np.arange(3.0)}
    options = {
        "policy": cj.policies.fixed(10**6),
        "preemption_signals": (signal.SIGUSR1,),
        "exit_on_preemption": False,  # SIGUSR1's default action would end the test's process
    }
    with make(tmp_path / "state", **options) as first, make(tmp_path / "ema", **options) as second:
        os.kill(os.getpid(), signal.SIGUSR1)
        # Before: the second manager's handler replaced the first's, which never saw it.
        assert first.save(1, state(), loss=1.0) and first.reached_preemption
        assert second.save(1, state(), loss=1.0) and second.reached_preemption
        assert first.all_steps() == second.all_steps() == [1]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # given back once both closed
