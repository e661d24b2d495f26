"""Fixtures of the memory tier's tests: folders on the machine's tmpfs, a small tmpfs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cocijax.core._memory import find_tmpfs


@pytest.fixture
def memory():
    """A fresh folder on the shared-memory tmpfs, removed afterwards (skipped without one)."""
    tmpfs = find_tmpfs()
    if tmpfs is None:
        pytest.skip("no shared-memory tmpfs on this machine")
    path = Path(tempfile.mkdtemp(dir=tmpfs, prefix="cocijax-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs mounted for this test only; skipped where mounting is not allowed."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
