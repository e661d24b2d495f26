"""Striping layout: every byte is planned exactly once, roots are balanced, small leaves packed."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cocijax.storage import _layout

F32 = np.dtype("float32")


def _covered(pieces):
    """Element count per leaf summed over all planned regions."""
    out = {}
    for p in pieces:
        for chunk, start, stop, _ in p.members:
            n = math.prod(b - a for a, b in zip(start, stop, strict=True))
            out[chunk.leaf] = out.get(chunk.leaf, 0) + n
    return out


def test_large_array_is_split_over_all_roots():
    chunk = _layout.Chunk(0, (0, 0), (64, 1024), F32)  # 256 KiB
    pieces = _layout.lay_out([chunk], 4, piece_bytes=1 << 20, small_bytes=1 << 10)
    assert sorted(p.root for p in pieces) == [0, 1, 2, 3]
    assert all(p.nbytes == chunk.nbytes // 4 for p in pieces)
    assert _covered(pieces) == {0: 64 * 1024}


def test_split_uses_largest_axis_when_axis0_is_short():
    chunk = _layout.Chunk(0, (0, 0), (2, 4096), F32)
    pieces = _layout.lay_out([chunk], 4, piece_bytes=8192, small_bytes=16)
    assert len(pieces) == 4
    assert {p.members[0][1][0] for p in pieces} == {0}  # every piece spans all rows
    assert [p.shape for p in pieces] == [(2, 1024)] * 4


def test_small_leaves_are_packed_per_dtype():
    chunks = [_layout.Chunk(i, (0,), (10,), F32) for i in range(100)]
    chunks.append(_layout.Chunk(100, (0,), (3,), np.dtype("int32")))
    pieces = _layout.lay_out(chunks, 1, piece_bytes=1 << 20, small_bytes=1 << 10)
    assert len(pieces) == 2
    by_dtype = {p.dtype.name: p for p in pieces}
    assert by_dtype["float32"].shape == (1000,)
    assert [m[3] for m in by_dtype["float32"].members] == list(range(0, 1000, 10))
    assert by_dtype["int32"].packed and by_dtype["int32"].shape == (3,)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    num_roots=st.integers(1, 5),
    piece_kib=st.integers(1, 64),
)
def test_plan_covers_everything_once_and_balances(sizes, num_roots, piece_kib):
    chunks = [_layout.Chunk(i, (0,), (n,), F32) for i, n in enumerate(sizes)]
    piece_bytes = piece_kib << 10
    pieces = _layout.lay_out(chunks, num_roots, piece_bytes=piece_bytes, small_bytes=512)
    assert _covered(pieces) == dict(enumerate(sizes))
    assert len({p.name for p in pieces}) == len(pieces)
    loads = [0] * num_roots
    for p in pieces:
        loads[p.root] += p.nbytes
    total = sum(loads)
    biggest = max(p.nbytes for p in pieces)
    # LPT: no root exceeds its fair share by more than the largest piece.
    assert max(loads) <= total / num_roots + biggest
    target = _layout.piece_target(total, num_roots, piece_bytes, 512)
    # Split pieces are within one element of the target; packs never exceed it.
    assert all(p.nbytes <= target + (0 if p.packed else F32.itemsize) for p in pieces)
