"""Shared helpers for the storage tests."""

import jax
import numpy as np
import pytest


def assert_tree_equal(expected, got):
    """Same structure, same leaf types, same dtypes and bitwise-equal values."""
    assert jax.tree.structure(expected) == jax.tree.structure(got)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got), strict=True
    ):
        where = jax.tree_util.keystr(path)
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array)), (
            where, type(a), type(b))  # fmt: skip
        if isinstance(a, bool | int | float):
            assert a == b, where
            continue
        assert np.dtype(a.dtype) == np.dtype(b.dtype), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where


@pytest.fixture
def roots(tmp_path):
    return [tmp_path / "root0", tmp_path / "root1"]
