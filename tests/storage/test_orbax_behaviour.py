"""The striped handler gives what Orbax's own handlers give, where users rely on it.

Most tests save the same tree with Orbax's handler and with ``StripedCheckpointHandler`` and
compare what comes back: types, dtypes, shardings and values (issue 16, items 2-8).
"""

import json
import shutil

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.metadata import tree as tree_metadata

import cocijax as cj
from cocijax.storage._records import MANIFEST_NAME

# Orbax warns when its own handler restores without shardings; that is what is compared here.
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")


@chex.dataclass
class EmptyChex:
    pass


@flax.struct.dataclass
class EmptyFlax:
    pass


@flax.struct.dataclass
class Pair:
    a: jax.Array
    b: jax.Array


def _mesh(n=8):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _save_both(tmp_path, tree, orbax_handler=None):
    """Saves ``tree`` with Orbax's handler and with the striped one; returns both directories."""
    orbax_handler = orbax_handler or ocp.StandardCheckpointHandler()
    orbax_args = (
        ocp.args.PyTreeSave
        if isinstance(orbax_handler, ocp.PyTreeCheckpointHandler)
        else ocp.args.StandardSave
    )
    with ocp.Checkpointer(orbax_handler) as ckptr:
        ckptr.save(tmp_path / "orbax", args=orbax_args(tree))
    with ocp.Checkpointer(cj.StripedCheckpointHandler([tmp_path / "root"])) as ckptr:
        ckptr.save(tmp_path / "striped", args=cj.StripedSave(tree))
    return tmp_path / "orbax", tmp_path / "striped"


def _restore(path, target=None, handler=None):
    if handler is not None:
        with ocp.Checkpointer(handler) as ckptr:
            return ckptr.restore(path, args=ocp.args.PyTreeRestore(target))
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        return ckptr.restore(path, args=cj.StripedRestore(target))


def _describe(tree):
    """Per leaf: its type family, dtype, sharding and bytes (typed keys: their key data)."""

    def leaf(x):
        if x is None or isinstance(x, bool | int | float | str):
            return (type(x).__name__, x)
        if isinstance(x, jax.Array):
            typed = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            data = jax.random.key_data(x) if typed else x
            sharding = x.sharding
            devices = sorted(d.id for d in sharding.device_set)
            spec = getattr(sharding, "spec", None)
            return ("jax", str(x.dtype), type(sharding).__name__, devices, spec, data.tobytes())
        return (type(x).__name__, str(x.dtype), np.asarray(x).tobytes())

    return jax.tree.map(leaf, tree, is_leaf=lambda x: x is None)


def _assert_same(expected, got):
    assert jax.tree.structure(expected, is_leaf=lambda x: x is None) == jax.tree.structure(
        got, is_leaf=lambda x: x is None
    )
    assert _describe(expected) == _describe(got)


# ------------------------------------------------------------ item 3: restore without target


def _placed_tree():
    mesh = _mesh()
    return {
        "sharded": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("x"))),
        "replicated": jax.device_put(jnp.arange(5), NamedSharding(mesh, P())),
        "on_device_3": jax.device_put(jnp.arange(3.0), jax.devices()[3]),
        "scalar": jnp.float32(2.5),
        "numpy": np.arange(6, dtype=np.int16).reshape(2, 3),
        "python": {"int": 3, "float": 0.5, "bool": True},
        "nested": [jnp.ones(2), (jnp.zeros(1), np.ones(1))],
    }


def test_restore_without_target_gives_what_orbax_gives(tmp_path):
    """jax.Arrays on their saved sharding, numpy as numpy, tuples as lists, like Orbax."""
    orbax_dir, striped_dir = _save_both(tmp_path, _placed_tree())
    expected = _restore(orbax_dir, handler=ocp.PyTreeCheckpointHandler())
    got = _restore(striped_dir)
    _assert_same(expected, got)
    assert isinstance(got["sharded"], jax.Array)
    assert got["sharded"].sharding == NamedSharding(_mesh(), P("x"))
    assert got["on_device_3"].devices() == {jax.devices()[3]}
    assert isinstance(got["numpy"], np.ndarray)


def test_a_target_without_sharding_keeps_the_saved_placement(tmp_path):
    tree = _placed_tree()
    orbax_dir, striped_dir = _save_both(tmp_path, tree)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype) if hasattr(s, "shape") else s, abstract
    )
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        expected = ckptr.restore(orbax_dir, args=ocp.args.StandardRestore(abstract))
    got = _restore(striped_dir, abstract)
    _assert_same(expected, got)


def test_saved_sharding_missing_devices_falls_back_to_the_default_device(tmp_path):
    x = jax.device_put(jnp.arange(16.0), NamedSharding(_mesh(), P("x")))
    _, striped_dir = _save_both(tmp_path, {"x": x})
    # This job "has" one device: the 8-device mesh cannot be rebuilt. Orbax raises here
    # ("Topology mismatch detected"); cocijax places the leaf on the default device.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "devices", lambda *a: jax.local_devices()[:1])
        got = _restore(striped_dir)
    assert got["x"].sharding == SingleDeviceSharding(jax.local_devices()[0])
    np.testing.assert_array_equal(np.asarray(got["x"]), np.arange(16.0))


def test_a_manifest_without_shardings_still_restores(tmp_path):
    """Manifests written before the sharding field existed: jax leaves on the default device."""
    tree = _placed_tree()
    _, striped_dir = _save_both(tmp_path, tree)
    manifest = striped_dir / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    assert any("sharding" in leaf for leaf in data["leaves"])
    for leaf in data["leaves"]:
        leaf.pop("sharding", None)
    data.pop("digest")  # nor had such manifests a digest
    manifest.write_text(json.dumps(data))
    got = _restore(striped_dir)
    default = SingleDeviceSharding(jax.local_devices()[0])
    assert got["sharded"].sharding == default and got["on_device_3"].sharding == default
    np.testing.assert_array_equal(np.asarray(got["sharded"]), np.asarray(tree["sharded"]))
    assert isinstance(got["numpy"], np.ndarray)


def test_restore_without_target_never_narrows(tmp_path):
    with jax.enable_x64(True):
        tree = {"count": jnp.array([2**40, 3], jnp.int64), "f": jnp.array([1e300])}
        _, striped_dir = _save_both(tmp_path, tree)
    with jax.enable_x64(False):
        got = _restore(striped_dir)
    assert isinstance(got["count"], np.ndarray) and got["count"].tolist() == [2**40, 3]
    assert got["f"].dtype == np.float64 and got["f"][0] == 1e300


# ---------------------------------------------------------------------- item 2: PRNG keys


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_prng_keys_round_trip(tmp_path, impl):
    mesh = _mesh()
    keys = jax.random.split(jax.random.key(7, impl=impl), 8)
    tree = {
        "key": jax.random.key(1, impl=impl),
        "sharded": jax.device_put(keys, NamedSharding(mesh, P("x"))),
        "raw": jax.random.PRNGKey(3),  # an old-style uint32 key is a plain array
    }
    orbax_dir, striped_dir = _save_both(tmp_path, tree)
    # Without a target: typed keys of the saved implementation on the saved sharding.
    got = _restore(striped_dir)
    _assert_same(_restore(orbax_dir, handler=ocp.PyTreeCheckpointHandler()), got)
    assert str(jax.random.key_impl(got["sharded"])) == impl
    assert got["sharded"].sharding == NamedSharding(mesh, P("x"))
    # Into targets: jax.eval_shape, and a sharding of another device count.
    assert _describe(_restore(striped_dir, jax.eval_shape(lambda: tree))) == _describe(tree)
    mesh4 = _mesh(4)
    target = {
        "key": jax.ShapeDtypeStruct((), tree["key"].dtype),
        "sharded": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=NamedSharding(mesh4, P("x"))),
        "raw": jax.ShapeDtypeStruct((2,), jnp.uint32),
    }
    got = _restore(striped_dir, target)
    assert got["sharded"].sharding == NamedSharding(mesh4, P("x"))
    for shard in got["sharded"].addressable_shards:
        want = jax.random.key_data(keys)[shard.index]
        np.testing.assert_array_equal(jax.random.key_data(shard.data), want)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(tree["key"]))


def test_typed_prng_key_targets_must_match(tmp_path):
    _, striped_dir = _save_both(tmp_path, {"k": jax.random.key(0), "x": jnp.ones(2, jnp.uint32)})
    other_impl = jax.eval_shape(lambda: jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match=r"\['k'\].*key<rbg>.*holds typed PRNG keys"):
        _restore(striped_dir, {"k": other_impl, "x": np.ones(2, np.uint32)})
    with pytest.raises(ValueError, match=r"\['k'\].*holds typed PRNG keys"):
        _restore(striped_dir, {"k": np.zeros(2, np.uint32), "x": np.ones(2, np.uint32)})
    with pytest.raises(ValueError, match=r"\['x'\].*asks for typed PRNG keys"):
        _restore(striped_dir, {"k": jax.random.key(1), "x": jax.random.split(jax.random.key(1))})


def test_flax_nnx_rngs_state_round_trips(tmp_path):
    """Flax NNX keeps its Rngs as typed keys: the model's state restores into nnx.eval_shape's."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.rngs = rngs

    graphdef, state = nnx.split(Model(nnx.Rngs(0, dropout=1)))
    _, striped_dir = _save_both(tmp_path, state)
    abstract = nnx.eval_shape(lambda: nnx.split(Model(nnx.Rngs(5, dropout=6)))[1])
    restored = _restore(striped_dir, abstract)
    assert _describe(restored) == _describe(state)
    model = nnx.merge(graphdef, restored)
    expected = nnx.merge(graphdef, state).rngs.dropout()
    np.testing.assert_array_equal(
        jax.random.key_data(model.rngs.dropout()), jax.random.key_data(expected)
    )


# --------------------------------------------------------------------------- item 4: metadata


def test_metadata_is_orbax_tree_metadata(tmp_path):
    tree = {**_placed_tree(), "name": "adam", "key": jax.random.key(0)}
    tree_for_orbax = {k: v for k, v in tree.items() if k != "name"}
    orbax_dir, _ = _save_both(tmp_path, tree_for_orbax)
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "with_meta", args=cj.StripedSave(tree, custom_metadata={"epoch": 3}))
    ours = cj.StripedCheckpointHandler().metadata(tmp_path / "with_meta")
    theirs = ocp.StandardCheckpointHandler().metadata(orbax_dir)
    assert isinstance(ours, tree_metadata.TreeMetadata)
    assert ours.custom_metadata == {"epoch": 3}
    assert isinstance(ours.tree["name"], ocp.metadata.StringMetadata)

    def comparable(m):
        if isinstance(m, ocp.metadata.ScalarMetadata):
            return ("scalar", np.dtype(m.dtype))
        return ("array", tuple(m.shape), np.dtype(m.dtype), m.sharding)

    # Orbax describes a typed key by its key data (uint32, shape (2,)); cocijax by the key array.
    mine = {k: v for k, v in ours.tree.items() if k not in ("name", "key")}
    orbax = {k: v for k, v in theirs.tree.items() if k != "key"}
    assert jax.tree.map(comparable, mine) == jax.tree.map(comparable, orbax)
    assert ours.tree["key"].shape == () and str(ours.tree["key"].dtype) == "key<fry>"
    # The manifest stays reachable, and the metadata tree is a valid restore target.
    assert isinstance(cj.storage.read_manifest(tmp_path / "with_meta"), cj.storage.Manifest)
    _assert_same(_restore(tmp_path / "with_meta"), _restore(tmp_path / "with_meta", ours))


def test_checkpoint_manager_item_metadata_and_restore(tmp_path):
    tree = {"w": jax.device_put(jnp.arange(8.0), NamedSharding(_mesh(), P("x"))), "n": 3}
    handler = cj.StripedCheckpointHandler([tmp_path / "root"])
    with ocp.CheckpointManager(tmp_path / "single", item_handlers=handler) as mngr:
        mngr.save(1, args=cj.StripedSave(tree))
        mngr.wait_until_finished()
        assert mngr.item_metadata(1).tree["w"].shape == (8,)
        assert mngr.metadata(1).item_metadata.tree["n"].dtype == np.int64
        _assert_same(tree, mngr.restore(1))
    with ocp.CheckpointManager(
        tmp_path / "multi", item_handlers={"state": cj.StripedCheckpointHandler()}
    ) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=cj.StripedSave(tree)))
        mngr.wait_until_finished()
        assert mngr.item_metadata(1)["state"].tree["w"].dtype == np.float32
        _assert_same(tree, mngr.restore(1).state)
    # A manager opened without handlers finds the handler from the step's metadata.
    for name in ("single", "multi"):
        with ocp.CheckpointManager(tmp_path / name) as mngr:
            restored = mngr.restore(1)
            _assert_same(tree, restored if name == "single" else restored.state)


# ------------------------------------------------------- items 5 and 6: masked and empty nodes


def test_masked_optimizer_state_restores_like_orbax(tmp_path):
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    masked_opt = optax.masked(optax.adam(1e-3), {"a": True, "b": False})
    state = masked_opt.init(params)
    orbax_dir, striped_dir = _save_both(tmp_path, state)
    # With the masked abstract state: MaskedNode back where it was.
    target = jax.eval_shape(lambda: state)
    got = _restore(striped_dir, target)
    assert isinstance(got.inner_state[0].mu["b"], optax.MaskedNode)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        expected = ckptr.restore(orbax_dir, args=ocp.args.StandardRestore(target))
    _assert_same(expected, got)
    # With an unmasked target (arrays where the mask was): None there, as Orbax gives.
    device = SingleDeviceSharding(jax.devices()[0])
    unmasked = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct((2,), jnp.float32, sharding=device)
            if isinstance(x, optax.MaskedNode)
            else x
        ),
        target,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    got = _restore(striped_dir, unmasked)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        expected = ckptr.restore(orbax_dir, args=ocp.args.StandardRestore(unmasked))
    _assert_same(expected, got)
    assert got.inner_state[0].mu["b"] is None
    # Without a target: None, as Orbax gives.
    got = _restore(striped_dir)
    _assert_same(_restore(orbax_dir, handler=ocp.PyTreeCheckpointHandler()), got)
    assert got["inner_state"][0]["mu"]["b"] is None


def test_masked_node_in_target_skips_a_saved_value(tmp_path):
    _, striped_dir = _save_both(tmp_path, {"a": jnp.ones(3), "b": jnp.zeros(2)})
    got = _restore(
        striped_dir, {"a": jax.ShapeDtypeStruct((3,), jnp.float32), "b": optax.MaskedNode()}
    )
    assert isinstance(got["b"], optax.MaskedNode)
    np.testing.assert_array_equal(np.asarray(got["a"]), np.ones(3))


def _empties():
    return {
        "none": None,
        "dict": {},
        "list": [],
        "tuple": (),
        "empty_state": optax.EmptyState(),
        "masked": optax.MaskedNode(),
        "chex": EmptyChex(),
        "flax": EmptyFlax(),
        "x": jnp.ones(2),
    }


def test_empty_nodes_without_target_come_back_as_orbax_gives_them(tmp_path):
    orbax_dir, striped_dir = _save_both(tmp_path, _empties())
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        expected = ckptr.restore(orbax_dir)
    got = _restore(striped_dir)
    _assert_same(expected, got)
    assert {k: v for k, v in got.items() if k != "x"} == {
        "none": None, "dict": {}, "list": [], "tuple": (), "empty_state": None,
        "masked": None, "chex": {}, "flax": None,
    }  # fmt: skip
    # With a target, each empty node comes back as the target's own object.
    into = _restore(striped_dir, _empties())
    assert isinstance(into["chex"], EmptyChex) and isinstance(into["flax"], EmptyFlax)
    assert isinstance(into["empty_state"], optax.EmptyState)


def test_a_manifest_without_field_less_dataclasses_still_restores_into_them(tmp_path):
    """Before empty dataclasses were recorded they had no leaf; such manifests still restore."""
    _, striped_dir = _save_both(tmp_path, {"a": np.ones(2), "z": EmptyChex()})
    manifest = striped_dir / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    assert data["leaves"][-1]["path"] == "['z']"
    data["leaves"].pop()  # what the previous version wrote (without a digest)
    data.pop("digest")
    manifest.write_text(json.dumps(data))
    got = _restore(striped_dir, {"a": np.zeros(2), "z": EmptyChex()})
    assert isinstance(got["z"], EmptyChex) and got["a"].tolist() == [1.0, 1.0]


def test_a_dict_target_restores_a_dataclass_checkpoint(tmp_path):
    """Trees are matched by key names, as Orbax matches them, whatever their node types."""
    _, striped_dir = _save_both(tmp_path, Pair(a=jnp.arange(3), b=jnp.ones(2)))
    got = _restore(striped_dir, {"b": np.zeros(2, np.float32), "a": np.zeros(3, np.int32)})
    assert got["a"].tolist() == [0, 1, 2] and got["b"].tolist() == [1.0, 1.0]


# ------------------------------------------------------------- item 7: strings and bad leaves


def test_strings_round_trip_like_orbax_pytree_handler(tmp_path):
    tree = {"name": "adam", "nested": ["a", "", "ü"], "x": np.ones(2)}
    orbax_dir, striped_dir = _save_both(tmp_path, tree, ocp.PyTreeCheckpointHandler())
    got = _restore(striped_dir)
    _assert_same(_restore(orbax_dir, handler=ocp.PyTreeCheckpointHandler()), got)
    assert got["nested"] == ["a", "", "ü"]
    assert _restore(striped_dir, {**tree, "name": ""})["name"] == "adam"
    with pytest.raises(ValueError, match=r"\['name'\].*holds a string"):
        _restore(striped_dir, {**tree, "name": np.zeros(2)})
    with pytest.raises(ValueError, match=r"\['x'\].*target holds a string"):
        _restore(striped_dir, {**tree, "x": "y"})


def test_unsupported_types_raise_value_error_like_orbax(tmp_path):
    tree = {"o": object()}
    with (
        ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr,
        pytest.raises(ValueError, match="Unsupported type"),
    ):
        ckptr.save(tmp_path / "orbax", args=ocp.args.StandardSave(tree))
    with (
        ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr,
        pytest.raises(ValueError, match=r"Unsupported type object for leaf \['o'\]"),
    ):
        ckptr.save(tmp_path / "striped", args=cj.StripedSave(tree))


# ------------------------------------------------------------- item 8: older calling style


def test_older_calling_style_is_accepted_like_orbax_handlers(tmp_path):
    tree = {"w": np.arange(4.0), "n": 2}
    handler = cj.StripedCheckpointHandler()
    for i, save in enumerate(
        [
            lambda d: handler.save(d, tree),
            lambda d: handler.save(d, item=tree),
            lambda d: handler.save(d, args=cj.StripedSave(tree)),
        ]
    ):
        item = tmp_path / f"h{i}"
        item.mkdir()
        save(item)
        handler.finalize(item)
        target = {"w": np.zeros(4), "n": 0}
        for got in (
            handler.restore(item),
            handler.restore(item, target),
            handler.restore(item, item=target),
        ):
            assert got["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and got["n"] == 2
    # Orbax's Checkpointer turns the older style into StripedSave/StripedRestore itself.
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "c", tree)
        assert ckptr.restore(tmp_path / "c", item={"w": np.zeros(4), "n": 0})["n"] == 2
    with pytest.raises(ValueError, match="StripedSave args, got StandardSave"):
        handler.save(tmp_path / "h0", ocp.args.StandardSave(tree))
    with pytest.raises(ValueError, match="StripedRestore args, got StandardRestore"):
        handler.restore(tmp_path / "h0", ocp.args.StandardRestore(tree))
    with pytest.raises(ValueError, match="nothing to save"):
        handler.save(tmp_path / "h0")
    with pytest.raises(ValueError, match="JSON"):
        handler.save(tmp_path / "h0", cj.StripedSave(tree, custom_metadata={"x": object()}))
    handler.close()


# ------------------------------------------------------------------ partial restore


def test_placeholder_leaves_are_not_read(tmp_path):
    tree = {"params": np.arange(4.0), "opt": {"mu": np.ones(300_000, np.float32)}}
    with ocp.Checkpointer(cj.StripedCheckpointHandler(small_bytes=1024)) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(tree))
    # Delete the placeholder leaf's piece: a restore that skips it must not notice.
    m = cj.storage.read_manifest(tmp_path / "ckpt")
    (mu,) = [p for p in m.pieces if m.leaves[p.leaf].path == "['opt']['mu']"]
    for f in m.piece_path(mu, tmp_path / "ckpt").rglob("*"):
        if f.is_file():
            f.unlink()
    got = _restore(tmp_path / "ckpt", {"params": np.zeros(4), "opt": {"mu": ocp.PLACEHOLDER}})
    assert got["opt"]["mu"] is ocp.PLACEHOLDER and got["params"].tolist() == [0, 1, 2, 3]
    with pytest.raises(cj.storage.CorruptCheckpointError, match=r"\['opt'\]\['mu'\]"):
        _restore(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"saved but not in the target: \['opt'\]\['mu'\]"):
        _restore(tmp_path / "ckpt", {"params": np.zeros(4), "opt": ocp.PLACEHOLDER})


def test_partial_restore_reads_only_the_target_sub_tree_like_orbax(tmp_path):
    tree = {"params": {"w": np.arange(4.0), "b": 3}, "opt": {"mu": np.ones(300_000, np.float32)}}
    with ocp.Checkpointer(cj.StripedCheckpointHandler(small_bytes=1024)) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(tree))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "orbax", args=ocp.args.PyTreeSave(tree))
    target = {"params": {"w": np.zeros(4), "b": 0}}
    # Orbax's own partial restore gives the target's structure with the saved values.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        orbax = ckptr.restore(
            tmp_path / "orbax", args=ocp.args.PyTreeRestore(target, partial_restore=True)
        )
    # The omitted leaf's piece is gone: a partial restore must never read it.
    m = cj.storage.read_manifest(tmp_path / "ckpt")
    (mu,) = [p for p in m.pieces if m.leaves[p.leaf].path == "['opt']['mu']"]
    shutil.rmtree(m.piece_path(mu, tmp_path / "ckpt"))
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        ours = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(target, partial=True))
        assert ours.keys() == orbax.keys() == {"params"}
        assert ours["params"]["w"].tolist() == orbax["params"]["w"].tolist() == [0, 1, 2, 3]
        assert ours["params"]["b"] == 3
        with pytest.raises(ValueError, match=r"never saved: \['params'\]\['v'\]"):
            ckptr.restore(
                tmp_path / "ckpt",
                args=cj.StripedRestore({"params": {"v": np.zeros(4)}}, partial=True),
            )
        with pytest.raises(ValueError, match=r"partial restore .* needs a target"):
            ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(partial=True))
        # Without partial=True an omitted leaf stays an error naming it.
        with pytest.raises(ValueError, match=r"saved but not in the target: \['opt'\]\['mu'\]"):
            ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore(target))
