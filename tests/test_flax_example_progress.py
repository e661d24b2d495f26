"""The demo's progress bar counts the saves printed above it (examples/flax_train.py).

Rich draws the bar again below each printed line as it was last drawn; the demo redraws it
with the new count before it prints a save's line. The run is on a pipe that rich is told to
treat as an interactive terminal (``TTY_COMPATIBLE``, ``TTY_INTERACTIVE``), so the frames a
user would see are in its output.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flax_train.py"
STEPS = 1000

pytest.importorskip("flax")
pytest.importorskip("grain")
pytest.importorskip("sklearn")


@pytest.mark.long  # a whole demo run
def test_the_bar_drawn_below_each_saved_line_counts_that_save(tmp_path):
    env = {**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "160"}
    # --mtbf 1 (second): several saves within a run this short (as in test_flax_example.py).
    args = ["--dir", str(tmp_path / "ck"), "--steps", str(STEPS), "--hidden", "32", "--mtbf", "1"]
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", run.stdout)
    lines = [line for line in re.split(r"[\r\n]", plain) if line.strip()]
    saved = 0
    for line, below in itertools.pairwise(lines):
        if match := re.match(r"step\s+(\d+): saved", line):
            saved += 1
            bar = re.search(rf"(\d+)/{STEPS} .*saves (\d+)", below)
            assert bar, f"no bar below {line!r}: {below!r}"
            assert (int(bar.group(1)), int(bar.group(2))) == (int(match.group(1)), saved), below
    assert saved >= 2, plain
    assert f"{saved} saves this run" in plain
