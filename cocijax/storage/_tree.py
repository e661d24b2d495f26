"""Pytree flattening for the striped handler: leaf kinds, key-path encoding, rebuilding.

The manifest stores key paths as ``(kind, key)`` pairs rather than a pickled treedef, so a
checkpoint is readable without the code that defined the tree's classes. With a target tree the
structure comes from the target (namedtuples, Flax structs round-trip exactly); without one,
nested dicts and lists are rebuilt from the key paths. Empty containers and ``None`` are
recorded as leaves of kind ``"empty"``, so that they survive a restore without a target too.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_dtypes
import numpy as np

# dtypes the TensorStore zarr3 driver stores (int4 is left out: numpy packs it oddly).
SUPPORTED_DTYPES = frozenset(
    [
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    ]
)  # fmt: skip

SCALAR_KINDS = ("bool", "int", "float")
EMPTY_KIND = "empty"
# Kinds stored in the manifest itself: they have no pieces.
INLINE_KINDS = (*SCALAR_KINDS, EMPTY_KIND)
# What an "empty" leaf held, and how to rebuild it without a target (a tuple becomes a list, as
# every sequence does).
_EMPTY_VALUES = {"none": lambda: None, "dict": dict, "list": list}


def to_dtype(name: str) -> np.dtype:
    """numpy dtype from its name, including the ml_dtypes ones (bfloat16, float8_*)."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def is_empty(x: Any) -> bool:
    """``None`` or an empty dict/list/tuple (an empty namedtuple such as optax's EmptyState too)."""
    return x is None or (isinstance(x, dict | list | tuple) and not x)


def flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(key path, leaf)`` pairs and the treedef; empty containers and ``None`` are leaves."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty)


def empty_tag(leaf: Any) -> str:
    """The manifest value of an empty leaf: ``"none"``, ``"dict"`` or ``"list"``."""
    return "none" if leaf is None else "dict" if isinstance(leaf, dict) else "list"


def rebuild_empty(tag: str) -> Any:
    """A fresh empty container (or None) for a manifest value from :func:`empty_tag`."""
    return _EMPTY_VALUES[tag]()


def leaf_kind(path: Any, leaf: Any) -> str:
    """The manifest kind of ``leaf``.

    Raises:
      TypeError: the leaf type or dtype cannot be saved; the message names the key path.
    """
    if is_empty(leaf):
        return EMPTY_KIND
    if isinstance(leaf, jax.Array):
        kind = "jax"
    elif isinstance(leaf, np.ndarray):
        kind = "numpy"
    elif isinstance(leaf, np.generic):
        kind = "np_scalar"
    elif isinstance(leaf, bool):
        return "bool"
    elif isinstance(leaf, int):
        return "int"
    elif isinstance(leaf, float):
        return "float"
    else:
        raise TypeError(
            f"Leaf {jax.tree_util.keystr(path)}: unsupported type {type(leaf).__name__}; "
            "expected a jax.Array, numpy array, numpy scalar or Python bool/int/float."
        )
    if np.dtype(leaf.dtype).name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"Leaf {jax.tree_util.keystr(path)}: unsupported dtype {np.dtype(leaf.dtype)}; "
            f"expected one of {', '.join(sorted(SUPPORTED_DTYPES))}."
        )
    return kind


def encode_keys(path: Any) -> tuple[tuple[str, Any], ...]:
    """Key path entries as JSON-friendly ``(kind, key)`` pairs."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            plain = isinstance(k.key, str | int) and not isinstance(k.key, bool)
            out.append(("dict", k.key if plain else str(k.key)))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(("attr", k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(("seq", k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(("flat", k.key))
        else:
            out.append(("other", str(k)))
    return tuple(out)


def rebuild(keys: list[tuple[tuple[str, Any], ...]], values: list[Any]) -> Any:
    """Nested dicts (dict and attribute keys) and lists (index keys) from key paths."""
    if len(keys) == 1 and not keys[0]:
        return values[0]
    root: Any = None
    for path, value in zip(keys, values, strict=True):
        root = _insert(root, path, value)
    return _finish(root)


def _insert(node: Any, path: tuple[tuple[str, Any], ...], value: Any) -> Any:
    if not path:
        return value
    (kind, key), rest = path[0], path[1:]
    if kind in ("seq", "flat"):
        node = {} if node is None else node
        node[("__index__", key)] = _insert(node.get(("__index__", key)), rest, value)
    else:
        node = {} if node is None else node
        node[key] = _insert(node.get(key), rest, value)
    return node


def _finish(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, tuple) and k[0] == "__index__" for k in node):
        return [_finish(node[k]) for k in sorted(node, key=lambda k: k[1])]
    return {k: _finish(v) for k, v in node.items()}
