"""Pytree flattening for the striped handler: leaf kinds, key-path encoding, rebuilding.

The manifest stores key paths as ``(kind, key)`` pairs rather than a pickled treedef, so a
checkpoint is readable without the code that defined the tree's classes. With a target tree the
structure comes from the target (namedtuples, Flax structs round-trip exactly); without one,
nested dicts and lists are rebuilt from the key paths. ``None`` and empty nodes (empty
containers, field-less dataclasses, ``optax.EmptyState``, ``optax.MaskedNode``) are recorded as
leaves of kind ``"empty"``, so that they survive a restore without a target too; they then come
back as Orbax's ``StandardCheckpointHandler`` returns them (see :func:`rebuild_empty`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
import optax

# dtypes the TensorStore zarr3 driver stores (int4 is left out: numpy packs it oddly).
SUPPORTED_DTYPES = frozenset(
    [
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    ]
)  # fmt: skip

SCALAR_KINDS = ("bool", "int", "float")
STR_KIND = "str"
EMPTY_KIND = "empty"
# A typed PRNG key array (``jax.random.key``): its key data is stored, its impl recorded.
KEY_KIND = "prng_key"
# Kinds stored in the manifest itself: they have no pieces.
INLINE_KINDS = (*SCALAR_KINDS, STR_KIND, EMPTY_KIND)
# What an "empty" leaf held, and what a restore without a target gives back: what Orbax's
# StandardCheckpointHandler (0.12) gives. Empty namedtuples (optax.EmptyState, MaskedNode) and
# other field-less nodes (a Flax struct) come back as None; a chex dataclass is a Mapping: {}.
# Manifests written before "tuple" existed recorded an empty tuple as "list".
_EMPTY_VALUES = {
    "none": lambda: None,
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "namedtuple": lambda: None,
    "masked": lambda: None,
    "node": lambda: None,
}


# The manifest values of empty leaves (see empty_tag).
EMPTY_TAGS = tuple(_EMPTY_VALUES)


class UnsupportedLeafError(ValueError, TypeError):
    """A leaf of a type or dtype the handler cannot save.

    A ``ValueError`` as Orbax's handlers raise for unsupported types (so ``except ValueError``
    written for Orbax keeps working) and a ``TypeError`` as cocijax raised before.
    """


@functools.cache
def dtype_name(dtype: Any) -> str:
    """``np.dtype(dtype).name``, cached: numpy computes it in Python, ~10 us a call, per leaf."""
    return np.dtype(dtype).name


@functools.cache
def to_dtype(name: str) -> np.dtype:
    """numpy dtype from its name, including the ml_dtypes ones (bfloat16, float8_*); cached."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


# Leaf types, checked first: is_empty runs on every node of every tree saved or restored.
_PLAIN_LEAVES = (jax.Array, np.ndarray, np.generic, int, float, str, jax.ShapeDtypeStruct)


def is_empty(x: Any) -> bool:
    """``None``, or a pytree node without children.

    Empty dicts, lists and tuples, empty namedtuples (optax's ``EmptyState`` and ``MaskedNode``)
    and field-less registered dataclasses (chex, Flax structs).
    """
    if x is None:
        return True
    if isinstance(x, _PLAIN_LEAVES):
        return False
    if isinstance(x, dict | list | tuple):
        return not x
    # Any other registered node: flatten exactly one level (every child counts as a leaf).
    # A leaf is returned as itself, so only a node without children gives [].
    return not jax.tree_util.tree_leaves(x, is_leaf=lambda y: y is not x)


def is_typed_key(x: Any) -> bool:
    """Whether ``x`` (an array or a ``jax.ShapeDtypeStruct``) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):  # every numpy dtype: not a key (fast path)
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def key_layout(impl: str) -> tuple[Any, tuple[int, ...]]:
    """The key dtype (``key<fry>``...) of PRNG implementation ``impl`` and its key data shape."""
    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return key.dtype, tuple(data.shape)


def flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(key path, leaf)`` pairs and the treedef; ``None`` and empty nodes are leaves."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty)


def empty_tag(leaf: Any) -> str:
    """The manifest value of an empty leaf (see :func:`rebuild_empty`)."""
    if leaf is None:
        return "none"
    if isinstance(leaf, optax.MaskedNode):
        return "masked"
    if isinstance(leaf, tuple):
        return "namedtuple" if hasattr(leaf, "_fields") else "tuple"
    if isinstance(leaf, list):
        return "list"
    if isinstance(leaf, Mapping):  # dict, and chex dataclasses (they are Mappings)
        return "dict"
    return "node"


def rebuild_empty(tag: str) -> Any:
    """What a restore without a target gives for a manifest value from :func:`empty_tag`.

    ``None`` stays None, ``{}`` (and a field-less chex dataclass) is ``{}``, ``[]`` is ``[]``,
    ``()`` is ``()``; empty namedtuples (``optax.EmptyState``, ``optax.MaskedNode``) and other
    field-less nodes (a Flax struct) are None.
    """
    return _EMPTY_VALUES[tag]()


def leaf_kind(path: Any, leaf: Any) -> str:
    """The manifest kind of ``leaf``.

    Raises:
      UnsupportedLeafError: the leaf type or dtype cannot be saved (a ``ValueError`` and a
        ``TypeError``); the message names the key path.
    """
    if is_empty(leaf):
        return EMPTY_KIND
    if isinstance(leaf, jax.Array) and is_typed_key(leaf):
        return KEY_KIND
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
    elif isinstance(leaf, str):
        return STR_KIND
    else:
        raise UnsupportedLeafError(
            f"Unsupported type {type(leaf).__name__} for leaf {jax.tree_util.keystr(path)}: "
            "expected a jax.Array (typed PRNG keys included), numpy array, numpy scalar, "
            "Python bool/int/float/str, None or an empty node."
        )
    if dtype_name(leaf.dtype) not in SUPPORTED_DTYPES:
        raise UnsupportedLeafError(
            f"Unsupported dtype {np.dtype(leaf.dtype)} for leaf {jax.tree_util.keystr(path)}: "
            f"expected one of {', '.join(sorted(SUPPORTED_DTYPES))}."
        )
    return kind


def check_tree(tree: Any) -> None:
    """Checks that the handler can save every leaf of ``tree``, without touching the data.

    For callers that must refuse a tree before starting background work (a manager, before
    Orbax starts its threads).

    Raises:
      TypeError: a leaf's type or dtype cannot be saved; the message names the leaf's path.

    Example:
      >>> check_tree({"w": [1.0, 2.0], "bad": {"leaf": object()}})
      Traceback (most recent call last):
      ...
      UnsupportedLeafError: Leaf ['bad']['leaf']: unsupported type object; ...
    """
    for path, leaf in flatten(tree)[0]:
        leaf_kind(path, leaf)


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


def plain_path(keys: tuple[tuple[str, Any], ...]) -> tuple[str | int, ...]:
    """An encoded key path with dict keys and attribute names alike, indices as ints.

    Trees are matched on these, as Orbax matches them: a dict target restores a dataclass's
    checkpoint (and the reverse), whatever order each flattens its children in.
    """
    return tuple(k if kind in ("seq", "flat") else str(k) for kind, k in keys)


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
