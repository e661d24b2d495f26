"""The README demo (examples/flax_train.py) runs, saves, resumes after a SIGKILL and after a
SIGTERM (a preemption notice) exactly where an uninterrupted run would be, and a finished run
trains nothing when it is run again. Real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flax_train.py"
# Long enough for a SIGTERM sent after the first save to land mid-training (about a second).
STEPS = 2000
# Such a run trains for under a second: at the demo's default MTBF (10 s) no save before the
# last pays off, so the policy is told 1 s (first save after 200-450 steps on the 2-core machine).
MTBF = "1"
KILL_AT = 1000

pytest.importorskip("flax")
pytest.importorskip("grain")
pytest.importorskip("sklearn")


def command(ckpt: Path, *extra: str) -> list[str]:
    args = ["--dir", str(ckpt), "--steps", str(STEPS), "--hidden", "32", "--mtbf", MTBF, *extra]
    return [sys.executable, str(EXAMPLE), *args]


def run(ckpt: Path, *extra: str, expect: int = 0) -> str:
    out = subprocess.run(command(ckpt, *extra), capture_output=True, text=True, timeout=300)
    assert out.returncode == expect, out.stdout + out.stderr
    return out.stdout


def field(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text}"
    return match.group(1)


def digest(text: str) -> str:
    return field(r"parameter digest: (\w+)", text)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    """One uninterrupted run: its directory and its output."""
    ckpt = tmp_path_factory.mktemp("whole") / "ck"
    return ckpt, run(ckpt)


def test_demo_killed_and_rerun_ends_like_an_uninterrupted_run(tmp_path, uninterrupted):
    roots = ["--roots", str(tmp_path / "r0"), str(tmp_path / "r1")]
    killed = run(tmp_path / "ck", *roots, "--kill-at", str(KILL_AT), expect=-signal.SIGKILL)
    saved = [int(s) for s in re.findall(r"step\s+(\d+): saved", killed)]
    assert saved and max(saved) <= KILL_AT, killed
    resumed = run(tmp_path / "ck", *roots)
    assert int(field(r"resumed from step (\d+)", resumed)) == max(saved)
    assert "fresh run" in uninterrupted[1]
    # The Grain iterator's position came back with the checkpoint: the same batches follow.
    assert digest(resumed) == digest(uninterrupted[1])


@pytest.mark.long  # SIGTERM: tests/manager/test_signals.py in CI
def test_sigterm_saves_at_once_exits_0_and_the_rerun_resumes_there(tmp_path, uninterrupted):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command(tmp_path / "ck"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        lines = []
        for line in proc.stdout:  # the first save says the loop is under way
            lines.append(line)
            if ": saved" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out + err
    (message,) = [line for line in out.splitlines() if line.startswith("preempted")]
    step = int(field(r"preempted: step (\d+) saved", message))
    assert 1 < step < STEPS, out
    assert "done:" not in out
    resumed = run(tmp_path / "ck")
    assert int(field(r"resumed from step (\d+)", resumed)) == step
    assert digest(resumed) == digest(uninterrupted[1])


@pytest.mark.long  # CI runs the kill-and-rerun demo
def test_a_finished_run_keeps_its_last_step_and_trains_nothing_when_rerun(uninterrupted):
    ckpt, whole = uninterrupted
    assert re.search(rf"step\s+{STEPS}: saved", whole), whole
    again = run(ckpt)
    assert f"already trained to step {STEPS}" in again
    assert "saved" not in again
    assert digest(again) == digest(whole)
