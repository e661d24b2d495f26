"""Round trips through the three Orbax entry points, every leaf kind, sharding and re-sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import zarr
from flax import linen as nn
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from storage_helpers import assert_tree_equal

import cocijax as cj
from cocijax.storage._stripes import find_stripe_dirs, referenced_stripe_dirs


def _abstract(tree):
    """ShapeDtypeStruct for jax arrays (keeping their sharding), other leaves unchanged."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


def _every_kind():
    return {
        "f32": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        "bf16": (jnp.arange(6, dtype=jnp.float32) / 7).astype(jnp.bfloat16),
        "i8": jnp.array([-3, 4], jnp.int8),
        "bool": jnp.array([True, False]),
        "scalar0d": jnp.float32(3.5),
        "np": np.linspace(0, 1, 5),
        "np_bf16": np.ones((2, 2), jnp.bfloat16),
        "np_scalar": np.int16(-7),
        "complex": np.array([1 + 2j], np.complex64),
        "py": [1, 2.5, True, -(2**62)],
        "empty": np.zeros((0, 3), np.float32),
        "big": jnp.ones((300, 1000), jnp.float32),  # above small_bytes: a split piece
    }


@pytest.mark.parametrize("entry", ["checkpointer", "async"])
def test_every_leaf_kind_round_trips(tmp_path, roots, entry):
    state = _every_kind()
    handler = cj.StripedCheckpointHandler(roots, small_bytes=1 << 16, piece_bytes=1 << 19)
    make = ocp.Checkpointer if entry == "checkpointer" else ocp.AsyncCheckpointer
    with make(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        if entry == "async":
            ckptr.wait_until_finished()
        restored = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(_abstract(state)))
        as_saved = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore())
    assert_tree_equal(state, restored)
    # Without a target: jax.Arrays stay jax.Arrays, numpy stays numpy, Python stays Python.
    assert_tree_equal(state, as_saved)
    # The big leaf was split and spread over both roots.
    m = cj.storage.read_manifest(tmp_path / "ckpt")
    big = [p for p in m.pieces if m.leaves[p.leaf].path == "['big']"]
    assert len(big) > 1 and {p.root for p in big} == {0, 1}


def test_empty_containers_and_none_survive_a_restore_without_target(tmp_path):
    state = {
        "none": None,
        "dict": {},
        "list": [],
        "tuple": (),
        "empty_state": optax.EmptyState(),
        "nested": {"w": np.ones(2, np.float32), "inner": {}},
    }
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        ckptr.save(tmp_path / "root_empty", args=cj.StripedSave({}))
        as_saved = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore())
        into_target = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(state))
        root_empty = ckptr.restore(tmp_path / "root_empty", args=cj.StripedRestore())
    # Without a target, what Orbax's StandardCheckpointHandler gives: an empty tuple stays a
    # tuple, an empty namedtuple (optax.EmptyState) is None.
    assert {k: v for k, v in as_saved.items() if k != "nested"} == {
        "none": None, "dict": {}, "list": [], "tuple": (), "empty_state": None
    }  # fmt: skip
    assert as_saved["nested"]["inner"] == {}
    np.testing.assert_array_equal(as_saved["nested"]["w"], state["nested"]["w"])
    assert isinstance(into_target["empty_state"], optax.EmptyState)
    assert into_target["tuple"] == () and into_target["none"] is None
    assert root_empty == {}


def test_restore_refuses_an_empty_leaf_where_a_value_was_saved(tmp_path):
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave({"a": np.ones(3), "b": None}))
        with pytest.raises(ValueError, match=r"Leaf \['a'\].*holds a value.*NoneType"):
            ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore({"a": None, "b": None}))
        with pytest.raises(ValueError, match=r"Leaf \['b'\].*holds None or an empty node"):
            ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore({"a": np.ones(3), "b": 1.0}))


def test_optax_and_flax_train_state_round_trip(tmp_path):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    grads = jax.tree.map(jnp.ones_like, params)
    state = state.apply_gradients(grads=grads)  # non-zero Adam moments, step=1
    handler = cj.StripedCheckpointHandler()  # roots=(): data inside the item directory
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        restored = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(_abstract(state)))
        # An abstract state from eval_shape turns the Python step into a 0-d int32 spec.
        from_eval_shape = ckptr.restore(
            tmp_path / "ckpt", args=cj.StripedRestore(jax.eval_shape(lambda: state))
        )
    assert isinstance(restored, train_state.TrainState)
    assert isinstance(restored.opt_state[0], optax.ScaleByAdamState)
    assert_tree_equal(state, restored)
    assert restored.step == 1 and isinstance(restored.step, int)
    assert isinstance(from_eval_shape.step, jax.Array) and int(from_eval_shape.step) == 1
    assert_tree_equal(state.params, from_eval_shape.params)
    # Everything lives in the item directory; no external stripe directories referenced.
    assert referenced_stripe_dirs(tmp_path / "ckpt") == set()
    assert len(find_stripe_dirs(tmp_path / "ckpt")) == 1


def test_checkpoint_manager_with_handler_registry(tmp_path, roots):
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", cj.StripedSave, cj.StripedCheckpointHandler(roots))
    registry.add("state", cj.StripedRestore, cj.StripedCheckpointHandler(roots))
    state = {"w": jnp.arange(10.0), "step": 3}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(
        tmp_path / "run", handler_registry=registry, options=options
    ) as mngr:
        for step in range(3):
            mngr.save(step, args=ocp.args.Composite(state=cj.StripedSave({**state, "step": step})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        got = mngr.restore(2, args=ocp.args.Composite(state=cj.StripedRestore()))
    np.testing.assert_array_equal(got["state"]["w"], np.arange(10.0))
    assert got["state"]["step"] == 2
    item = tmp_path / "run" / "2" / "state"
    assert cj.storage.verify(item) == []
    on_roots = {d for r in roots for d in find_stripe_dirs(r)}
    assert referenced_stripe_dirs(item) <= on_roots


def test_sharded_save_on_8_restores_on_4_and_1(tmp_path, roots):
    assert len(jax.devices()) == 8, "tests/conftest.py simulates 8 CPU devices"
    mesh8 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48)
    y = jnp.arange(40, dtype=jnp.bfloat16)
    state = {
        "x": jax.device_put(x, NamedSharding(mesh8, P("data", "model"))),
        "y": jax.device_put(y, NamedSharding(mesh8, P())),  # replicated: written once
    }
    handler = cj.StripedCheckpointHandler(roots, small_bytes=1024)
    with ocp.AsyncCheckpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        ckptr.wait_until_finished()
        m = cj.storage.read_manifest(tmp_path / "ckpt")
        assert len([p for p in m.pieces if m.leaves[p.leaf].path == "['y']"]) == 1
        assert len([p for p in m.pieces if m.leaves[p.leaf].path == "['x']"]) == 8
        mesh4 = Mesh(np.array(jax.devices()[:4]), ("d",))
        mesh1 = Mesh(np.array(jax.devices()[5:6]), ("d",))
        for mesh, spec in [(mesh4, P(None, "d")), (mesh4, P("d")), (mesh1, P())]:
            sharding = NamedSharding(mesh, spec)
            target = {
                "x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                "y": jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=sharding if spec == P() else
                                          NamedSharding(mesh, P())),
            }  # fmt: skip
            got = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(target))
            assert got["x"].sharding == sharding
            assert {d.id for d in got["x"].devices()} == {d.id for d in mesh.devices.flat}
            np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(x))
            np.testing.assert_array_equal(np.asarray(got["y"]), np.asarray(y))
            for shard in got["x"].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


def test_zarr_python_reads_a_piece_without_cocijax(tmp_path, roots):
    w = np.random.default_rng(0).standard_normal((256, 130)).astype(np.float32)
    handler = cj.StripedCheckpointHandler(roots, small_bytes=1024, compression="zstd")
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave({"w": w}))
    m = cj.storage.read_manifest(tmp_path / "ckpt")
    assert len(m.pieces) == 2
    for piece in m.pieces:
        arr = zarr.open_array(str(m.piece_path(piece, tmp_path / "ckpt")), mode="r")
        region = tuple(slice(a, b) for a, b in zip(piece.start, piece.stop, strict=True))
        np.testing.assert_array_equal(arr[...], w[region])


def test_two_saves_never_share_a_file(tmp_path, roots):
    handler = cj.StripedCheckpointHandler(roots, small_bytes=1024)
    state = {"a": np.ones((64, 64), np.float32), "b": np.zeros(3)}
    with ocp.AsyncCheckpointer(handler) as ckptr:
        ckptr.save(tmp_path / "one", args=cj.StripedSave(state))
        ckptr.save(tmp_path / "two", args=cj.StripedSave(state))
        ckptr.wait_until_finished()
    files = []
    for name in ("one", "two"):
        m = cj.storage.read_manifest(tmp_path / name)
        files.append({m.piece_path(p, tmp_path / name) for p in m.pieces})
    assert files[0] and files[1] and not files[0] & files[1]
    dirs = [referenced_stripe_dirs(tmp_path / n) for n in ("one", "two")]
    assert not dirs[0] & dirs[1]
    assert {d for r in roots for d in find_stripe_dirs(r)} == dirs[0] | dirs[1]


def test_checksums_off_still_round_trips(tmp_path):
    state = {"w": np.arange(100_000, dtype=np.float32)}
    handler = cj.StripedCheckpointHandler(checksums=False, small_bytes=1024, piece_bytes=1 << 16)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        got = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore())
    np.testing.assert_array_equal(got["w"], state["w"])
    m = cj.storage.read_manifest(tmp_path / "ckpt")
    assert m.checksum is None and all(p.checksum is None for p in m.pieces)


@pytest.mark.parametrize("checksums", [True, False])
def test_resharded_restore_reads_parts_of_pieces(tmp_path, roots, checksums):
    # Saved as 8 row blocks, restored as 4 column blocks: every device region is assembled from
    # parts of 8 pieces (straight from TensorStore without checksums, from verified whole
    # pieces with them).
    x = jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48)
    mesh8 = Mesh(np.array(jax.devices()), ("d",))
    handler = cj.StripedCheckpointHandler(roots, small_bytes=1024, checksums=checksums)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(
            tmp_path / "ckpt",
            args=cj.StripedSave({"x": jax.device_put(x, NamedSharding(mesh8, P("d")))}),
        )
        sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), P(None, "d"))
        target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
        got = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(target))
    for shard in got["x"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


def test_replicated_restore_gives_every_device_its_own_buffer(tmp_path, roots):
    # On CPU, jax.device_put adopts the 64-byte-aligned host buffers a restore reads into; a
    # replicated leaf must still get one buffer per device, so that no two replicas share
    # memory (donating one must never change another).
    x = jnp.arange(4096, dtype=jnp.float32)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), P())
    with ocp.Checkpointer(cj.StripedCheckpointHandler(roots)) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave({"x": x}))
        target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
        got = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(target))
    shards = got["x"].addressable_shards
    assert len({s.data.unsafe_buffer_pointer() for s in shards}) == len(shards) == 4
    for s in shards:
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(x))


def test_moved_stripes_restore_and_verify_with_new_roots(tmp_path, roots):
    state = {"w": np.arange(50_000, dtype=np.float32), "b": np.ones(3)}
    handler = cj.StripedCheckpointHandler(roots, small_bytes=1024, piece_bytes=1 << 16)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
    moved = [tmp_path / "elsewhere" / f"disk{i}" for i in range(2)]
    for old, new in zip(roots, moved, strict=True):
        new.parent.mkdir(exist_ok=True)
        old.rename(new)
    item = tmp_path / "ckpt"
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        with pytest.raises(cj.storage.CorruptCheckpointError, match="root0"):
            ckptr.restore(item, args=cj.StripedRestore())
        got = ckptr.restore(item, args=cj.StripedRestore(roots=moved))
        with pytest.raises(ValueError, match="roots must list 2 directories"):
            ckptr.restore(item, args=cj.StripedRestore(roots=moved[:1]))
    assert_tree_equal(state, got)
    assert cj.storage.verify(item, roots=moved) == []
    assert cj.storage.verify(item) != []


def test_saves_of_the_same_shapes_copy_into_the_buffers_of_the_last_one(tmp_path, roots):
    def tree(step, rows=512):
        big = jnp.full((rows, 1024), step, jnp.float32)  # 2 MiB: a piece of its own
        return {"big": big, "small": jnp.arange(16) + step, "n": step}

    host_bytes = 512 * 1024 * 4 + 16 * 4
    handler = cj.StripedCheckpointHandler(roots)
    with ocp.AsyncCheckpointer(handler) as ckptr:
        for step in range(3):
            ckptr.save(tmp_path / str(step), args=cj.StripedSave(tree(step)))
            ckptr.wait_until_finished()
            # Kept for the next save: one host copy of the tree, never one per save.
            assert handler._buffers.nbytes == host_bytes
        ckptr.save(tmp_path / "other", args=cj.StripedSave(tree(9, rows=256)))
        ckptr.wait_until_finished()
        assert handler._buffers.nbytes == 256 * 1024 * 4 + 16 * 4  # the larger ones were freed
        for step in range(3):  # every save wrote its own values, not a later save's
            got = ckptr.restore(tmp_path / str(step), args=cj.StripedRestore())
            assert_tree_equal(got, tree(step))
    assert handler._buffers.nbytes == 0  # close() frees them
    handler = cj.StripedCheckpointHandler(roots, reuse_host_buffers=False)
    with ocp.AsyncCheckpointer(handler) as ckptr:
        ckptr.save(tmp_path / "no-reuse", args=cj.StripedSave(tree(4)))
        ckptr.wait_until_finished()
        assert handler._buffers.nbytes == 0


def test_a_save_of_the_same_structure_reuses_its_plan_with_this_saves_values(tmp_path, roots):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rows, cols = P("data", "model"), P("model", "data")

    def tree(step, spec=rows):
        state = _every_kind()
        state["sharded"] = jax.device_put(
            jnp.full((8, 4), step, jnp.float32), NamedSharding(mesh, spec)
        )
        state["key"] = jax.random.key(step)
        state["py"] = [step, step / 2, step % 2 == 0, f"run-{step}"]
        state["np"] = state["np"] + step
        return state

    handler = cj.StripedCheckpointHandler(roots)
    with ocp.AsyncCheckpointer(handler) as ckptr:
        ckptr.save(tmp_path / "1", args=cj.StripedSave(tree(1)))
        plan = handler._last_layout
        ckptr.save(tmp_path / "2", args=cj.StripedSave(tree(2)))
        assert handler._last_layout is plan  # same structure: described and planned once
        # Same shapes, another sharding: a new plan, and the manifest records the new one.
        ckptr.save(tmp_path / "3", args=cj.StripedSave(tree(3, cols)))
        assert handler._last_layout is not plan
        ckptr.wait_until_finished()
        for step, spec in ((1, rows), (2, rows), (3, cols)):
            got = ckptr.restore(tmp_path / str(step), args=cj.StripedRestore())
            expected = tree(step, spec)
            assert jax.random.key_data(got.pop("key")).tolist() == (
                jax.random.key_data(expected.pop("key")).tolist()
            )
            assert_tree_equal(expected, got)  # every save's own inline values too
            assert got["sharded"].sharding.spec == spec
        bad = tree(4)
        bad["py"][3] = object()  # an unsupported leaf where the plan had a string
        with pytest.raises(cj.storage.UnsupportedLeafError, match=r"\['py'\]\[3\]"):
            ckptr.save(tmp_path / "4", args=cj.StripedSave(bad))
