"""A root that fills up in the middle of an async save.

One root is an 8 MiB tmpfs mounted by the test (skipped unless root can mount), the other a
directory on the test's disk. After two good saves the tmpfs is filled with a ballast file until
it has room for about half of the next save's stripe, so the next save runs out of space while
TensorStore writes it, in the background. The error must surface from ``wait_until_finished()``
or the next ``save`` and name the root; the earlier steps stay intact; the failed step is never
listed; once the ballast is removed (the operator frees space) the next save succeeds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from reliability_helpers import item_dir

import cocijax as cj
from cocijax import storage
from cocijax.storage._records import STRIPE_PREFIX
from cocijax.storage._stripes import referenced_stripe_dirs

pytestmark = pytest.mark.xdist_group("reliability-mounts")


def _state(step: int) -> dict[str, Any]:
    """About 2 MiB of float32 in a few leaves, so each root gets roughly 1 MiB per save."""
    rng = np.random.default_rng(step)
    return {f"layer{i}": rng.standard_normal((128, 1024)).astype(np.float32) for i in range(4)}


def _abstract() -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0))


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _stripe_bytes_on(root: Path, directory: Path, step: int) -> int:
    total = 0
    for d in referenced_stripe_dirs(item_dir(directory, step)):
        if Path(d).resolve().is_relative_to(root.resolve()):
            total += sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
    return total


def _manager(directory: Path, roots: list[str], **kwargs: Any) -> cj.CheckpointManager:
    # Packs of at most 1 MiB: the default (8 MiB) would put the whole 2 MiB state in one pack
    # on one root, and the disk root would never be written.
    return cj.CheckpointManager(
        directory,
        roots=roots,
        policy=cj.policies.fixed(1),
        handler_options={"small_bytes": 1 << 20},
        **kwargs,
    )


def _save_two_then_fill(
    mngr: cj.CheckpointManager, directory: Path, full_root: Path, tmpfs: Path
) -> Path:
    """Saves steps 1 and 2, then fills ``tmpfs`` (holding ``full_root``) with a ballast file
    until it has room for about half of the next save's share on that root; returns the
    ballast."""
    for step in (1, 2):
        assert mngr.save(step, _state(step), loss=1.0, force=True)
    mngr.wait_until_finished()
    share = _stripe_bytes_on(full_root, directory, 2)
    assert share > 256 * 1024, f"the tmpfs root got only {share} bytes of step 2"
    ballast = tmpfs / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, _free_bytes(tmpfs) - share // 2))
    assert _free_bytes(tmpfs) < share
    return ballast


def _assert_restores(mngr: cj.CheckpointManager, step: int) -> None:
    restored = mngr.restore(step, target=_abstract())
    for k, v in _state(step).items():
        np.testing.assert_array_equal(np.asarray(restored[k]), v)


def test_root_filling_up_mid_save(tmp_path: Path, small_tmpfs: Path) -> None:
    directory = tmp_path / "ckpt"
    full_root = small_tmpfs / "root"
    roots = [str(full_root), str(tmp_path / "disk_root")]
    with _manager(directory, roots, max_to_keep=10) as mngr:
        ballast = _save_two_then_fill(mngr, directory, full_root, small_tmpfs)

        error, raised_by = None, None
        try:
            mngr.save(3, _state(3), loss=1.0, force=True)
        except Exception as e:  # the handler's choice of type; the message is what matters
            error, raised_by = e, "save"
        else:
            try:
                mngr.wait_until_finished()
            except Exception as e:
                error, raised_by = e, "wait_until_finished"
        assert error is not None, "filling the root raised nothing"
        message = str(error)
        print(f"full root error from {raised_by}(): {type(error).__name__}: {message}")
        assert str(full_root) in message, message

        assert 3 not in list(mngr.all_steps())
        assert list(mngr.all_steps()) == [1, 2]
        for step in (1, 2):
            assert storage.verify(item_dir(directory, step)) == []
            _assert_restores(mngr, step)

        ballast.unlink()
        assert mngr.save(4, _state(4), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert list(mngr.all_steps()) == [1, 2, 4]
        _assert_restores(mngr, 4)

    # A new process opening the directory sees the same committed steps and no stray stripes.
    with _manager(directory, roots) as mngr:
        assert list(mngr.all_steps()) == [1, 2, 4]
        referenced = set()
        for step in mngr.all_steps():
            referenced |= {
                Path(p).resolve() for p in referenced_stripe_dirs(item_dir(directory, step))
            }
        on_disk = {
            p.resolve() for r in roots for p in Path(r).rglob(f"{STRIPE_PREFIX}*") if p.is_dir()
        }
        assert on_disk == referenced


def test_a_failed_save_still_lists_the_steps_its_retention_would_have_deleted(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    """Orbax drops the steps a save is to delete from its listing when the save starts, and
    deletes them only once it commits: after a failed save they are on disk, committed, and
    must be listed (and restorable) before the next save, not only after it."""
    directory = tmp_path / "ckpt"
    full_root = small_tmpfs / "root"
    roots = [str(full_root), str(tmp_path / "disk_root")]
    with _manager(directory, roots, max_to_keep=2) as mngr:
        ballast = _save_two_then_fill(mngr, directory, full_root, small_tmpfs)
        with pytest.raises(OSError, match=str(full_root)):
            mngr.save(3, _state(3), loss=1.0, force=True)
            mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        _assert_restores(mngr, 1)

        ballast.unlink()
        assert mngr.save(4, _state(4), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 4]  # retention applies once a save commits
