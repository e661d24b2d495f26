"""Assertions shared by the storage tests (imported by file name: tests/ has no packages)."""

import jax
import numpy as np


def assert_tree_equal(expected, got):
    """Same structure, same leaf types, same dtypes and bitwise-equal values."""
    assert jax.tree.structure(expected) == jax.tree.structure(got)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got), strict=True
    ):
        where = jax.tree_util.keystr(path)
        same_type = type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
        assert same_type, (where, type(a), type(b))
        if isinstance(a, bool | int | float | str):
            assert a == b, where
            continue
        assert np.dtype(a.dtype) == np.dtype(b.dtype), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
