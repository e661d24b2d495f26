"""What a striped checkpoint's manifest records, and the errors its readers raise.

The manifest is the commit record of a save. It lives in the Orbax item directory and is written
last, after every piece it names is durable; a checkpoint without it is incomplete. It records the
tree (key paths and leaf kinds), each leaf's dtype and global shape, and per piece the root index,
the file (relative to its root), the global index range and a checksum of the logical bytes.
Its JSON form is ``_codec``'s; its file is read and written by ``_manifest_io``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from cocijax.storage import _kvpath
from cocijax.storage._kvpath import KvPath

# A directory as the storage functions take it: a local path, or an object-store URL or KvPath.
Location = os.PathLike | str | KvPath

MANIFEST_NAME = "cocijax_manifest.json"
"""File name of the manifest inside an Orbax item directory."""

STRIPE_PREFIX = "cocijax-stripe-"
"""Every directory a save creates on a root starts with this, so GC can recognise our data."""

FORMAT = "cocijax-striped-checkpoint"
VERSION = 1
# TensorStore ends its errors with the JSON spec of the array it opened: hundreds of characters.
_TS_SPEC = re.compile(r"\s*\[tensorstore_spec='.*?'\]")


class CheckpointFormatError(ValueError):
    """The manifest is missing, is not valid JSON, or was not written by cocijax."""


class RegionNotHeldError(CheckpointFormatError):
    """A host-local copy (``Manifest.holder``) does not hold a region the restore needs: it
    holds one process's shards only. Not damage: another copy of the step may hold it."""


class CorruptCheckpointError(RuntimeError):
    """A piece named by the manifest is missing, truncated or fails its checksum."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One defect found by :func:`verify`.

    Attributes:
      leaf_path: key path of the affected leaf (``jax.tree_util.keystr`` form); ``""`` when the
        defect is not tied to one leaf (e.g. an unreadable manifest).
      file: the file or directory at fault.
      message: what is wrong, expected vs found.
    """

    leaf_path: str
    file: str
    message: str

    @property
    def what(self) -> str:
        """What is wrong, in one short line: :attr:`message` without what the other fields say.

        The leaf and the file are dropped from the message (they are :attr:`leaf_path` and
        :attr:`file`), and so is the JSON spec TensorStore appends to its errors.
        """
        text = _TS_SPEC.sub("", self.message)
        if self.leaf_path:
            text = text.removeprefix(f"Leaf {self.leaf_path}: ")
        if self.file:
            text = text.removesuffix(f" in piece {self.file}.").replace(f"{self.file}/", "")
        return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """One leaf of the saved tree.

    Attributes:
      path: ``jax.tree_util.keystr`` of the leaf's key path.
      keys: the key path as ``(kind, key)`` pairs, enough to rebuild nested dicts/lists.
      kind: ``"jax"``, ``"numpy"``, ``"np_scalar"``, ``"prng_key"`` (a typed PRNG key array),
        ``"bool"``, ``"int"``, ``"float"``, ``"str"`` or ``"empty"`` (None or an empty node).
      dtype: numpy dtype name for array kinds (for ``"prng_key"``, of the key data: uint32),
        ``None`` for Python scalars and strings.
      shape: global shape (``()`` for scalars); for ``"prng_key"``, of the key data (the key
        array's shape followed by the implementation's key shape).
      value: the value itself for Python scalars and strings (stored inline); for empty
        leaves what they were (``"none"``, ``"dict"``, ``"list"``, ``"tuple"``,
        ``"namedtuple"``, ``"masked"`` or ``"node"``); else ``None``.
      sharding: the ``jax.Array``'s sharding at save time, as Orbax's sharding metadata JSON
        (``NamedSharding`` and ``SingleDeviceSharding``); ``None`` for other leaves, other
        sharding types, and manifests written before this field existed.
      key_impl: for ``"prng_key"``, the PRNG implementation (``"threefry2x32"``, ``"rbg"``,
        ``"unsafe_rbg"``).
    """

    path: str
    keys: tuple[tuple[str, Any], ...]
    kind: str
    dtype: str | None
    shape: tuple[int, ...]
    value: Any = None
    sharding: dict[str, Any] | None = None
    key_impl: str | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class PieceRecord:
    """One stored region of one leaf.

    Attributes:
      leaf: index into ``Manifest.leaves``.
      root: index into ``Manifest.roots``.
      file: zarr array directory relative to its root (``<stripe dir>/<name>``).
      start: global index where the region starts, one entry per dimension.
      stop: global index where the region stops (exclusive).
      offset: for a packed piece, the element offset of this region inside the flat 1-D zarr
        array that packs several small leaves; ``None`` when the zarr array holds exactly the
        region with the leaf's rank.
      checksum: xxh3_64 of the region's C-order bytes, ``None`` when checksums were off.
      process: index of the process that wrote it.
    """

    leaf: int
    root: int
    file: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    offset: int | None = None
    checksum: int | None = None
    process: int = 0

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:  # cached: a restore asks several times per piece
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed manifest (or manifest part).

    Attributes:
      version: format version.
      checksum: checksum algorithm (``"xxh3_64"``) or ``None``.
      roots: absolute root directories or object-store URLs (``s3://bucket/prefix``);
        ``None`` stands for the item directory itself.
      leaves: the tree's leaves in flattening order.
      pieces: every stored region.
      custom_metadata: the JSON value given as ``StripedSave(custom_metadata=...)``, or None.
      holder: a host-local manifest: the index of the process whose local copy this is; its
        pieces cover that process's addressable shards only, not the whole tree. ``None``: the
        pieces cover every leaf.
    """

    version: int
    checksum: str | None
    roots: tuple[str | None, ...]
    leaves: tuple[LeafRecord, ...]
    pieces: tuple[PieceRecord, ...]
    custom_metadata: Any = None
    holder: int | None = None

    def root_dir(
        self, index: int, item_dir: Location, options: Mapping[str, Any] | None = None
    ) -> pathlib.Path | KvPath:
        """Root ``index``: a local directory, or a :class:`KvPath` opened with ``options``."""
        root = self.roots[index]
        return _kvpath.location(item_dir if root is None else root, options)

    def piece_path(
        self, piece: PieceRecord, item_dir: Location, options: Mapping[str, Any] | None = None
    ) -> pathlib.Path | KvPath:
        return self.root_dir(piece.root, item_dir, options) / piece.file

    def with_roots(self, roots: Sequence[os.PathLike | str | None] | None) -> Manifest:
        """This manifest reading its pieces from ``roots`` instead of the recorded roots.

        For stripes that were moved (e.g. to other mount points): ``roots[i]`` replaces
        recorded root ``i``; ``None`` entries mean the item directory. ``None`` changes nothing.

        Raises:
          ValueError: ``roots`` has a different length than the recorded roots.
        """
        if roots is None:
            return self
        if isinstance(roots, str | os.PathLike) or len(roots) != len(self.roots):
            raise ValueError(
                f"roots must list {len(self.roots)} directories (one per root the checkpoint "
                f"was striped over, in order: {list(self.roots)}), got {roots!r}."
            )
        moved = tuple(None if r is None else _root_string(r) for r in roots)
        return dataclasses.replace(self, roots=moved)

    def in_item_dir(self) -> Manifest:
        """This manifest with every piece under the item directory itself (one root, ``None``).

        What a copy of the item that keeps all its pieces inside its own directory records
        (see ``copy_item``); piece files keep their names (``<stripe dir>/<piece>``).
        """
        return dataclasses.replace(
            self,
            roots=(None,),
            pieces=tuple(dataclasses.replace(p, root=0) for p in self.pieces),
        )


def _root_string(root: Location) -> str:
    """How a manifest records a root: an absolute path, or an object-store URL."""
    where = _kvpath.location(root)
    return where.url if isinstance(where, KvPath) else str(where.absolute())
