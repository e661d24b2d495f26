"""A step's further items: ``extra`` (any Orbax args, Grain's iterator), metrics, custom metadata,
and partial restore, through cj.CheckpointManager with real files."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Mapping

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax import _files, storage


def state_of(seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "params": {"w": jax.random.normal(k1, (4, 8)), "b": jax.random.normal(k2, (8,))},
        "opt": {"mu": jnp.zeros((300_000,), jnp.float32)},
    }


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def dataset():
    return grain.MapDataset.range(1000).shuffle(seed=7).batch(4).to_iter_dataset()


def test_extra_items_of_every_orbax_kind_are_saved_with_the_step_and_restored(tmp_path):
    it = iter(dataset())
    for _ in range(3):
        next(it)
    config = {"lr": 0.1, "layers": [64, 64], "name": "mlp"}
    ema = {"w": np.arange(6.0).reshape(2, 3)}
    tree = {"count": np.int32(7), "table": np.ones(5)}
    state = state_of()
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(2)) as mngr:
        for step in (1, 2):
            mngr.save(
                step,
                state,
                loss=0.5,
                extra={
                    "dataset": grain.checkpoint.CheckpointSave(it),
                    "config": ocp.args.JsonSave(config),
                    "ema": ocp.args.StandardSave(ema),
                    "tree": ocp.args.PyTreeSave(tree),
                },
            )
        mngr.wait_until_finished()
        after_save = [next(it).tolist() for _ in range(2)]  # what the saved iterator yields next
        assert sorted(p.name for p in (tmp_path / "2").iterdir() if p.is_dir()) == [
            "config",
            "dataset",
            "ema",
            "policy",
            "state",
            "tree",
        ]
        assert not (tmp_path / "1").exists()  # the policy did not save step 1: nothing written
        fresh = iter(dataset())
        restored, extra = mngr.restore(
            target=abstract(state),
            extra={
                "dataset": grain.checkpoint.CheckpointRestore(fresh),
                "config": ocp.args.JsonRestore(),
                "ema": ocp.args.StandardRestore(ema),
                "tree": ocp.args.PyTreeRestore(),
            },
        )
        assert extra.keys() == {"dataset", "config", "ema", "tree"}
        assert [next(fresh).tolist() for _ in range(2)] == after_save
        assert extra["dataset"] is fresh
        assert extra["config"] == config
        np.testing.assert_array_equal(extra["ema"]["w"], ema["w"])
        np.testing.assert_array_equal(extra["tree"]["table"], tree["table"])
        np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
        # Without extra, restore returns the state alone, as before.
        alone = mngr.restore(target=abstract(state))
        assert isinstance(alone, dict) and alone.keys() == state.keys()
        with pytest.raises(KeyError, match='"missing" was not found'):
            mngr.restore(extra={"missing": ocp.args.JsonRestore()})
    # Plain Orbax reads the items cocijax wrote (the same files, Orbax's own formats).
    with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(read_only=True)) as o:
        got = o.restore(2, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        assert got["config"] == config


def test_extra_items_commit_with_the_state_in_one_step_directory(tmp_path, monkeypatch):
    # The state's write is held before its commit: no item of the step may be visible yet.
    release = threading.Event()
    fsync_file = _files.fsync_file
    monkeypatch.setattr(_files, "fsync_file", lambda f: (release.wait(60), fsync_file(f)))
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        try:
            assert mngr.save(1, state_of(), loss=1.0, extra={"config": ocp.args.JsonSave({})})
            # Every item goes into the step's one temporary directory; nothing is visible yet.
            # (Orbax creates that directory in the background: save may return before it.)
            deadline = time.monotonic() + 60
            while not (pending := [p for p in tmp_path.iterdir() if p.name.startswith("1.orb")]):
                assert time.monotonic() < deadline, "Orbax never created the step's directory"
                time.sleep(0.01)
            assert len(pending) == 1, pending
            (pending,) = pending
            assert not (tmp_path / "1").exists() and mngr.all_steps() == []
        finally:
            release.set()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]
        assert (tmp_path / "1" / "config").is_dir() and not pending.exists()


class Untouchable(Mapping):
    """A mapping that counts every access: a step that does not save must never read it."""

    def __init__(self, items):
        self._items = dict(items)
        self.touched = 0

    def __getitem__(self, key):
        self.touched += 1
        return self._items[key]

    def __iter__(self):
        self.touched += 1
        return iter(self._items)

    def __len__(self):
        self.touched += 1
        return len(self._items)


def test_extra_metrics_and_metadata_are_not_touched_on_steps_that_do_not_save(tmp_path):
    extra = Untouchable({"config": ocp.args.JsonSave({"a": 1})})
    metrics = Untouchable({"acc": 0.5})
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(5)) as mngr:
        for step in range(1, 5):
            assert not mngr.save(step, state_of(), loss=1.0, extra=extra, metrics=metrics)
        assert extra.touched == metrics.touched == 0
        assert mngr.save(5, state_of(), loss=1.0, extra=extra, metrics=metrics)
        assert extra.touched > 0 and metrics.touched > 0
        mngr.wait_until_finished()
        assert mngr.all_steps() == [5] and (tmp_path / "5" / "config").is_dir()


class NotArgs:
    """Looks like an args object but is no Orbax CheckpointArgs."""

    item = ("a", 1)


def test_bad_extra_items_are_refused_before_anything_is_written(tmp_path):
    state = state_of()
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        cases = [
            ({"config": NotArgs()}, TypeError, r"extra\['config'\]: NotArgs is not an Orbax"),
            ({"config": {"a": 1}}, TypeError, r"extra\['config'\]: dict is not an Orbax"),
            ({"config": ocp.args.JsonRestore()}, TypeError, r"'config'.*for restoring.*JsonSave"),
            ({"state": ocp.args.JsonSave({})}, ValueError, r"extra\['state'\].*reserved"),
            ({"policy": ocp.args.JsonSave({})}, ValueError, r"extra\['policy'\].*reserved"),
            ({"metrics": ocp.args.JsonSave({})}, ValueError, r"extra\['metrics'\].*reserved"),
            ({"a/b": ocp.args.JsonSave({})}, ValueError, r"extra\['a/b'\].*directory"),
            ({3: ocp.args.JsonSave({})}, TypeError, "names must be strings"),
            ([ocp.args.JsonSave({})], TypeError, "extra: expected a dict"),
        ]
        for step, (extra, error, match) in enumerate(cases, start=1):
            with pytest.raises(error, match=match):
                mngr.save(step, state, loss=1.0, extra=extra)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [] and not any(tmp_path.glob("[0-9]*"))
        # The manager goes on: the next step saves.
        assert mngr.save(len(cases) + 1, state, loss=1.0, extra={"c": ocp.args.JsonSave({})})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [len(cases) + 1]
        with pytest.raises(TypeError, match=r"extra\['c'\]: NotArgs"):
            mngr.restore(extra={"c": NotArgs()})
        with pytest.raises(TypeError, match=r"'c'.*for saving.*JsonRestore"):
            mngr.restore(extra={"c": ocp.args.JsonSave({})})
        with pytest.raises(ValueError, match=r"extra\['policy'\].*reserved"):
            mngr.restore(extra={"policy": ocp.args.JsonRestore()})


def test_metrics_and_custom_metadata_are_kept_as_orbax_keeps_them(tmp_path):
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(
            1,
            state_of(),
            loss=1.0,
            metrics={"eval_acc": jnp.float32(0.75), "epoch": np.int64(2)},
            custom_metadata={"run": "abc", "lr": 0.1},
        )
        mngr.save(2, state_of(), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.metrics(1) == {"eval_acc": 0.75, "epoch": 2} and mngr.metrics(2) is None
        assert mngr.orbax.metadata(1).custom_metadata == {"run": "abc", "lr": 0.1}
        with pytest.raises(TypeError, match=r"metrics\['acc'\]: expected a scalar.*\(3,\)"):
            mngr.save(3, state_of(), loss=1.0, metrics={"acc": np.ones(3)})
        with pytest.raises(TypeError, match="metrics: expected a dict"):
            mngr.save(4, state_of(), loss=1.0, metrics=0.5)
        with pytest.raises(TypeError, match="custom_metadata: must be JSON"):
            mngr.save(5, state_of(), loss=1.0, custom_metadata={"x": object()})
        with pytest.raises(TypeError, match="custom_metadata: expected a dict"):
            mngr.save(6, state_of(), loss=1.0, custom_metadata=["x"])
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
    # Orbax's own manager reads both.
    with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(read_only=True)) as o:
        assert o.metrics(1) == {"eval_acc": 0.75, "epoch": 2}
        assert o.metadata(1).custom_metadata == {"run": "abc", "lr": 0.1}


def test_partial_restore_reads_only_the_target_sub_tree(tmp_path):
    state = state_of()
    with cj.CheckpointManager(
        tmp_path / "ck",
        roots=[tmp_path / "r0"],
        policy=cj.policies.fixed(1),
        handler_options={"small_bytes": 1024},
    ) as mngr:
        mngr.save(1, state, loss=1.0)
        mngr.wait_until_finished()
        # The optimizer's piece is deleted: a partial restore of the parameters never reads it.
        m = storage.read_manifest(mngr.item_directory(1))
        (mu,) = [p for p in m.pieces if m.leaves[p.leaf].path == "['opt']['mu']"]
        shutil.rmtree(m.piece_path(mu, mngr.item_directory(1)))
        params = mngr.restore(target={"params": abstract(state["params"])}, partial=True)
        assert params.keys() == {"params"}
        np.testing.assert_array_equal(params["params"]["w"], state["params"]["w"])
        with pytest.raises(storage.CorruptCheckpointError, match=r"\['opt'\]\['mu'\]"):
            mngr.restore(target=abstract(state))
        with pytest.raises(ValueError, match=r"saved but not in the target: \['opt'\]\['mu'\]"):
            mngr.restore(target={"params": abstract(state["params"])})
        never = {"params": {"v": jax.ShapeDtypeStruct((8,), jnp.float32)}}
        with pytest.raises(ValueError, match=r"never saved: \['params'\]\['v'\]"):
            mngr.restore(target=never, partial=True)
        with pytest.raises(ValueError, match="partial=True needs a target"):
            mngr.restore(partial=True)
