"""One root of two stops accepting writes mid-run, then is repaired.

The failing root is an 8 MiB tmpfs that the test remounts read-only between two saves (root
ignores permission bits, so a read-only mount is what stops it), the healthy one a directory on
the test's disk. The save that needs the failing root must fail naming it; what the healthy root
holds must not change (every file byte for byte); the earlier steps stay listed and restore;
once the root is remounted read-write, saves resume and leave no stray stripe.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from reliability_helpers import item_dir, orphaned_stripes

import cocijax as cj
from cocijax import storage

pytestmark = pytest.mark.xdist_group("reliability-mounts")


def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {f"w{i}": rng.standard_normal((64, 256)).astype(np.float32) for i in range(4)}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True, capture_output=True)


def test_a_root_that_becomes_read_only_fails_the_save_by_name(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    directory = tmp_path / "ckpt"
    failing, healthy = small_tmpfs / "root", tmp_path / "disk_root"
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0))
    options = {"small_bytes": 4096, "piece_bytes": 64 * 1024}
    with cj.CheckpointManager(
        directory,
        roots=[failing, healthy],
        policy=cj.policies.fixed(1),
        max_to_keep=5,
        handler_options=options,
    ) as mngr:
        for step in (1, 2):
            mngr.save(step, _state(step), loss=1.0, force=True)
        mngr.wait_until_finished()
        before = _files(healthy)
        _remount(small_tmpfs, "ro")
        try:
            with pytest.raises(Exception) as info:  # any type: the message is the contract
                mngr.save(3, _state(3), loss=1.0, force=True)
                mngr.wait_until_finished()
        finally:
            _remount(small_tmpfs, "rw")
        message = str(info.value)
        print(f"read-only root: {type(info.value).__name__}: {message[:300]}")
        assert str(failing) in message, message
        assert mngr.all_steps() == [1, 2]
        # The healthy root still holds exactly what it held (the failed save's own stripe there,
        # if it got that far, is garbage and goes at the next collection).
        after = {k: v for k, v in _files(healthy).items() if k in before}
        assert after == before
        for step in (1, 2):
            assert storage.verify(item_dir(directory, step)) == []
            restored = mngr.restore(step, target=abstract)
            assert all(np.array_equal(restored[k], v) for k, v in _state(step).items())

        mngr.save(4, _state(4), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2, 4]
        restored = mngr.restore(4, target=abstract)
        assert all(np.array_equal(restored[k], v) for k, v in _state(4).items())
        assert orphaned_stripes(mngr) == []
