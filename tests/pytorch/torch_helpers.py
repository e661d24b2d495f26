"""What the PyTorch tests share: a scripted clock, the policy replayed on known inputs, and
2-rank ``torchrun`` jobs (gloo on CPU, 127.0.0.1)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

TIMEOUT_S = 300  # a 2-rank job's bound


class ManualClock:
    """A clock that moves only when told, so measured step times and costs are exact."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class SlowStaging:
    """A stateful entry whose ``state_dict`` (called while ``save`` blocks) takes ``cost_s``."""

    def __init__(self, clock: ManualClock, cost_s: float):
        self.clock, self.cost_s, self.value = clock, cost_s, 0

    def state_dict(self):
        self.clock.t += self.cost_s
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def replay(
    policy: Any, step_times, losses, cost_s: float, n: int, *, cost_prior_s: float
) -> tuple[list[bool], Any]:
    """The JAX policy run directly on the inputs a manager must have measured.

    Step 1 is not timed (it includes compilation, like the JAX manager's first step); a step
    time is given from the second one measured on, as the median of the last three (the lower
    of two). The cost is ``cost_prior_s`` until a save is timed, then ``cost_s``. With no cost
    known, the first timed step (step 2) is saved early, which the policy is not told.
    """
    update = jax.jit(policy.update)
    state, cost, saves, measured, timed = policy.init(), cost_prior_s, [], [], False
    for s in range(1, n + 1):
        if s > 1:
            measured.append(step_times[s - 1])
        recent = sorted(measured[-3:])
        step_time = recent[(len(recent) - 1) // 2] if len(measured) > 1 else math.nan
        save, state = update(
            state,
            step=np.int32(s),
            loss=np.float32(losses[s - 1]),
            step_time_s=np.float32(step_time),
            checkpoint_cost_s=np.float32(cost),
        )
        saves.append(bool(save) or (s == 2 and not timed))
        if saves[-1]:
            cost, timed = cost_s, True
    return saves, state


def _torchrun(script: Path, *args: str) -> list[str]:
    with socket.socket() as s:  # a port nothing listens on right now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",  # what the `torchrun` command runs
        "--nproc_per_node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(script),
        *args,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the suite's 8 simulated devices are of no use to a rank
    return env


def launch(script: Path, *args: str, **popen: Any) -> subprocess.Popen[str]:
    """Starts a 2-rank job; its output (both ranks', and torchrun's) on one pipe."""
    return subprocess.Popen(
        _torchrun(script, *args),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def run_job(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs a 2-rank job to its end (at most ``TIMEOUT_S``); its output on one pipe."""
    with launch(script, *args) as job:
        out, _ = job.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(job.args, job.returncode, out)
