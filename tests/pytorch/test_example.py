"""``examples/torch_train.py`` run as its docstring says: crash at 500, rerun, SIGTERM, rerun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "examples" / "torch_train.py"


def _start(directory: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(directory), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),  # each line as it is printed
    )


def _wait(run: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    with run:
        out, err = run.communicate(timeout=600)
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


def _run(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _wait(_start(directory, *args))


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _digest(out: str) -> str:
    found = re.findall(r"parameter digest: (\w+)", out)
    assert len(found) == 1, out
    return found[0]


def test_the_example_with_its_defaults_resumes_and_keeps_its_final_model(tmp_path):
    ckpt = tmp_path / "ckpt"
    reference = _start(tmp_path / "reference")  # alongside the crashing run: a shorter test
    crashed = _run(ckpt, "--crash-at", "500")
    uninterrupted = _wait(reference)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert "simulated crash after step 500" in crashed.stdout
    before = _steps(ckpt)
    assert before and before[-1] <= 500, "no save before the crash: nothing to resume from"

    # The rerun resumes; a SIGTERM after its first save makes it save at once and exit 0.
    preempted = _start(ckpt)
    lines = []
    for line in preempted.stdout:
        lines.append(line)
        if re.match(r"step\s+\d+: saved", line):
            preempted.send_signal(signal.SIGTERM)
            break
    rest = _wait(preempted)
    out = "".join(lines) + rest.stdout
    assert rest.returncode == 0, rest.stderr
    assert f"resumed from step {before[-1]}" in out
    (at,) = re.findall(r"^preempted: step (\d+) saved; run the same command to resume$", out, re.M)
    assert _steps(ckpt)[-1] == int(at) < 1000 and "done:" not in out

    resumed = _run(ckpt)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {at}" in resumed.stdout
    assert _digest(resumed.stdout) == _digest(uninterrupted.stdout)
    assert _steps(ckpt)[-1] == 1000  # the final step is saved

    # A finished job keeps its final model: a rerun restores it and trains nothing.
    again = _run(ckpt)
    assert again.returncode == 0, again.stderr
    assert "resumed from step 1000" in again.stdout and "0 saves this run" in again.stdout
    assert _digest(again.stdout) == _digest(uninterrupted.stdout)
