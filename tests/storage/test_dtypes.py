"""No restore changes a value silently: every dtype, with ``jax_enable_x64`` on and off.

With x64 off, JAX stores 64-bit types in 32 bits. A leaf saved as int64/float64/uint64/complex128
(numpy, or a jax.Array saved while x64 was on) must come back bit-exact as numpy when no
placement is asked for, and raise an error naming the leaf and both dtypes when a sharding is.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import SingleDeviceSharding

import cocijax as cj

# Every dtype the handler stores, with a value that a narrower type could not hold.
VALUES = {
    "bool": np.array([True, False]),
    "int8": np.array([-128, 127], np.int8),
    "int16": np.array([-(2**15), 2**15 - 1], np.int16),
    "int32": np.array([-(2**31), 2**31 - 1], np.int32),
    "int64": np.array([2**40 + 1, -(2**62)], np.int64),
    "uint8": np.array([0, 255], np.uint8),
    "uint16": np.array([0, 2**16 - 1], np.uint16),
    "uint32": np.array([0, 2**32 - 1], np.uint32),
    "uint64": np.array([2**63 + 5, 1], np.uint64),
    "float16": np.array([0.1, -65504.0], np.float16),
    "float32": np.array([0.1, 3.0e38], np.float32),
    "float64": np.array([1.0000000000000002, 1e300], np.float64),
    "bfloat16": np.array([0.1, 3.0], jax.numpy.bfloat16),
    "complex64": np.array([1 + 2j], np.complex64),
    "complex128": np.array([1e300 + 1e-300j], np.complex128),
    "float8_e4m3fn": np.array([0.5, 2.0], jax.numpy.float8_e4m3fn),
    "float8_e5m2": np.array([0.5, 2.0], jax.numpy.float8_e5m2),
}
WIDE = {"int64", "uint64", "float64", "complex128"}  # narrowed by JAX when x64 is off


def _save(path, tree):
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        ckptr.save(path, args=cj.StripedSave(tree))


def _restore(path, target):
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        return ckptr.restore(path, args=cj.StripedRestore(target))


def _assert_exact(expected: np.ndarray, got) -> None:
    got = np.asarray(got)
    assert got.dtype == expected.dtype
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_dtype_restores_exactly_or_raises(tmp_path, name, x64):
    value = VALUES[name]
    with jax.enable_x64(x64):
        _save(tmp_path / "ckpt", {"leaf": value})
        device = SingleDeviceSharding(jax.devices()[0])
        # No placement asked for: exact, whatever JAX could hold.
        unplaced = _restore(
            tmp_path / "ckpt", {"leaf": jax.ShapeDtypeStruct(value.shape, value.dtype)}
        )
        _assert_exact(value, unplaced["leaf"])
        _assert_exact(value, _restore(tmp_path / "ckpt", None)["leaf"])
        placed_target = {"leaf": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=device)}
        if name in WIDE and not x64:
            with pytest.raises(ValueError, match=rf"\['leaf'\].*holds {name}.*narrow it to"):
                _restore(tmp_path / "ckpt", placed_target)
            assert isinstance(unplaced["leaf"], np.ndarray)
        else:
            placed = _restore(tmp_path / "ckpt", placed_target)["leaf"]
            assert isinstance(placed, jax.Array)
            _assert_exact(value, placed)


def test_a_jax_int64_saved_with_x64_restores_exactly_without_it(tmp_path):
    with jax.enable_x64(True):
        saved = jax.numpy.array([2**40, 7], jax.numpy.int64)
        _save(tmp_path / "ckpt", {"count": saved})
    with jax.enable_x64(False):
        out = _restore(tmp_path / "ckpt", {"count": jax.ShapeDtypeStruct((2,), np.int64)})
        assert out["count"].tolist() == [2**40, 7]
        with pytest.raises(ValueError, match=r"\['count'\].*int64.*int32"):
            _restore(
                tmp_path / "ckpt",
                {
                    "count": jax.ShapeDtypeStruct(
                        (2,), np.int64, sharding=SingleDeviceSharding(jax.devices()[0])
                    )
                },
            )


def test_python_scalars_restore_only_into_targets_that_hold_them(tmp_path):
    _save(tmp_path / "ckpt", {"big": 2**40, "frac": 0.1, "small": 3, "flag": True})
    ok = _restore(
        tmp_path / "ckpt",
        {
            "big": jax.ShapeDtypeStruct((), np.int64),  # x64 off: numpy, exact
            "frac": np.float64(0),
            "small": jax.ShapeDtypeStruct((), np.int32),
            "flag": False,
        },
    )
    assert ok["big"] == 2**40 and isinstance(ok["big"], np.ndarray)
    assert ok["frac"] == 0.1 and isinstance(ok["small"], jax.Array) and ok["small"] == 3
    for leaf, target in (
        ("big", jax.ShapeDtypeStruct((), np.int32)),  # overflows int32
        ("frac", jax.ShapeDtypeStruct((), np.float32)),  # 0.1 is not a float32
    ):
        tree = {"big": 0, "frac": 0.0, "small": 0, "flag": False, leaf: target}
        with pytest.raises(ValueError, match=rf"\['{leaf}'\].*cannot hold"):
            _restore(tmp_path / "ckpt", tree)


def test_a_python_scalar_target_refuses_an_inexact_conversion(tmp_path):
    _save(tmp_path / "ckpt", {"x": np.float32(2.5), "n": np.int64(5)})
    with pytest.raises(ValueError, match=r"\['x'\].*Python int.*2\.5"):
        _restore(tmp_path / "ckpt", {"x": 0, "n": 0})
    assert _restore(tmp_path / "ckpt", {"x": 0.0, "n": 0}) == {"x": 2.5, "n": 5}
