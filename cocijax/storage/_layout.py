"""Striping layout: which bytes go to which root, in which zarr array.

Three steps, all on metadata (no data is touched):

1. A *chunk* is one region a process must write (a replica-0 shard, or a whole host array).
2. Large chunks are split along one axis into pieces of at most the piece size, so one big
   array does not land on a single root; chunks below ``small_bytes`` are packed, per dtype, into
   flat 1-D pieces, so many tiny leaves cost one zarr array instead of one each.
3. Pieces are assigned to roots largest first, each to the least-loaded root (LPT scheduling), so
   every root ends within one piece of its share.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A global region of one leaf that this process writes.

    Attributes:
      leaf: index of the leaf in the flattened tree.
      start: global start index per dimension.
      stop: global stop index per dimension (exclusive).
      dtype: element dtype.
      source: index of the host snapshot buffer holding it.
    """

    leaf: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    dtype: np.dtype
    source: int = 0

    # Cached: lay_out asks for them several times per chunk, and a tree may have 1000s.
    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class Piece:
    """One zarr array to write.

    Attributes:
      name: file name inside the stripe directory.
      dtype: element dtype.
      members: ``(chunk, region start, region stop, offset)``: the global region of ``chunk``
        stored here and, for a packed piece, its element offset in the flat array (else None).
      shape: shape of the zarr array.
      root: assigned root index.
    """

    name: str
    dtype: np.dtype
    members: list[tuple[Chunk, tuple[int, ...], tuple[int, ...], int | None]]
    shape: tuple[int, ...]
    root: int = 0

    @property
    def packed(self) -> bool:
        return self.members[0][3] is not None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal ``[a, b)`` ranges covering ``range(n)``."""
    edges = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def piece_target(total_bytes: int, num_roots: int, piece_bytes: int, small_bytes: int) -> int:
    """Piece size: at most ``piece_bytes``, smaller when needed to spread a tree over the roots."""
    return max(small_bytes, min(piece_bytes, math.ceil(total_bytes / max(num_roots, 1))))


def lay_out(
    chunks: list[Chunk],
    num_roots: int,
    *,
    piece_bytes: int,
    small_bytes: int,
) -> list[Piece]:
    """Splits, packs and assigns ``chunks`` to ``num_roots`` roots.

    Args:
      chunks: the regions to write.
      num_roots: how many roots to stripe over.
      piece_bytes: largest piece, in bytes.
      small_bytes: chunks strictly below this size are packed with others of their dtype.

    Returns:
      Pieces with ``root`` set, named ``p00000``, ``p00001``, ... in layout order.

    Example:
      >>> c = Chunk(0, (0,), (1 << 20,), np.dtype("float32"))
      >>> [p.root for p in lay_out([c], 2, piece_bytes=1 << 21, small_bytes=1 << 10)]
      [0, 1]
    """
    total = sum(c.nbytes for c in chunks)
    target = piece_target(total, num_roots, piece_bytes, small_bytes)
    pieces: list[Piece] = []
    packs: dict[np.dtype, list[Chunk]] = {}
    for c in chunks:
        if c.nbytes == 0:
            continue
        if c.nbytes < small_bytes:
            packs.setdefault(c.dtype, []).append(c)
            continue
        pieces.extend(_split(c, target))
    for group in packs.values():
        pieces.extend(_pack(group, target))
    for i, p in enumerate(pieces):
        p.name = f"p{i:05d}"
    _assign(pieces, num_roots)
    return pieces


def _split(c: Chunk, target: int) -> list[Piece]:
    parts = max(1, math.ceil(c.nbytes / target))
    shape = c.shape
    # Axis 0 keeps every piece a contiguous view of the host buffer; otherwise the largest axis.
    axis = 0 if shape and shape[0] >= parts else int(np.argmax(shape)) if shape else 0
    if not shape or shape[axis] < 2:
        parts = 1
    out = []
    for a, b in split_bounds(shape[axis], parts) if shape else [(0, 0)]:
        start = list(c.start)
        stop = list(c.stop)
        if shape:
            start[axis] = c.start[axis] + a
            stop[axis] = c.start[axis] + b
        sub = tuple(y - x for x, y in zip(start, stop, strict=True))
        out.append(Piece("", c.dtype, [(c, tuple(start), tuple(stop), None)], sub))
    return out


def _pack(group: list[Chunk], target: int) -> list[Piece]:
    out: list[Piece] = []
    current: list[tuple[Chunk, tuple[int, ...], tuple[int, ...], int | None]] = []
    used = 0
    for c in group:
        if current and (used + c.nbytes) > target:
            out.append(_close_pack(current, used))
            current, used = [], 0
        current.append((c, c.start, c.stop, used // c.dtype.itemsize))
        used += c.nbytes
    if current:
        out.append(_close_pack(current, used))
    return out


def _close_pack(members, used: int) -> Piece:
    dtype = members[0][0].dtype
    return Piece("", dtype, members, (used // dtype.itemsize,))


def _assign(pieces: list[Piece], num_roots: int) -> None:
    loads = [(0, r) for r in range(num_roots)]
    heapq.heapify(loads)
    for p in sorted(pieces, key=lambda p: -p.nbytes):
        load, r = heapq.heappop(loads)
        p.root = r
        heapq.heappush(loads, (load + p.nbytes, r))


def box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Global ``(start, stop)`` of an index tuple of slices (e.g. a shard's ``index``)."""
    start, stop = [], []
    for s, n in zip(index, shape, strict=True):
        a, b, _ = s.indices(n)
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


def local_slices(start: tuple[int, ...], stop: tuple[int, ...], origin: tuple[int, ...]) -> tuple:
    """Index of the global region ``[start, stop)`` in an array that begins at ``origin``.

    It ends with ``...`` so that indexing a 0-d array gives a view, not a scalar.
    """
    return (*(slice(a - o, b - o) for a, b, o in zip(start, stop, origin, strict=True)), ...)
