"""The blocking part of a save: this process's share of a tree, copied to host memory once.

Every leaf is recorded for the manifest; every replica-0 shard (or whole numpy array, on the
primary process) becomes a *chunk* to write, and ``_layout`` plans the pieces; that
:class:`SaveLayout` is kept for the next save of the same structure. Then each chunk
is copied exactly once, in parallel (numpy's copy releases the GIL), into page-aligned memory
that direct writes use as it is; small chunks are copied straight into their packs. That memory
comes from the handler's ``HostBuffers``: a save of the same shapes as the last one copies into
pages already faulted in. With ``start_raw`` given (the handler's ``write_while_copying``), a
piece of at least one full chunk on an external root starts writing as soon as its own copy is
done, while the rest is still being copied.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import pathlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from cocijax.storage import _io, _layout, _tree
from cocijax.storage._records import STRIPE_PREFIX, LeafRecord

# Starts the direct writes of one piece: (stripe directory, piece, its host data) -> futures,
# or None when the piece must go through TensorStore.
StartRaw = Callable[
    [pathlib.Path, _layout.Piece, np.ndarray], list[concurrent.futures.Future] | None
]


@dataclasses.dataclass
class Snapshot:
    """Host copy of this process's share of a tree, plus the layout to write it."""

    leaves: list[LeafRecord]
    pieces: list[_layout.Piece]
    buffers: list[np.ndarray | None]  # per chunk source: the host copy of an unpacked chunk
    packs: dict[str, np.ndarray]  # per packed piece name: its flat host buffer
    stripe: str  # name of this save's stripe directory on every root
    # Per piece name: chunk-file writes started while the rest of the tree was being copied.
    early: dict[str, list[concurrent.futures.Future]]
    custom_metadata: Any = None  # StripedSave.custom_metadata, kept in the manifest
    # The HostBuffers memory behind ``buffers`` and ``packs``, given back once written.
    owned: list[np.ndarray] = dataclasses.field(default_factory=list)
    # What was written; the next save of the same structure reuses it.
    layout: SaveLayout | None = None

    def data(self, piece: _layout.Piece) -> np.ndarray:
        if piece.packed:
            return self.packs[piece.name]
        chunk, start, stop, _ = piece.members[0]
        return self.buffers[chunk.source][_layout.local_slices(start, stop, chunk.start)]

    def member_views(self, piece: _layout.Piece) -> list[np.ndarray]:
        """The host data of each leaf region in ``piece`` (one, unless it is a pack)."""
        if not piece.packed:
            return [self.data(piece)]
        buf = self.packs[piece.name]
        return [buf[off : off + math.prod(chunk.shape)] for chunk, _, _, off in piece.members]


# Describing 1024 leaves and planning their pieces took ~11 ms of a 45 ms blocking save
# (write_bench tree (b)): hence one plan per tree structure, reused.
@dataclasses.dataclass(frozen=True)
class SaveLayout:
    """What a save writes of one tree structure; the next save of the same structure reuses it.

    A training job saves the same structure every time, so describing its leaves and planning
    their pieces is done once. The plan keeps no array: only the structure's signature, records
    and pieces.

    Attributes:
      signature: what the plan depends on (:func:`signature`).
      leaves: the manifest record of every leaf.
      inline: indices of the leaves stored in the manifest itself (their values change).
      sources: per host buffer, ``(leaf index, shard index)``: which data goes there (shard
        ``None``: the whole leaf).
      on_host: per source, whether the host copies it (numpy, or a ``jax.Array`` on the CPU).
      pieces: the zarr arrays to write.
    """

    signature: tuple
    leaves: tuple[LeafRecord, ...]
    inline: tuple[int, ...]
    sources: tuple[tuple[int, int | None], ...]
    on_host: tuple[bool, ...]
    pieces: tuple[_layout.Piece, ...]


def signature(treedef: Any, flat: Sequence[Any], **options: Any) -> tuple:
    """Everything a :class:`SaveLayout` of the leaves ``flat`` depends on, besides inline values.

    The tree structure (which fixes every key path), each array's shape, dtype and sharding,
    the type of every other leaf, and the planning ``options``.
    """
    return treedef, tuple(sorted(options.items())), tuple(_leaf_signature(x) for x in flat)


def _leaf_signature(leaf: Any) -> tuple | type:
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, leaf.sharding
    if isinstance(leaf, np.ndarray):
        return leaf.shape, leaf.dtype
    return type(leaf)  # an inline leaf: its kind follows from its type


def describe(
    flat: Sequence[tuple[Any, Any]], write_numpy: bool, host_local: bool = False
) -> tuple[list[LeafRecord], list[_layout.Chunk], list[tuple[int, int | None]], list[bool]]:
    """The manifest records of every leaf, the chunks this process writes, and their sources.

    Args:
      flat: ``(key path, leaf)`` pairs (:func:`_tree.flatten`).
      write_numpy: this process writes numpy leaves.
      host_local: this process writes one copy of every region its devices hold (its own
        copy, restorable without the other processes) instead of the replica-0 shards only.

    Returns:
      The records, the chunks, and per chunk source its ``(leaf index, shard index)`` and
      whether the host copies it (see :class:`SaveLayout`).

    Raises:
      UnsupportedLeafError: a leaf's type or dtype cannot be saved (names its path).
    """
    leaves: list[LeafRecord] = []
    chunks: list[_layout.Chunk] = []
    sources: list[tuple[int, int | None]] = []
    on_host: list[bool] = []
    shardings: dict[jax.sharding.Sharding, dict[str, Any] | None] = {}
    for index, (path, leaf) in enumerate(flat):
        kind = _tree.leaf_kind(path, leaf)
        keys = _tree.encode_keys(path)
        name = jax.tree_util.keystr(path)
        if kind in _tree.INLINE_KINDS:
            leaves.append(LeafRecord(name, keys, kind, None, (), value=_inline_value(kind, leaf)))
            continue
        sharding = key_impl = None
        if kind in ("jax", _tree.KEY_KIND):
            sharding = _sharding_json_cached(shardings, leaf.sharding)
        if kind == _tree.KEY_KIND:
            # The key data (uint32, the keys' shape + the impl's key shape) is what is stored,
            # sharded as the keys are; the implementation rebuilds the keys.
            key_impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        dtype = np.dtype(leaf.dtype)
        shape = tuple(int(d) for d in leaf.shape)
        leaves.append(
            LeafRecord(
                name,
                keys,
                kind,
                _tree.dtype_name(dtype),
                shape,
                sharding=sharding,
                key_impl=key_impl,
            )
        )
        whole = (0,) * len(shape), shape
        host = not isinstance(leaf, jax.Array) or _on_cpu(leaf.sharding)
        if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) == 1:
            # Single-device array (the common case): skip building shard objects.
            if leaf.is_fully_addressable:
                chunks.append(_layout.Chunk(index, *whole, dtype, len(sources)))
                sources.append((index, None))
                on_host.append(host)
        elif isinstance(leaf, jax.Array):
            written = set()  # host-local: the regions this process writes already
            for shard_index, shard in enumerate(leaf.addressable_shards):
                start, stop = _layout.box(shard.index, shape)
                if (start, stop) not in written if host_local else shard.replica_id == 0:
                    written.add((start, stop))
                    chunks.append(_layout.Chunk(index, start, stop, dtype, len(sources)))
                    sources.append((index, shard_index))
                    on_host.append(host)
        elif write_numpy:
            chunks.append(_layout.Chunk(index, *whole, dtype, len(sources)))
            sources.append((index, None))
            on_host.append(True)
    return leaves, chunks, sources, on_host


def make_layout(
    flat: Sequence[tuple[Any, Any]],
    key: tuple,
    *,
    num_roots: int,
    write_numpy: bool,
    piece_bytes: int,
    small_bytes: int,
    host_local: bool = False,
) -> SaveLayout:
    """Describes the leaves ``flat`` and plans their pieces; ``key`` is their :func:`signature`."""
    leaves, chunks, sources, on_host = describe(flat, write_numpy, host_local)
    pieces = _layout.lay_out(chunks, num_roots, piece_bytes=piece_bytes, small_bytes=small_bytes)
    inline = tuple(i for i, r in enumerate(leaves) if r.kind in _tree.INLINE_KINDS)
    return SaveLayout(key, tuple(leaves), inline, tuple(sources), tuple(on_host), tuple(pieces))


def _inline_value(kind: str, leaf: Any) -> Any:
    return _tree.empty_tag(leaf) if kind == _tree.EMPTY_KIND else leaf


def _source_data(flat: Sequence[tuple[Any, Any]], layout: SaveLayout) -> list[Any]:
    """This save's data behind each of the layout's sources (arrays, or shards of arrays)."""
    data: list[Any] = []
    shards: dict[int, list[Any]] = {}  # addressable_shards builds its list anew at every call
    for index, shard_index in layout.sources:
        leaf = flat[index][1]
        if layout.leaves[index].kind == _tree.KEY_KIND:
            leaf = jax.random.key_data(leaf)
        if shard_index is None:
            data.append(leaf)
        else:
            if index not in shards:
                shards[index] = leaf.addressable_shards
            data.append(shards[index][shard_index].data)
    return data


def take(
    item: Any,
    roots: Sequence[pathlib.Path | None],
    *,
    piece_bytes: int,
    small_bytes: int,
    chunk_bytes: int,
    write_numpy: bool,
    pool: concurrent.futures.Executor,
    start_raw: StartRaw | None,
    buffers: _io.HostBuffers,
    last: SaveLayout | None = None,
    host_local: bool = False,
) -> Snapshot:
    """Plans the pieces of ``item`` and copies this process's share to host memory.

    Args:
      item: the tree to save.
      roots: the handler's roots (``None``: the item directory, not known yet).
      piece_bytes: largest piece.
      small_bytes: regions below this size are packed.
      chunk_bytes: pieces of at least this size on external roots start writing early.
      write_numpy: this process writes numpy leaves (the primary one).
      pool: threads for the copies.
      start_raw: starts a piece's direct writes (see :data:`StartRaw`) while the rest is
        copied; ``None``: nothing is written before the whole copy is done.
      buffers: where the host memory comes from (``snapshot.owned`` goes back there).
      last: the layout of the previous save (``snapshot.layout``), reused if its signature holds.
      host_local: this process writes its own copy of what its devices hold (see
        :func:`describe`).
    """
    flat, treedef = _tree.flatten(item)
    options = dict(
        num_roots=len(roots),
        write_numpy=write_numpy,
        piece_bytes=piece_bytes,
        small_bytes=small_bytes,
        host_local=host_local,
    )
    key = signature(treedef, [leaf for _, leaf in flat], **options)
    layout = (
        last if last is not None and last.signature == key else make_layout(flat, key, **options)
    )
    leaves = list(layout.leaves)
    for i in layout.inline:
        record = leaves[i]
        leaves[i] = dataclasses.replace(record, value=_inline_value(record.kind, flat[i][1]))
    pieces = list(layout.pieces)
    sources = _source_data(flat, layout)
    for s, host in zip(sources, layout.on_host, strict=True):
        if not host:
            s.copy_to_host_async()  # Overlaps device-to-host transfers on accelerators.
    stripe = f"{STRIPE_PREFIX}{uuid.uuid4().hex}"
    snapshot = Snapshot(leaves, pieces, [None] * len(sources), {}, stripe, {}, layout=layout)
    # Stripe directories on external roots can be made now, so a piece's chunk files can be
    # written as soon as its host copy is done (the item directory may not exist yet). Only
    # pieces of at least one full chunk start early: with few cores, the per-file work of small
    # pieces slowed the copy that blocks the caller more than it saved (measured).
    # (Local roots only: pieces on an object store are written through TensorStore.)
    early_roots = set()
    if start_raw is not None:
        early_roots = {p.root for p in pieces if isinstance(roots[p.root], pathlib.Path)}
    for r in early_roots:
        (roots[r] / stripe).mkdir()

    def copy_then_write(job: tuple[Callable[[], None], list[_layout.Piece]]) -> None:
        copy, copied = job
        copy()
        for piece in copied:
            if piece.root in early_roots and piece.nbytes >= chunk_bytes:
                started = start_raw(roots[piece.root] / stripe, piece, snapshot.data(piece))
                if started is not None:
                    snapshot.early[piece.name] = started

    jobs = _copy_jobs(snapshot, sources, layout.on_host, buffers)
    list(pool.map(copy_then_write, jobs))
    return snapshot


def _copy_jobs(
    snapshot: Snapshot, sources: list[Any], on_host: Sequence[bool], buffers: _io.HostBuffers
):
    """(copy function, pieces it completes): one per packed piece, one per unpacked source."""
    packs = [p for p in snapshot.pieces if p.packed]
    by_source: dict[int, list[_layout.Piece]] = {}
    for piece in snapshot.pieces:
        if not piece.packed:
            by_source.setdefault(piece.members[0][0].source, []).append(piece)
    # Accelerator arrays arrive in fresh memory of their own (the device-to-host transfer).
    to_copy = [i for i in by_source if on_host[i]]
    snapshot.owned = buffers.take([p.nbytes for p in packs] + [sources[i].nbytes for i in to_copy])
    flat = iter(snapshot.owned)
    jobs: list[tuple[Callable[[], None], list[_layout.Piece]]] = []
    for piece in packs:
        # Small regions are copied straight into their pack (still one copy each), in one
        # job per pack: one numpy call instead of a thread hop per leaf.
        buf = _as_array(next(flat), piece.shape, piece.dtype)
        snapshot.packs[piece.name] = buf
        members = [sources[chunk.source] for chunk, _, _, _ in piece.members]
        jobs.append((functools.partial(_pack_into, members, buf), [piece]))
    dests = dict(zip(to_copy, flat, strict=True))
    for src, copied in by_source.items():
        copy = functools.partial(_copy_source, snapshot, sources, src, dests.get(src))
        jobs.append((copy, copied))
    return jobs


def _as_array(flat: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The flat ``uint8`` buffer ``flat`` seen as a C-order array of ``shape`` and ``dtype``."""
    return flat.view(dtype).reshape(shape)


def _sharding_json_cached(cache: dict, sharding: jax.sharding.Sharding) -> dict[str, Any] | None:
    # Leaves usually share a few shardings; building Orbax's JSON took ~0.2 ms a leaf.
    if sharding not in cache:
        cache[sharding] = _sharding_json(sharding)
    return cache[sharding]


def _sharding_json(sharding: jax.sharding.Sharding) -> dict[str, Any] | None:
    """``sharding`` as Orbax's sharding metadata JSON; None for types Orbax cannot describe."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        metadata = ocp.metadata.NamedShardingMetadata.from_jax_sharding(sharding)
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        metadata = ocp.metadata.SingleDeviceShardingMetadata.from_jax_sharding(sharding)
    else:
        return None
    return json.loads(metadata.to_serialized_string())


def _on_cpu(sharding: jax.sharding.Sharding) -> bool:
    return next(iter(sharding.device_set)).platform == "cpu"


def _copy_source(
    snapshot: Snapshot, sources: list[Any], index: int, dest: np.ndarray | None
) -> None:
    """Exactly one copy of source ``index`` in host memory that nothing else references.

    On the host it goes into ``dest`` (page-aligned, so that direct writes use it as it is).
    """
    source = sources[index]
    if dest is None:
        snapshot.buffers[index] = np.asarray(source)  # The device-to-host transfer's buffer.
        return
    # On CPU np.asarray aliases the device buffer. Holding that view until the commit instead
    # of copying (what Orbax does) keeps JAX from donating the buffer, and the next step then
    # faults in fresh memory for its output: see benchmarks/train_loop_bench.py.
    view = np.asarray(source)
    out = _as_array(dest, view.shape, view.dtype)
    np.copyto(out, view)
    snapshot.buffers[index] = out


def _pack_into(sources: list[Any], dest: np.ndarray) -> None:
    """Copies ``sources`` back to back into the flat ``dest`` (one copy, even on CPU)."""
    np.concatenate([np.asarray(s).reshape(-1) for s in sources], out=dest)
