"""Property test: any tree of numpy arrays round-trips bit-exactly under any striping options."""

import tempfile
from pathlib import Path

import hypothesis.extra.numpy as hnp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocijax as cj

DTYPES = st.sampled_from(["float32", "float64", "int8", "uint16", "bool", "complex64"])
ARRAYS = DTYPES.flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    leaves=st.lists(ARRAYS, min_size=1, max_size=6),
    num_roots=st.integers(0, 3),
    small_bytes=st.sampled_from([0, 64, 4096]),
    piece_bytes=st.sampled_from([16, 512, 1 << 20]),
    chunk_bytes=st.sampled_from([8, 1 << 20]),
)
def test_numpy_trees_round_trip_bit_exactly(
    leaves, num_roots, small_bytes, piece_bytes, chunk_bytes
):
    tree = {f"x{i}": leaf for i, leaf in enumerate(leaves)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        handler = cj.StripedCheckpointHandler(
            [tmp / f"r{i}" for i in range(num_roots)],
            small_bytes=small_bytes,
            piece_bytes=piece_bytes,
            chunk_bytes=chunk_bytes,
        )
        item = tmp / "item"
        item.mkdir()
        handler.save(item, cj.StripedSave(tree))
        handler.finalize(item)
        got = handler.restore(item, cj.StripedRestore())
        assert cj.storage.verify(item) == []
        handler.close()
    assert got.keys() == tree.keys()
    for key, leaf in tree.items():
        assert got[key].dtype == leaf.dtype and got[key].shape == leaf.shape, key
        assert got[key].tobytes() == leaf.tobytes(), key
