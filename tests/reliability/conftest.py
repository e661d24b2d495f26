"""Fixtures of the reliability tests; helpers live in ``reliability_helpers``."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test only; skipped where mounting is not allowed."""
    yield from _mount_tmpfs(tmp_path / "tmpfs", "size=8m")


@pytest.fixture
def read_only_root(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs: root ignores permission bits, so only a read-only mount stops it."""
    yield from _mount_tmpfs(tmp_path / "ro", "ro,size=1m")


def _mount_tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        # A lazy unmount still detaches the mount if a file in it is open somewhere.
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
