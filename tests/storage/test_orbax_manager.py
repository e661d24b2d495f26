"""A striped item inside Orbax's own ``ocp.CheckpointManager`` behaves as Orbax's items do.

The behaviours Orbax checks in its ``checkpoint_manager_test.py`` and
``pytree_checkpoint_handler_test.py`` that depend on the item's handler, checked here in our
own words for ``StripedCheckpointHandler``, with synchronous and asynchronous managers.
"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.path import atomicity
from storage_helpers import assert_tree_equal

import cocijax as cj
from cocijax.storage import _manifest_io
from cocijax.storage._stripes import find_stripe_dirs, referenced_stripe_dirs

ASYNC = pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])


def _state(step: int):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {
        "w": jax.device_put(jnp.arange(16.0) + step, NamedSharding(mesh, P("x"))),
        "b": jnp.full((3,), step, jnp.int32),
        "host": np.arange(4) * step,
        "step": step,
    }


def _manager(directory, roots, enable_async, **options):
    return ocp.CheckpointManager(
        directory,
        item_handlers={
            "state": cj.StripedCheckpointHandler(roots),
            "meta": ocp.JsonCheckpointHandler(),
        },
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=enable_async, **options),
    )


def _save(mngr, step, **kwargs):
    args = ocp.args.Composite(
        state=cj.StripedSave(_state(step)), meta=ocp.args.JsonSave({"step": step})
    )
    return mngr.save(step, args=args, **kwargs)


@ASYNC
def test_save_restore_retention_and_reload(tmp_path, enable_async):
    roots = [tmp_path / "r0", tmp_path / "r1"]
    with _manager(tmp_path / "ckpt", roots, enable_async, max_to_keep=2) as mngr:
        for step in range(4):
            assert _save(mngr, step, custom_metadata={"lr": 0.1 * step})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3] and mngr.latest_step() == 3
        # Without args: every item as saved (jax.Arrays on their saved sharding).
        restored = mngr.restore(3)
        assert_tree_equal(_state(3), restored.state)
        assert restored.state["w"].sharding == _state(3)["w"].sharding
        assert restored.meta == {"step": 3}
        # Into an abstract target, one item only.
        abstract = jax.eval_shape(lambda: {k: v for k, v in _state(2).items() if k != "host"})
        got = mngr.restore(
            2,
            args=ocp.args.Composite(
                state=cj.StripedRestore({**abstract, "host": np.zeros(4, np.int64), "step": 0})
            ),
        )
        assert got.state["step"] == 2 and got.state["b"].tolist() == [2, 2, 2]
        assert mngr.item_metadata(3)["state"].tree["w"].shape == (16,)
        assert mngr.metadata(3).custom_metadata == {"lr": pytest.approx(0.3)}
    # A new manager, even without handlers, lists and restores what is on disk.
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        assert mngr.all_steps() == [2, 3]
        assert_tree_equal(_state(2), mngr.restore(2).state)


def test_default_item_and_read_only_manager(tmp_path):
    handler = cj.StripedCheckpointHandler([tmp_path / "r0"])
    with ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=handler) as mngr:
        assert mngr.save(1, args=cj.StripedSave(_state(1)))
        mngr.wait_until_finished()
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=handler, options=options) as mngr:
        assert not mngr.save(2, args=cj.StripedSave(_state(2)))
        assert mngr.all_steps() == [1]
        assert_tree_equal(_state(1), mngr.restore(1))
        assert set(mngr.metadata(1).item_metadata.tree) == {"w", "b", "host", "step"}


def test_restore_from_another_directory(tmp_path):
    """Orbax's test_restore_independent: a pretrained checkpoint stored elsewhere."""
    with _manager(tmp_path / "pretrained", [tmp_path / "r"], False) as other:
        _save(other, 0)
    with _manager(tmp_path / "ckpt", [tmp_path / "r"], False) as mngr:
        args = ocp.args.Composite(state=cj.StripedRestore())
        with pytest.raises(FileNotFoundError):
            mngr.restore(0, args=args)
        got = mngr.restore(0, args=args, directory=tmp_path / "pretrained")
    assert_tree_equal(_state(0), got.state)


@ASYNC
def test_an_unfinished_save_is_never_listed_nor_restored(tmp_path, enable_async):
    """Orbax's test_save_preempted: the temporary directory of a save cut short is not a step."""
    with _manager(tmp_path / "ckpt", [tmp_path / "r"], enable_async) as mngr:
        _save(mngr, 0)
        mngr.wait_until_finished()
        # The rename that commits a step never happens (an async mock: finalize is awaited).
        with mock.patch.object(atomicity.AtomicRenameTemporaryPath, "finalize"):
            _save(mngr, 1)
            mngr.wait_until_finished()
    with _manager(tmp_path / "ckpt", [tmp_path / "r"], enable_async) as mngr:
        assert mngr.all_steps() == [0]
        with pytest.raises(FileNotFoundError):
            mngr.restore(1)
        assert _save(mngr, 1)  # the step can be saved again
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 1]
        assert_tree_equal(_state(1), mngr.restore(1).state)


def test_a_failing_background_write_surfaces_at_wait_and_the_next_save_commits(
    tmp_path, monkeypatch
):
    """Orbax's test_async_error_wait_until_finished, with a write that fails in the background."""
    with _manager(tmp_path / "ckpt", [tmp_path / "r"], True) as mngr:
        with monkeypatch.context() as m:

            def broken(path):
                raise OSError(f"injected failure syncing {path}")

            m.setattr(_manifest_io, "fsync_dir", broken)
            assert _save(mngr, 0)  # returns: the failure happens in the background
            with pytest.raises(OSError, match="injected failure"):
                mngr.wait_until_finished()
        assert mngr.all_steps() == []
        mngr.wait_until_finished()  # the error was reported once
        assert _save(mngr, 1)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]
        assert_tree_equal(_state(1), mngr.restore(1).state)


def test_deleted_steps_and_their_stripes(tmp_path):
    """Orbax deletes a step's item directory; stripes on external roots stay for cocijax's GC.

    With ``roots=()`` the data lives in the item directory and goes with it. With external
    roots, a plain ``ocp.CheckpointManager`` leaves the deleted step's stripe directories on the
    roots: ``cj.CheckpointManager`` collects them; with Orbax's manager,
    ``cj.storage.unreferenced_stripe_dirs`` tells which are garbage and ``remove_tree`` removes
    them.
    """
    with _manager(tmp_path / "inside", (), False, max_to_keep=1) as mngr:
        _save(mngr, 0)
        _save(mngr, 1)
        assert mngr.all_steps() == [1]
    assert not (tmp_path / "inside" / "0").exists()
    root = tmp_path / "root"
    with _manager(tmp_path / "outside", [root], False, max_to_keep=1) as mngr:
        _save(mngr, 0)
        _save(mngr, 1)
        mngr.delete(1)
        _save(mngr, 2)
        kept = referenced_stripe_dirs(tmp_path / "outside" / "2" / "state")
        items = [mngr.directory / str(step) / "state" for step in mngr.all_steps()]
        on_root = set(find_stripe_dirs(root))
        assert kept < on_root and len(on_root - kept) == 2
        garbage = cj.storage.unreferenced_stripe_dirs([root], items)
        assert set(garbage) == on_root - kept
        for stripe in garbage:
            cj.storage.remove_tree(stripe)
        assert set(find_stripe_dirs(root)) == kept
        assert_tree_equal(_state(2), mngr.restore(2).state)


def test_flax_train_state_through_the_manager(tmp_path):
    """Orbax's test_flax_train_state: a sharded TrainState restored into its abstract state."""

    def make(seed):
        params = {"w": jax.random.normal(jax.random.key(seed), (8, 4))}
        return train_state.TrainState.create(
            apply_fn=lambda p, x: x @ p["w"], params=params, tx=optax.adamw(1e-3)
        )

    state = make(0)
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    state = jax.device_put(state, NamedSharding(mesh, P()))
    with ocp.CheckpointManager(
        tmp_path / "ckpt", item_handlers={"state": cj.StripedCheckpointHandler()}
    ) as mngr:
        mngr.save(5, args=ocp.args.Composite(state=cj.StripedSave(state)))
        mngr.wait_until_finished()
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            jax.eval_shape(lambda: make(1)),
        )
        target = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())),
            target,
        )
        got = mngr.restore(5, args=ocp.args.Composite(state=cj.StripedRestore(target))).state
    assert isinstance(got, train_state.TrainState)
    assert_tree_equal(state.params, got.params)
    assert_tree_equal(state.opt_state, got.opt_state)
    assert got.params["w"].sharding == NamedSharding(mesh, P())


def test_partial_restore_with_placeholder_through_the_manager(tmp_path):
    with _manager(tmp_path / "ckpt", [tmp_path / "r"], False) as mngr:
        _save(mngr, 0)
        target = {"w": ocp.PLACEHOLDER, "b": ocp.PLACEHOLDER, "host": np.zeros(4, int), "step": 0}
        got = mngr.restore(0, args=ocp.args.Composite(state=cj.StripedRestore(target))).state
    assert got["w"] is ocp.PLACEHOLDER and got["b"] is ocp.PLACEHOLDER
    assert got["host"].tolist() == [0, 0, 0, 0] and got["step"] == 0


def test_trees_orbax_pytree_tests_use(tmp_path):
    """Keys with slashes and dots, integer keys, lists, zero-size arrays, 0-d arrays, bf16."""
    tree = {
        "a/b": np.arange(3),
        "c.d": {"x": jnp.zeros((0, 4))},
        "ints": {3: np.float32(1.5), 10: jnp.int8(-2)},
        "list": [jnp.ones(2, jnp.bfloat16), [np.array(7)]],
    }
    with ocp.Checkpointer(cj.StripedCheckpointHandler(small_bytes=16)) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(tree))
        assert_tree_equal(tree, ckptr.restore(tmp_path / "ckpt"))
        assert_tree_equal(tree, ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(tree)))
        # A target that lacks a saved leaf, or has one too many, is refused naming both.
        missing = {**tree, "list": [tree["list"][0]]}
        with pytest.raises(ValueError, match=r"saved but not in the target: \['list'\]\[1\]\[0\]"):
            ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(missing))
