"""Checkpoints written by cocijax 0.1.0 (before the package split) still list, restore, continue."""

import importlib.util
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj

DATA = Path(__file__).resolve().parents[1] / "data"
OLD = DATA / "v0.1-checkpoint"

_spec = importlib.util.spec_from_file_location("make_v0_1", DATA / "make_v0_1_checkpoint.py")
make_v0_1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_v0_1)


def _assert_same(expected, got):
    assert jax.tree.structure(expected) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        if isinstance(a, int | float):
            assert a == b
        else:
            assert np.asarray(a).dtype == np.asarray(b).dtype
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_v0_1_managed_directory_restores_bit_exact_and_continues(tmp_path):
    directory = tmp_path / "managed"
    shutil.copytree(OLD / "managed", directory)
    policy = cj.policies.coci(mtbf_s=60.0, recovery_s=0.0, total_steps=100)
    expected = make_v0_1.tree(8)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, expected
    )
    # 0.1 stored coci's state by position, without field names: coci's state has grown since
    # (the cost model of its plan), so the schedule restarts; the data must not be touched.
    said = "older cocijax; .* starts its schedule fresh"
    with (
        pytest.warns(RuntimeWarning, match=said),
        cj.CheckpointManager(directory, policy=policy) as mngr,
    ):
        assert mngr.all_steps() == [4, 8]
        _assert_same(expected, mngr.restore(target=abstract))
        assert mngr.save(9, expected, loss=0.3, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8, 9]


def test_a_v0_1_striped_item_restores_from_moved_roots(tmp_path):
    shutil.copytree(OLD / "striped", tmp_path / "striped")
    roots = [tmp_path / "striped" / "r0", tmp_path / "striped" / "r1"]
    item = tmp_path / "striped" / "item"
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        got = ckptr.restore(item, args=cj.StripedRestore(roots=roots))
        _assert_same(jax.tree.map(np.asarray, make_v0_1.tree(5)), jax.tree.map(np.asarray, got))
        with pytest.raises(cj.storage.CorruptCheckpointError, match=r"cocijax-v0\.1"):
            ckptr.restore(item, args=cj.StripedRestore())  # where the roots were: gone
    assert cj.storage.verify(item, roots=roots) == []
