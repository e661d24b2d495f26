"""SIGKILL during a drain to a real S3 server (moto on 127.0.0.1), then the next open.

A child process saves a state, commits it locally and is killed while its drain is uploading
the pieces: the drain stops once its first piece file is uploaded (``_drain_worker.py`` wraps
the progress callback of ``storage.copy_item``) and says so, and the test kills it then. No
incomplete step may be listed on the durable tier; the next open redoes the drain; no object is
left that no committed step uses; with the local tier wiped, the durable tier restores
bit-exact and the next garbage collection removes the cut drain's objects.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from _drain_worker import state
from reliability_helpers import HERE, child_env

import cocijax as cj
from cocijax import storage

# float32 elements: 16 MiB, two piece files (one per root) of 8 MiB. The worker holds its drain
# once the first is uploaded: the kill lands after a piece and before the manifest, however fast
# the upload is.
SIZE = 4 << 20
MANIFEST = "state/cocijax_manifest.json"


def _kill_mid_drain(tmp_path, s3, steps: list[int]) -> None:
    """Runs the worker and SIGKILLs it once the last step's first piece file is uploaded."""
    cfg = {
        "directory": str(tmp_path / "ckpt"),
        "roots": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")],
        "durable": s3.url("run"),
        "options": s3.options,
        "steps": steps,
        "size": SIZE,
    }
    last = steps[-1]
    stderr = tmp_path / "worker.stderr"
    with stderr.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, str(HERE / "_drain_worker.py"), json.dumps(cfg)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    hang_guard = threading.Timer(300, child.kill)  # a worker that never prints: EOF below
    hang_guard.start()
    try:
        line = child.stdout.readline().strip()
        if line == f"uploaded a piece of {last}":
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        hang_guard.cancel()
        child.stdout.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert line == f"uploaded a piece of {last}", f"{line!r}: {stderr.read_text()[-3000:]}"
    assert child.returncode == -signal.SIGKILL
    keys = s3.keys(f"run/{last}/")
    assert any("/c." in k for k in keys), keys  # chunks of the first piece
    assert f"run/{last}/{MANIFEST}" not in keys, "the manifest was written: not cut mid-drain"


def _no_orphans(s3, mngr: cj.CheckpointManager) -> None:
    """Every object under the durable prefix belongs to a committed step and is used by it
    (besides the lease of the open writer)."""
    for key in s3.keys("run/"):
        if key == "run/cocijax_lease.json":
            continue
        step, _, rest = key.removeprefix("run/").partition("/")
        assert int(step) in mngr.durable_steps(), f"{key}: not of a committed step"
        if rest.startswith("state/cocijax-stripe-"):
            manifest = storage.read_manifest(s3.url(f"run/{step}/state"), root_options=s3.options)
            files = {p.file for p in manifest.pieces}
            piece = rest.removeprefix("state/").split("/c.")[0].removesuffix("/zarr.json")
            assert piece in files, f"{key}: no piece of step {step} uses it"


def _manager(tmp_path, s3, **kwargs) -> cj.CheckpointManager:
    return cj.CheckpointManager(
        tmp_path / "ckpt",
        roots=[tmp_path / "nvme0", tmp_path / "nvme1"],
        policy=cj.policies.fixed(1),
        durable=s3.url("run"),
        durable_options=s3.options,
        **kwargs,
    )


@pytest.mark.multiprocess
def test_a_drain_cut_by_sigkill_is_never_listed_and_the_next_open_redoes_it(tmp_path, s3):
    _kill_mid_drain(tmp_path, s3, steps=[1])
    # A reader (which never drains) lists nothing: the manifest object is the commit.
    with _manager(tmp_path, s3, options=_read_only()) as reader:
        assert reader.durable_steps() == [] and reader.all_steps() == [1]
    with _manager(tmp_path, s3) as mngr:
        mngr.wait_until_finished(durable=True)  # the open redid the drain of step 1
        assert mngr.durable_steps() == [1]
        _no_orphans(s3, mngr)
        restored = mngr.restore(tier="durable")
    np.testing.assert_array_equal(np.asarray(restored["w"]), state(1, SIZE)["w"])


@pytest.mark.multiprocess
def test_with_the_local_tier_wiped_the_durable_tier_restores_and_gc_removes_the_cut_drain(
    tmp_path, s3
):
    _kill_mid_drain(tmp_path, s3, steps=[1, 2])
    for name in ("ckpt", "nvme0", "nvme1"):
        shutil.rmtree(tmp_path / name)
    with _manager(tmp_path, s3) as mngr:
        assert mngr.all_steps() == [1]  # step 2 never committed on the durable tier
        restored = mngr.restore()
        np.testing.assert_array_equal(np.asarray(restored["w"]), state(1, SIZE)["w"])
        assert restored["step"] == 1 and mngr.restored_step == 1
        mngr.save(3, state(3, 1 << 16), loss=1.0)
        mngr.wait_until_finished(durable=True)  # the drain of 3, then garbage collection
        assert mngr.durable_steps() == [1, 3]
        assert not s3.keys("run/2/")
        _no_orphans(s3, mngr)


def _read_only():
    import orbax.checkpoint as ocp

    return ocp.CheckpointManagerOptions(read_only=True)
