"""The README demo (examples/flax_train.py) runs, saves, and resumes after a SIGKILL."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flax_train.py"

pytest.importorskip("flax")
pytest.importorskip("sklearn")


def run(ckpt: Path, *extra: str, expect: int = 0) -> str:
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--dir",
        str(ckpt),
        "--steps",
        "45",
        "--hidden",
        "32",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == expect, out.stdout + out.stderr
    return out.stdout


def field(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text}"
    return match.group(1)


def test_demo_killed_and_rerun_ends_like_an_uninterrupted_run(tmp_path):
    roots = ["--roots", str(tmp_path / "r0"), str(tmp_path / "r1")]
    killed = run(tmp_path / "ck", *roots, "--kill-at", "30", expect=-signal.SIGKILL)
    saved = [int(s) for s in re.findall(r"step\s+(\d+): saved", killed)]
    assert saved and max(saved) <= 30, killed
    resumed = run(tmp_path / "ck", *roots)
    assert int(field(r"resumed from step (\d+)", resumed)) == max(saved)
    whole = run(tmp_path / "whole")
    assert "fresh run" in whole
    assert field(r"parameter digest: (\w+)", resumed) == field(r"parameter digest: (\w+)", whole)
