"""What a parsed manifest must satisfy before anything is read by it.

A manifest is JSON: a damaged one (a flipped byte, a field dropped or retyped, a huge number)
may still parse. Everything the restore and verify paths take from it is checked here first,
so that such a manifest is a :class:`CheckpointFormatError` naming the field, never an
``IndexError`` deep in a restore, an allocation of a made-up size, or a read outside the roots.
What a check cannot see (a changed inline value or dtype that is still valid) is caught by the
manifest's digest (``_codec``); manifests written before the digest lack it.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

from cocijax.storage import _tree
from cocijax.storage._records import CheckpointFormatError, LeafRecord, Manifest

__all__ = ["check_coverage", "check_manifest"]

_KEY_KINDS = {"dict": (str, int), "attr": (str,), "seq": (int,), "flat": (int,), "other": (str,)}
_ARRAY_KINDS = ("jax", "numpy", "np_scalar", _tree.KEY_KIND)
_INLINE_TYPES = {"bool": (bool,), "int": (int,), "float": (float,), _tree.STR_KIND: (str,)}
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
# numpy arrays have at most 64 dimensions, each below 2**63 elements.
_MAX_RANK = 64
_MAX_DIM = 2**62


class _Bad(Exception):
    """A field that breaks the schema (becomes a CheckpointFormatError naming the source)."""


def _int(value: Any, low: int = 0, high: int = _MAX_DIM) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_manifest(manifest: Manifest, source: str) -> None:
    """Raises :class:`CheckpointFormatError` naming ``source`` and the field when ``manifest``
    breaks the schema.

    Checked: every field's type and range; each leaf's kind, dtype, shape and inline value;
    key paths that rebuild one tree (no duplicate, none inside another leaf); each piece's
    leaf and root indices, a file inside its root, and a region inside its leaf.
    """
    try:
        if not all(r is None or (isinstance(r, str) and r) for r in manifest.roots):
            raise _Bad(f"roots must be directory names or null, got {list(manifest.roots)!r}")
        if not (manifest.holder is None or _int(manifest.holder)):
            raise _Bad(f"holder must be a process index or null, got {manifest.holder!r}")
        if not (manifest.checksum is None or isinstance(manifest.checksum, str)):
            raise _Bad(f"checksum must be an algorithm name, got {manifest.checksum!r}")
        for i, leaf in enumerate(manifest.leaves):
            _check_leaf(leaf, f"leaves[{i}]")
        _check_paths(manifest.leaves)
        files_inside: set[str] = set()  # a pack's file holds many pieces: checked once
        for i, piece in enumerate(manifest.pieces):
            where = f"pieces[{i}]"
            if not _int(piece.leaf, high=len(manifest.leaves) - 1):
                raise _Bad(f"{where}.leaf {piece.leaf!r} is not a leaf index")
            leaf = manifest.leaves[piece.leaf]
            if leaf.kind not in _ARRAY_KINDS:
                raise _Bad(f"{where} stores leaf {leaf.path}, whose {leaf.kind} value is inline")
            if not _int(piece.root, high=len(manifest.roots) - 1):
                raise _Bad(f"{where}.root {piece.root!r} is not a root index")
            if not (isinstance(piece.file, str) and piece.file in files_inside):
                if not _inside(piece.file):
                    raise _Bad(
                        f"{where}.file {piece.file!r} is not a relative path inside its root"
                    )
                files_inside.add(piece.file)
            rank = len(leaf.shape)
            if not (len(piece.start) == len(piece.stop) == rank) or not all(
                _int(a) and _int(b) and a <= b <= n
                for a, b, n in zip(piece.start, piece.stop, leaf.shape, strict=True)
            ):
                raise _Bad(
                    f"{where} region {list(piece.start)}..{list(piece.stop)} is not inside "
                    f"leaf {leaf.path} of shape {list(leaf.shape)}"
                )
            if not (piece.offset is None or _int(piece.offset)):
                raise _Bad(f"{where}.offset {piece.offset!r} is not an element offset")
            if not (piece.checksum is None or _int(piece.checksum, high=2**64 - 1)):
                raise _Bad(f"{where}.checksum {piece.checksum!r} is not a 64-bit checksum")
            if not _int(piece.process):
                raise _Bad(f"{where}.process {piece.process!r} is not a process index")
    except _Bad as e:
        raise CheckpointFormatError(f"{source} is malformed: {e}.") from None


def _check_leaf(leaf: LeafRecord, where: str) -> None:
    if not isinstance(leaf.kind, str):
        raise _Bad(f"{where}.kind must be a string, got {leaf.kind!r}")
    if not isinstance(leaf.path, str):
        raise _Bad(f"{where}.path must be a string, got {leaf.path!r}")
    for kind, key in leaf.keys:
        types = _KEY_KINDS.get(kind) if isinstance(kind, str) else None
        if types is None or not isinstance(key, types) or isinstance(key, bool):
            raise _Bad(f"{where}.keys has a bad entry {[kind, key]!r}")
        if kind in ("seq", "flat") and key < 0:
            raise _Bad(f"{where}.keys has a negative index {key!r}")
    if not (isinstance(leaf.shape, tuple) and len(leaf.shape) <= _MAX_RANK):
        raise _Bad(f"{where}.shape must be a list of at most {_MAX_RANK} sizes")
    if not all(_int(n) for n in leaf.shape) or math.prod(leaf.shape) > _MAX_DIM:
        raise _Bad(f"{where}.shape {list(leaf.shape)!r} is not an array shape")
    if leaf.kind in _ARRAY_KINDS:
        if not isinstance(leaf.dtype, str) or leaf.dtype not in _tree.SUPPORTED_DTYPES:
            raise _Bad(f"{where}.dtype {leaf.dtype!r} is not a dtype cocijax saves")
        if leaf.kind == "np_scalar" and leaf.shape != ():
            raise _Bad(f"{where} is a numpy scalar of shape {list(leaf.shape)}")
        if leaf.kind == _tree.KEY_KIND:
            if leaf.key_impl not in _KEY_IMPLS or leaf.dtype != "uint32":
                raise _Bad(f"{where} holds PRNG keys of an unknown kind {leaf.key_impl!r}")
            key_shape = _tree.key_layout(leaf.key_impl)[1]
            if leaf.shape[len(leaf.shape) - len(key_shape) :] != key_shape:
                raise _Bad(f"{where}.shape {list(leaf.shape)} does not end with {key_shape}")
        if not (leaf.sharding is None or isinstance(leaf.sharding, dict)):
            raise _Bad(f"{where}.sharding must be an object, got {leaf.sharding!r}")
        return
    if leaf.kind == _tree.EMPTY_KIND:
        if leaf.value not in _tree.EMPTY_TAGS:
            raise _Bad(f"{where} is an empty node of an unknown kind {leaf.value!r}")
    elif leaf.kind in _INLINE_TYPES:
        types = _INLINE_TYPES[leaf.kind]
        if not isinstance(leaf.value, types) or isinstance(leaf.value, bool) != (
            leaf.kind == "bool"
        ):
            raise _Bad(f"{where} is a {leaf.kind} leaf holding {leaf.value!r}")
    else:
        raise _Bad(f"{where}.kind {leaf.kind!r} is not a leaf kind")
    if leaf.dtype is not None or leaf.shape != ():
        raise _Bad(f"{where}: an inline {leaf.kind} value has no dtype and shape")


def _check_paths(leaves: tuple[LeafRecord, ...]) -> None:
    """Key paths must rebuild one tree: none repeated, none leading into another leaf, and
    the children of a node all indices or all dict keys of one type (as JAX sorts them)."""
    paths = {tuple(leaf.keys) for leaf in leaves}
    if len(paths) != len(leaves):
        raise _Bad("two leaves have the same key path")
    children: dict[tuple, set[str]] = {}
    for leaf in leaves:
        keys = tuple(leaf.keys)
        for n in range(len(keys)):
            if keys[:n] in paths:
                raise _Bad(f"leaf {leaf.path} lies inside another leaf")
            kind, key = keys[n]
            sort = "index" if kind in ("seq", "flat") else type(key).__name__
            children.setdefault(keys[:n], set()).add(sort)
    if any(len(sorts) > 1 for sorts in children.values()):
        raise _Bad("a node mixes list indices and dict keys, or dict keys of two types")


def _inside(file: Any) -> bool:
    if not isinstance(file, str) or not file or "\x00" in file:
        return False
    path = pathlib.PurePosixPath(file)
    return not path.is_absolute() and ".." not in path.parts


def check_coverage(manifest: Manifest, item_dir: object) -> None:
    """Raises :class:`CheckpointFormatError` when an array leaf's pieces do not add up to the
    whole leaf.

    Pieces come from replica-0 shards, which never overlap, so equal volume means full cover: a
    leaf with a missing piece would otherwise restore with a region never written. A host-local
    manifest (``holder`` set) covers its process's shards only: each region a restore reads is
    checked instead (``_targets``).
    """
    if manifest.holder is not None:
        return
    covered = [0] * len(manifest.leaves)
    for p in manifest.pieces:
        covered[p.leaf] += math.prod(p.shape)
    for leaf, n in zip(manifest.leaves, covered, strict=True):
        if leaf.kind in _tree.INLINE_KINDS:
            continue
        if n != leaf.size:
            raise CheckpointFormatError(
                f"Leaf {leaf.path} in {item_dir}: the saved pieces cover {n} of {leaf.size} "
                "elements; a process did not write its shards, or the manifest lost a piece."
            )
