"""Reading a host-local job's copies from several folders (``_cross_read``), in one process.

Two host-local copies of one step are made from a whole one (folder ``host0`` keeps rows 0:4
of ``w`` as process 0's copy, folder ``host1`` rows 4:8 as process 1's), the second folder
recorded in the durable tier as a host-local job's process does when it opens. A manager on
``host0`` then restores the whole ``w`` from both folders; the several-process behaviour is
tested with real processes in tests/reliability/test_host_local.py (``long``).
"""

from __future__ import annotations

import dataclasses
import shutil
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cocijax as cj
from cocijax import storage
from cocijax.manager._cross_read import record_folder
from cocijax.storage._manifest_io import write_manifest


def _open(directory: Path, durable: Path) -> cj.CheckpointManager:
    return cj.CheckpointManager(
        directory, durable=durable, policy=cj.policies.fixed(10**6), exit_on_preemption=False
    )


def _as_holder(item: Path, holder: int, rows: tuple[int, int]) -> None:
    """Rewrites the manifest of ``item`` as process ``holder``'s copy: ``w``'s rows ``rows``."""
    whole = storage.read_manifest(item)
    w = [x.path for x in whole.leaves].index("['w']")
    pieces = tuple(p for p in whole.pieces if p.leaf != w or p.start[0] == rows[0])
    assert sum(p.leaf == w for p in pieces) == 1, whole.pieces  # one shard of ``w`` kept
    write_manifest(item, dataclasses.replace(whole, holder=holder, pieces=pieces))


@pytest.fixture
def two_copies(tmp_path: Path) -> tuple[Path, Path, Path, jax.Array]:
    """``host0`` and ``host1`` hold process 0's and process 1's copies of step 1 (no durable
    copy); returns both folders, the durable tier and the saved ``w``."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    w = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, P("x")))
    host0, host1, durable = tmp_path / "host0", tmp_path / "host1", tmp_path / "durable"
    with _open(host0, durable) as mngr:
        mngr.save(1, {"w": w, "b": np.ones(3, np.float32)}, loss=1.0, force=True)
        mngr.wait_until_finished(durable=True)
        record_folder(types.SimpleNamespace(_directory=host1, _durable=mngr._durable))
    shutil.rmtree(durable / "1")  # the step is in the processes' folders only
    host1.mkdir()
    shutil.copytree(host0 / "1", host1 / "1")
    _as_holder(host0 / "1" / "state", 0, (0, 4))
    _as_holder(host1 / "1" / "state", 1, (4, 8))
    return host0, host1, durable, w


def _target(w: jax.Array) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding),
        "b": jax.ShapeDtypeStruct((3,), np.float32),
    }


def test_a_copy_lacking_rows_is_completed_from_the_other_folder(two_copies):
    host0, _, durable, w = two_copies
    with _open(host0, durable) as mngr:
        restored = mngr.restore(target=_target(w))
        assert (mngr.restored_step, mngr.restored_tier) == (1, "local")
        mngr.wait_until_finished(durable=True)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(restored["b"]), np.ones(3, np.float32))
    # The opening offered step 1 to the durable tier: one process's copy is not a whole step.
    assert not (durable / "1" / "state" / "cocijax_manifest.json").exists()


def test_a_folder_gone_leaves_the_region_not_held(two_copies):
    host0, host1, durable, w = two_copies
    shutil.rmtree(host1)
    with _open(host0, durable) as mngr, pytest.raises(storage.RegionNotHeldError) as e:
        mngr.restore(target=_target(w))
    assert "holds the shards of process 0 only" in str(e.value)
    notes = "\n".join(e.value.__notes__)
    assert "the local copies found hold the shards of process(es) [0] only" in notes, notes
    assert "(tried: local, other processes' local)" in notes, notes
