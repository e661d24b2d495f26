"""The JSON manifest of a striped checkpoint: schema, atomic write, read, merge and GC helpers.

The manifest is the commit record of a save. It lives in the Orbax item directory and is written
last, after every piece it names is durable; a checkpoint without it is incomplete. It records the
tree (key paths and leaf kinds), each leaf's dtype and global shape, and per piece the root index,
the file (relative to its root), the global index range and a checksum of the logical bytes.

Multi-process saves write one *part* per process (only the pieces that process wrote); the
primary process merges the parts into the manifest in the handler's ``finalize``, which Orbax
calls once every process's commit has finished.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

from cocijax._files import fsync_dir, replace_bytes
from cocijax._files import remove_tree as remove_local_tree
from cocijax.storage import _kvpath, _schema, _tree
from cocijax.storage._digest import check_digest, with_digest
from cocijax.storage._kvpath import KvPath

# A directory as the storage functions take it: a local path, or an object-store URL or KvPath.
Location = os.PathLike | str | KvPath

log = logging.getLogger(__name__)

MANIFEST_NAME = "cocijax_manifest.json"
"""File name of the manifest inside an Orbax item directory."""

PART_PREFIX = "cocijax_manifest.part-"
STRIPE_PREFIX = "cocijax-stripe-"
"""Every directory a save creates on a root starts with this, so GC can recognise our data."""

FORMAT = "cocijax-striped-checkpoint"
VERSION = 1
# TensorStore ends its errors with the JSON spec of the array it opened: hundreds of characters.
_TS_SPEC = re.compile(r"\s*\[tensorstore_spec='.*?'\]")


class CheckpointFormatError(ValueError):
    """The manifest is missing, is not valid JSON, or was not written by cocijax."""


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
    """

    version: int
    checksum: str | None
    roots: tuple[str | None, ...]
    leaves: tuple[LeafRecord, ...]
    pieces: tuple[PieceRecord, ...]
    custom_metadata: Any = None

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

    def to_json(self) -> dict[str, Any]:
        data = {
            "format": FORMAT,
            "version": self.version,
            "checksum": self.checksum,
            "roots": list(self.roots),
            "leaves": [_leaf_json(leaf) for leaf in self.leaves],
            "pieces": [
                {
                    "leaf": p.leaf,
                    "root": p.root,
                    "file": p.file,
                    "start": list(p.start),
                    "stop": list(p.stop),
                    "offset": p.offset,
                    "checksum": p.checksum,
                    "process": p.process,
                }
                for p in self.pieces
            ],
        }
        if self.custom_metadata is not None:
            data["custom_metadata"] = self.custom_metadata
        return with_digest(data)

    @classmethod
    def from_json(cls, data: Any, source: str = "<manifest>") -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointFormatError(
                f"{source} is not a cocijax manifest: expected a JSON object with "
                f"format={FORMAT!r}."
            )
        if data.get("version") != VERSION:
            raise CheckpointFormatError(
                f"{source} has format version {data.get('version')!r}; this cocijax reads "
                f"version {VERSION}."
            )
        try:
            leaves = tuple(
                LeafRecord(
                    path=d["path"],
                    keys=tuple((k[0], k[1]) for k in d["keys"]),
                    kind=d["kind"],
                    dtype=d["dtype"],
                    shape=tuple(d["shape"]),
                    value=d.get("value"),
                    # Optional fields: manifests written before they existed lack them.
                    sharding=d.get("sharding"),
                    key_impl=d.get("key_impl"),
                )
                for d in data["leaves"]
            )
            pieces = tuple(
                PieceRecord(
                    leaf=d["leaf"],
                    root=d["root"],
                    file=d["file"],
                    start=tuple(d["start"]),
                    stop=tuple(d["stop"]),
                    offset=d.get("offset"),
                    checksum=d.get("checksum"),
                    process=d.get("process", 0),
                )
                for d in data["pieces"]
            )
            manifest = cls(
                version=data["version"],
                checksum=data["checksum"],
                roots=tuple(data["roots"]),
                leaves=leaves,
                pieces=pieces,
                custom_metadata=data.get("custom_metadata"),
            )
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise CheckpointFormatError(f"{source} is malformed: {e!r}.") from e
        _schema.check_manifest(manifest, source, CheckpointFormatError)
        if not check_digest(data):
            raise CheckpointFormatError(
                f"{source} does not match its digest: it was changed after it was written."
            )
        return manifest


def _root_string(root: Location) -> str:
    """How a manifest records a root: an absolute path, or an object-store URL."""
    where = _kvpath.location(root)
    return where.url if isinstance(where, KvPath) else str(where.absolute())


def _leaf_json(leaf: LeafRecord) -> dict[str, Any]:
    data = {
        "path": leaf.path,
        "keys": [list(k) for k in leaf.keys],
        "kind": leaf.kind,
        "dtype": leaf.dtype,
        "shape": list(leaf.shape),
        "value": leaf.value,
    }
    # Written only when set, so a manifest without them reads the same in any version.
    if leaf.sharding is not None:
        data["sharding"] = leaf.sharding
    if leaf.key_impl is not None:
        data["key_impl"] = leaf.key_impl
    return data


def _read_json(path: pathlib.Path | KvPath) -> Manifest:
    """The manifest (or part) at ``path``, parsed and checked once per version of its bytes.

    Every reader of a manifest comes here: the commit check of a listing, garbage collection's
    callers, a restore, a merge. A file is read whole each time (cheap), and its bytes' digest
    keys the parse (JSON, records, schema, digest; the expensive part): a file read again with
    the same bytes is not parsed again, and a file replaced by other bytes is, whatever its
    timestamps say (a coarse clock could not tell a new manifest from the one it replaced).
    The outcome is remembered either way, the manifest or the reason it was refused.

    Raises:
      CheckpointFormatError: no file at ``path``, or it is not a cocijax manifest.
      OSError: it cannot be read (an I/O error): nothing is remembered.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = None
    if raw is None:  # a KvPath answers None for a missing object
        raise CheckpointFormatError(
            f"No cocijax manifest at {path}: the checkpoint is incomplete or was not written "
            "by StripedCheckpointHandler."
        )
    key = (str(path), xxhash.xxh3_128_digest(raw))
    known = _PARSED.get(key)
    if known is None:
        try:
            known = _parse(raw, str(path))
        except CheckpointFormatError as e:
            known = str(e)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))  # the oldest: a job reads its newest steps most
        _PARSED[key] = known
    if isinstance(known, str):
        raise CheckpointFormatError(known)
    return known


def _parse(raw: bytes, source: str) -> Manifest:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{source} is not valid JSON: {e}.") from None
    except (RecursionError, ValueError) as e:  # nesting too deep; an integer of 4300+ digits
        raise CheckpointFormatError(f"{source} cannot be a cocijax manifest: {e}.") from None
    return Manifest.from_json(data, source=source)


# Parsed manifests (or why they were refused) by (path, xxh3_128 of the bytes): see _read_json.
_PARSED: dict[tuple[str, bytes], Manifest | str] = {}
_PARSED_MAX = 4096


def read_manifest(item_dir: Location, *, root_options: Mapping[str, Any] | None = None) -> Manifest:
    """Reads the manifest of a committed item.

    Args:
      item_dir: the Orbax item directory the handler saved into, or an item on an object
        store (``s3://bucket/run/7/state``).
      root_options: kvstore options for an object-store ``item_dir`` (e.g. ``endpoint``).

    Returns:
      The parsed :class:`Manifest`.

    Raises:
      CheckpointFormatError: the manifest is missing, not valid JSON, or not a cocijax manifest.

    Example:
      >>> import tempfile, numpy as np, orbax.checkpoint as ocp, cocijax as cj
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "item"
      >>> with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
      ...     ckptr.save(path, args=cj.StripedSave({"w": np.zeros(3), "step": 7}))
      >>> [(leaf.path, leaf.kind, leaf.shape) for leaf in read_manifest(path).leaves]
      [("['step']", 'int', ()), ("['w']", 'numpy', (3,))]
    """
    item_dir = _kvpath.location(item_dir, root_options)
    manifest = _read_json(item_dir / MANIFEST_NAME)
    _schema.check_coverage(manifest, item_dir, CheckpointFormatError)
    return manifest


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def part_path(item_dir: os.PathLike | str, process: int) -> pathlib.Path:
    return pathlib.Path(item_dir) / f"{PART_PREFIX}{process}.json"


def merge_parts(item_dir: os.PathLike | str) -> Manifest | None:
    """Merges every process's manifest part into the manifest, then removes the parts.

    Leaves come from the lowest process's part (all processes flatten the same tree); pieces are
    the union of all parts, with root indices remapped by path so processes may list roots in any
    order. Returns ``None`` when there is nothing to merge (already merged).

    Raises:
      CheckpointFormatError: the parts disagree on the tree, some leaf is not fully covered, or
        there is neither a part nor a manifest.
      OSError: the item directory cannot be listed, or a part read or the manifest written.
    """
    item_dir = pathlib.Path(item_dir)
    # os.listdir, not Path.glob: glob answers "no parts" when it may not list the directory
    # (PermissionError), and the step would then be committed without a manifest (libfiu).
    names = [n for n in os.listdir(item_dir) if n.startswith(PART_PREFIX) and n.endswith(".json")]
    part_files = sorted(
        (item_dir / n for n in names), key=lambda p: int(p.stem[len(PART_PREFIX) :])
    )
    if not part_files:
        if (item_dir / MANIFEST_NAME).is_file():
            return None
        raise CheckpointFormatError(
            f"{item_dir}: no manifest part to merge and no manifest: no process wrote its part."
        )
    parts = [_read_json(p) for p in part_files]
    first = parts[0]
    roots: list[str | None] = []
    pieces: list[PieceRecord] = []
    for part, file in zip(parts, part_files, strict=True):
        if [(x.path, x.dtype, x.shape) for x in part.leaves] != [
            (x.path, x.dtype, x.shape) for x in first.leaves
        ]:
            raise CheckpointFormatError(
                f"{file} describes a different tree than {part_files[0]}: every process must "
                "save the same pytree structure, shapes and dtypes."
            )
        for piece in part.pieces:
            root = part.roots[piece.root]
            if root not in roots:
                roots.append(root)
            pieces.append(dataclasses.replace(piece, root=roots.index(root)))
    merged = Manifest(
        version=VERSION,
        checksum=first.checksum,
        roots=tuple(roots),
        leaves=first.leaves,
        pieces=tuple(pieces),
        custom_metadata=first.custom_metadata,
    )
    write_manifest(item_dir, merged, remove=part_files)
    return merged


def write_manifest(
    item_dir: pathlib.Path | KvPath, manifest: Manifest, *, remove: Sequence[pathlib.Path] = ()
) -> None:
    """Writes ``manifest`` into ``item_dir``: the commit record, so write it last.

    On a local directory it is written durably (temporary file, fsync, rename), and the files
    in ``remove`` (merged parts) are removed with it; on an object store it is one PUT, which
    makes the whole object appear at once or not at all.

    Raises:
      CheckpointFormatError: some leaf is not fully covered by the pieces.
    """
    write_manifest_bytes(item_dir, encode_manifest(item_dir, manifest), remove=remove)


def encode_manifest(item_dir: pathlib.Path | KvPath, manifest: Manifest) -> bytes:
    """The file of ``manifest`` (for :func:`write_manifest_bytes`), checked to cover every leaf.

    Raises:
      CheckpointFormatError: some leaf is not fully covered by the pieces.
    """
    _schema.check_coverage(manifest, item_dir, CheckpointFormatError)
    return _json_bytes(manifest.to_json())


def encode_part(part: Manifest) -> bytes:
    """The file of one process's ``part``; :func:`merge_parts` checks the coverage of all."""
    return _json_bytes(part.to_json())


def write_manifest_bytes(
    item_dir: pathlib.Path | KvPath, text: bytes, *, remove: Sequence[pathlib.Path] = ()
) -> None:
    """Writes the manifest file ``text`` (:func:`encode_manifest`), as :func:`write_manifest`."""
    if isinstance(item_dir, KvPath):
        (item_dir / MANIFEST_NAME).write_bytes(text)
        return
    replace_bytes(item_dir / MANIFEST_NAME, text, fsync=True)
    for p in remove:
        p.unlink()
    fsync_dir(item_dir)  # once, for the manifest's rename and the parts' removal


def referenced_stripe_dirs(item_dir: os.PathLike | str) -> set[pathlib.Path]:
    """Stripe directories on external roots that a committed item uses.

    Data stored inside the item directory itself (``roots=()``) is not listed: it goes away with
    the item. Use with :func:`find_stripe_dirs` to find orphans left by interrupted saves.

    Raises:
      CheckpointFormatError: the item has no readable manifest.
    """
    return _stripe_dirs(read_manifest(item_dir))


def _stripe_dirs(manifest: Manifest) -> set[pathlib.Path | KvPath]:
    dirs = set()
    for p in manifest.pieces:
        root = manifest.roots[p.root]
        if root is not None:
            dirs.add(_kvpath.location(root) / pathlib.PurePosixPath(p.file).parts[0])
    return dirs


def find_stripe_dirs(
    root: Location, *, root_options: Mapping[str, Any] | None = None
) -> list[pathlib.Path | KvPath]:
    """Every stripe directory cocijax wrote directly under ``root``, sorted; [] if none.

    ``root`` may be an object-store prefix (``s3://bucket/prefix``): its keys are listed.
    """
    root = _kvpath.location(root, root_options)
    if isinstance(root, KvPath):
        names = {key.split("/", 1)[0] for key in root.list()}
        return [root / n for n in sorted(names) if n.startswith(STRIPE_PREFIX)]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STRIPE_PREFIX))


def remove_tree(where: Location, *, root_options: Mapping[str, Any] | None = None) -> None:
    """Removes a directory (a stripe directory, say) or every object under a prefix."""
    where = _kvpath.location(where, root_options)
    if isinstance(where, KvPath):
        where.delete_all()
    else:
        remove_local_tree(where)


# A stripe directory's name as a manifest mentions it (in each piece's ``file``): the prefix and a
# name that is unique for every save (a uuid4), so a name alone identifies one save's stripes.
_STRIPE_NAME = re.compile(re.escape(STRIPE_PREFIX).encode() + rb'[^/"\\\s]+')


def stripe_names_in_use(item_dir: os.PathLike | str) -> frozenset[str] | None:
    """The names of the stripe directories an item may reference, for garbage collection.

    Read from the manifest's raw bytes: every stripe name they mention, whether or not the
    manifest can be parsed, checked or is of a version this cocijax reads. So a damaged or
    foreign manifest keeps its item's stripes (the item is set aside or deleted as a whole),
    and no manifest is ever trusted by a timestamp or a cache: a name is a uuid4, never reused.

    * No manifest (a save that never committed; checked twice, so that an ``open`` failing
      with ENOENT is not taken for it): the item references nothing, its stripes are garbage.
    * A manifest that cannot be read (an I/O error): ``None``, "unknown"; a collector must
      then remove nothing now and try again later.

    Args:
      item_dir: an Orbax item directory the striped handler saved into (or began to).

    Returns:
      Stripe directory names (``cocijax-stripe-...``), or None when unknown.
    """
    manifest = pathlib.Path(item_dir) / MANIFEST_NAME
    try:
        data = manifest.read_bytes()
    except FileNotFoundError:
        # Never committed, so its stripes are garbage, but only if the manifest is really not
        # there: an open failing with ENOENT on an existing file (an I/O fault; libfiu injects
        # it) must not delete a committed step's data.
        if os.path.lexists(manifest):
            log.warning("cannot open %s: keeping every stripe for now", manifest)
            return None
        return frozenset()
    except OSError as e:
        log.warning("cannot read %s (%s): keeping every stripe for now", manifest, e)
        return None
    return frozenset(m.decode(errors="replace") for m in _STRIPE_NAME.findall(data))


def unreferenced_stripe_dirs(
    roots: Iterable[Location],
    item_dirs: Iterable[os.PathLike | str],
    *,
    root_options: Mapping[str, Any] | None = None,
) -> list[pathlib.Path | KvPath] | None:
    """Stripe directories on ``roots`` that none of ``item_dirs`` references: garbage.

    A stripe directory is referenced when an item's manifest names it (see
    :func:`stripe_names_in_use`): its name is unique to the save that wrote it, so the same
    directory reached through another spelling of a root is still recognised.

    Args:
      roots: the directories or object-store prefixes saves striped into (a handler's
        ``roots``).
      item_dirs: every item that may reference stripes on them, committed, damaged or not.
      root_options: kvstore options for object-store roots given as URLs.

    Returns:
      The unreferenced stripe directories, sorted; ``None`` when an item's references cannot
      be known now (an I/O error reading its manifest), in which case nothing may be removed.

    Example:
      >>> import tempfile
      >>> root = pathlib.Path(tempfile.mkdtemp())
      >>> (root / (STRIPE_PREFIX + "left-by-a-crash")).mkdir()
      >>> [p.name for p in unreferenced_stripe_dirs([root], [])]
      ['cocijax-stripe-left-by-a-crash']
    """
    referenced: set[str] = set()
    for item_dir in item_dirs:
        names = stripe_names_in_use(item_dir)
        if names is None:
            return None
        referenced |= names
    return [
        d
        for root in roots
        for d in find_stripe_dirs(root, root_options=root_options)
        if d.name not in referenced
    ]


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
    for path, leaf in _tree.flatten(tree)[0]:
        _tree.leaf_kind(path, leaf)
