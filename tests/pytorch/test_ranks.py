"""Two PyTorch ranks under ``torchrun`` (gloo on CPU, 127.0.0.1) saving through one manager.

Each job is a real ``torchrun --nproc_per_node=2`` process tree; kills are real ``SIGKILL``s,
of one rank (``--crash-at``/``--crash-rank`` of the example) or of the whole job (the launcher
and every rank, from here, while a save is in flight); preemption notices are real
``SIGTERM``s, to one rank or to ``torchrun``. The checks read the files the jobs left and the
lines they printed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch_helpers import TIMEOUT_S, ManualClock, SlowStaging, launch, replay, run_job

import cocijax as cj
import cocijax.torch as cjt
from cocijax.core._retention import BestN

HERE = Path(__file__).parent
EXAMPLE = HERE.parents[1] / "examples" / "torch_train.py"
# Accuracies of steps 1..8 for best-N: the newest step is the worst but one.
ACC = [0.5, 0.875, 0.625, 0.9375, 0.375, 0.75, 0.8125, 0.4375]  # exact in float32
BEST = BestN(lambda m: m["acc"], max_to_keep=2)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.xdist_group("torch-ranks"),
    pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning"),
]


def _committed(directory: Path) -> list[int]:
    """The listed steps, each checked whole: DCP's metadata, both ranks' files, cocijax.json."""
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    for step in steps:
        names = {p.name for p in (directory / str(step)).iterdir()}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", cjt.METADATA_NAME} <= names, (
            step,
            names,
        )
    return steps


def _digest(output: str) -> str:
    found = re.findall(r"parameter digest: (\w+)", output)
    assert len(found) == 1, output[-3000:]  # printed once, by rank 0
    return found[0]


def _kill_job(launcher: subprocess.Popen) -> None:
    """SIGKILLs the launcher's process group and each rank's (torchrun gives each its own)."""
    ranks = psutil.Process(launcher.pid).children(recursive=True)
    for pgid in [launcher.pid, *(p.pid for p in ranks)]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    launcher.wait(timeout=TIMEOUT_S)
    psutil.wait_procs(ranks, timeout=TIMEOUT_S)


def test_ranks_take_rank_0s_decisions_and_restore_their_own_state(tmp_path):
    n = 40
    rng = np.random.default_rng(3)
    ranks = [
        {
            # Rank 1's steps are three times slower and its saves dearer: on its own inputs
            # Young's rule would save at other steps.
            "step_times": list(np.round(rng.uniform(1.0, 2.0, n) * (1 + 2 * r) * 64) / 64),
            "losses": list(2.0 * np.exp(-np.arange(n) / (10.0 + 5 * r))),
            "cost_s": [2.0, 9.0][r],
        }
        for r in range(2)
    ]
    policy_kwargs = {"mtbf_s": 120.0, "cost_prior_s": 1.0}
    out = tmp_path / "out"
    out.mkdir()
    cfg = {
        "directory": str(tmp_path / "ckpt"),
        "out": str(out),
        "policy_kwargs": policy_kwargs,
        "ranks": ranks,
        "accuracies": ACC,
    }
    job = run_job(HERE / "_ranks_worker.py", json.dumps(cfg))
    assert job.returncode == 0, job.stdout[-5000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    policy = cj.policies.young(**policy_kwargs)
    # Built with a cost prior of its own (1 s): the manager gives it none before the first save.
    own = [
        replay(policy, r["step_times"], r["losses"], r["cost_s"], n, cost_prior_s=math.nan)[0]
        for r in ranks
    ]
    assert own[0] != own[1], "the ranks' inputs lead to the same decisions: nothing is tested"
    assert records[0]["decisions"] == records[1]["decisions"] == own[0]
    saved_steps = [s for s, saved in enumerate(own[0], 1) if saved]
    latest = saved_steps[-1]
    assert records[0]["latest"] == records[1]["latest"] == latest
    assert _committed(tmp_path / "ckpt") == [*saved_steps, n + 2]  # n + 2: see below

    for r, record in enumerate(records):
        assert record["restored_counter"] == 1000 * r + latest  # its own extra item
        assert record["restored_rng_equal"]  # its own RNG states
        assert record["draws_after_restore"] == record["draws_after"]
    assert records[0]["draws_after"] != records[1]["draws_after"]  # the RNGs did differ
    torch.manual_seed(0)
    initial = torch.nn.Linear(4, 3)
    assert records[0]["weight"] == records[1]["weight"] == initial.weight.tolist()

    # Rank 1's extra item raised in a forced save: rank 1 raised that error, rank 0 a
    # RuntimeError naming rank 1's; nothing was listed; the next save committed on both.
    assert records[1]["error"] == "KeyError: 'no state on rank 1'"
    assert records[0]["error"] == (
        "RuntimeError: rank 1 failed, so this rank (0) stops too: KeyError: 'no state on rank 1'"
    )
    for record in records:
        assert record["steps_after_error"] == saved_steps
        assert record["saved_after_error"] and record["steps_after_next"][-1] == n + 2

    # Best-N: rank 0's metrics are recorded and rank the steps, the same on both ranks.
    doomed = BEST.to_delete({s: {"acc": acc} for s, acc in enumerate(ACC, 1)})
    kept = [s for s in range(1, len(ACC) + 1) if s not in doomed]
    assert kept == [2, 4, 8]  # the two best, and the newest
    assert records[0]["best_steps"] == records[1]["best_steps"] == kept
    assert _committed(tmp_path / "best") == kept
    for record in records:
        assert record["best_metrics"] == {str(s): {"acc": ACC[s - 1]} for s in kept}

    # One process restores the 2-rank checkpoint: the state reshards; per-rank state cannot.
    model = torch.nn.Linear(4, 3)
    with cjt.CheckpointManager(tmp_path / "ckpt", policy=policy) as mngr:
        with pytest.warns(RuntimeWarning, match="saved by 2 ranks, this job has 1"):
            mngr.restore(step=latest, target={"model": model})
        with pytest.raises(ValueError, match=r"extra items are per rank.*saved by 2 ranks"):
            mngr.restore(
                step=latest,
                target={"model": model},
                extra={"counter": SlowStaging(ManualClock(), 0.0)},
            )
    assert model.weight.tolist() == initial.weight.tolist()


# CI keeps the one-process kill (test_example.py) and the two-rank decisions test above.
@pytest.mark.long
def test_a_two_rank_job_killed_and_restarted_resumes_bit_exact(tmp_path):
    args = ["--steps", "100", "--policy", "fixed", "--every", "10"]
    reference = run_job(EXAMPLE, "--dir", str(tmp_path / "reference"), *args)
    assert reference.returncode == 0, reference.stdout[-5000:]
    assert "fresh run" in reference.stdout and "2 rank(s)" in reference.stdout
    assert _committed(tmp_path / "reference")[-1] == 100  # the final model is kept

    ckpt = tmp_path / "ckpt"
    cmd = ["--dir", str(ckpt), *args]
    # 1. Rank 1 dies by SIGKILL after step 35; torchrun then stops rank 0.
    crashed = run_job(EXAMPLE, *cmd, "--crash-at", "35", "--crash-rank", "1")
    assert crashed.returncode != 0
    assert "rank 1: simulated crash after step 35" in crashed.stdout
    assert "done:" not in crashed.stdout
    first = _committed(ckpt)
    assert first and set(first) <= {10, 20, 30}

    # 2. The resumed job is killed whole, launcher and ranks, right after a save started.
    launcher = launch(EXAMPLE, *cmd, start_new_session=True)
    lines, killed_at = [], None
    try:
        for line in launcher.stdout:
            lines.append(line)
            saved = re.match(r"step\s+(\d+): saved", line)
            if saved:
                killed_at = int(saved.group(1))
                _kill_job(launcher)
                break
    finally:
        if launcher.poll() is None:
            _kill_job(launcher)
        launcher.stdout.close()
    output = "".join(lines)
    assert killed_at is not None, f"no save started before the job ended:\n{output[-3000:]}"
    assert f"resumed from step {first[-1]}" in output
    assert launcher.returncode == -signal.SIGKILL, output[-3000:]
    second = _committed(ckpt)  # the save in flight is listed whole or not at all
    assert first[-1] < killed_at and set(second) - set(first) <= {killed_at}

    # 3. Restarted again, it finishes with exactly the uninterrupted job's parameters.
    final = run_job(EXAMPLE, *cmd)
    assert final.returncode == 0, final.stdout[-5000:]
    assert f"resumed from step {second[-1]}" in final.stdout
    assert _digest(final.stdout) == _digest(reference.stdout)
    assert _committed(ckpt)[-1] == 100
    # Both failures are counted: rank 1's death (rank 0 left its `with` block by an error, and
    # its close kept the running marker) and the kill of the whole job.
    meta = json.loads((ckpt / "100" / cjt.METADATA_NAME).read_text())
    assert meta["policy"]["history"]["failures"] == 2


def _preempted(output: str) -> int:
    found = re.findall(r"^preempted: step (\d+) saved; run the same command", output, re.M)
    assert len(found) == 1, output[-3000:]  # one line, by rank 0
    return int(found[0])


def _rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    """The process of ``rank`` in a job started by :func:`_launch`."""
    (process,) = [
        p
        for p in psutil.Process(launcher.pid).children()  # torchrun starts the ranks itself
        if p.environ().get("RANK") == str(rank)
    ]
    return process


def _signal_after_first_save(cmd: list[str], target) -> subprocess.CompletedProcess[str]:
    """Runs a 2-rank job of the example and SIGTERMs ``target(launcher)`` once it has saved."""
    launcher = launch(EXAMPLE, *cmd)
    watchdog = threading.Timer(TIMEOUT_S, _kill_job, (launcher,))
    watchdog.start()
    lines = []
    try:
        for line in launcher.stdout:
            lines.append(line)
            if re.match(r"step\s+\d+: saved", line):
                target(launcher).send_signal(signal.SIGTERM)
                lines.extend(launcher.stdout)  # the rest, until the job ends
                break
        launcher.wait(timeout=TIMEOUT_S)
    finally:
        watchdog.cancel()
        if launcher.poll() is None:
            _kill_job(launcher)
        launcher.stdout.close()
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, "".join(lines))


@pytest.mark.long  # SIGTERM: test_signals.py and test_contract.py in CI
def test_sigterm_makes_both_ranks_save_one_step_and_the_rerun_resumes_there(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Far more steps than run before the signal: the job ends only by it.
    cmd = ["--dir", str(ckpt), "--steps", "100000", "--policy", "fixed", "--every", "20"]

    # 1. SIGTERM to rank 1 alone (a scheduler notifying one node): rank 0 learns of it when
    # the ranks gather their flags, both save the same step, and both exit 0 (torchrun's 0).
    first = _signal_after_first_save(cmd, lambda launcher: _rank_process(launcher, 1))
    assert first.returncode == 0, first.stdout[-5000:]
    step = _preempted(first.stdout)
    assert _committed(ckpt)[-1] == step  # both ranks' files: both took that save

    # 2. The rerun resumes there. SIGTERM to torchrun, which passes it on to both ranks (and
    # then exits 1 itself, re-raising the signal it got): they save one step again.
    second = _signal_after_first_save(cmd, lambda launcher: launcher)
    assert f"resumed from step {step}" in second.stdout, second.stdout[-5000:]
    again = _preempted(second.stdout)
    assert again > step and _committed(ckpt)[-1] == again
    assert "done:" not in second.stdout
