"""A listing that fails during garbage collection removes no stripe of a listed step.

Found by the I/O-error sweep (`test_io_errors.py`, a trial with seed 2026181483667): libfiu made
the listing of the checkpoint directory fail with ENOENT, garbage collection took the directory
for empty, and every step's stripes were removed while the steps stayed listed.
"""

from __future__ import annotations

import errno
import pathlib

import numpy as np

import cocijax as cj
from cocijax.manager import _gc


def test_a_directory_listing_that_fails_removes_no_stripe(tmp_path, monkeypatch):
    directory = tmp_path / "run"
    with cj.CheckpointManager(
        directory,
        roots=[tmp_path / "root"],
        policy=cj.policies.fixed(10**6),
        exit_on_preemption=False,
    ) as mngr:
        for step in (1, 2):
            mngr.save(step, {"w": np.full(1 << 12, step, np.float32)}, loss=1.0, force=True)
        mngr.wait_until_finished()
        stripe_roots = list(mngr.stripe_roots)
    real_iterdir = pathlib.Path.iterdir

    def failing_iterdir(path):
        if path == directory:
            raise FileNotFoundError(errno.ENOENT, "injected", str(path))
        return real_iterdir(path)

    monkeypatch.setattr(pathlib.Path, "iterdir", failing_iterdir)
    removable = _gc.collect_garbage(directory, stripe_roots)
    monkeypatch.undo()
    assert not [p for p in removable if "cocijax-stripe-" in str(p)], removable
    # Without the fault the same collection finds nothing either: both steps are kept.
    assert not [p for p in _gc.collect_garbage(directory, stripe_roots) if "stripe" in str(p)]
    with cj.CheckpointManager(directory, options=None, exit_on_preemption=False) as mngr:
        assert mngr.all_steps() == [1, 2]
        np.testing.assert_array_equal(mngr.restore(1)["w"], np.full(1 << 12, 1, np.float32))
