"""Host-local copies (``StripedCheckpointHandler(host_local=True)`` with several processes): one
process's manifest (``holder``) covers its shards only; merged parts keep each region once; a
restore that needs a region a copy does not hold fails naming the region and the process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from cocijax import storage
from cocijax.storage import _parts
from cocijax.storage._manifest_io import write_manifest


def _saved(tmp_path: Path) -> Path:
    """A committed item of two leaves, ``w`` (8x2) and ``b`` (3,), saved by one process."""
    item = tmp_path / "item"
    tree = {"w": np.arange(16, dtype=np.float32).reshape(8, 2), "b": np.ones(3, np.float32)}
    with ocp.Checkpointer(storage.StripedCheckpointHandler()) as ckptr:
        ckptr.save(item, args=storage.StripedSave(tree))
    return item


def _pieces_of(manifest: storage.Manifest, leaf: str) -> list[storage.PieceRecord]:
    index = [x.path for x in manifest.leaves].index(leaf)
    return [p for p in manifest.pieces if p.leaf == index]


def _half(piece: storage.PieceRecord, lo: int, hi: int, process: int) -> storage.PieceRecord:
    """``piece`` (a region of ``w``) cut to rows ``lo:hi``, as process ``process`` wrote it."""
    return dataclasses.replace(piece, start=(lo, 0), stop=(hi, 2), process=process)


def test_merge_keeps_each_region_of_host_local_parts_once(tmp_path: Path) -> None:
    whole = storage.read_manifest(_saved(tmp_path))
    (w,) = _pieces_of(whole, "['w']")
    b = _pieces_of(whole, "['b']")
    # Each process holds half of ``w`` and the whole (replicated) ``b``.
    parts = [
        dataclasses.replace(whole, holder=q, pieces=(_half(w, 4 * q, 4 * q + 4, q), *b))
        for q in (0, 1)
    ]
    merged = _parts.merge([(f"part-{q}", part) for q, part in enumerate(parts)])
    assert merged.holder is None
    assert len(_pieces_of(merged, "['b']")) == len(b)  # once, not once per process
    assert sorted(p.start for p in _pieces_of(merged, "['w']")) == [(0, 0), (4, 0)]
    # Whole parts (replica-0 shards) never repeat a region: merged as they are, so a
    # repeat still fails the coverage check instead of being dropped quietly.
    same = [dataclasses.replace(part, holder=None) for part in parts]
    doubled = _parts.merge([(f"part-{q}", part) for q, part in enumerate(same)])
    assert len(_pieces_of(doubled, "['b']")) == 2 * len(b)
    with pytest.raises(storage.CheckpointFormatError, match="cover"):
        write_manifest(tmp_path / "item", doubled)


def test_a_copy_restores_only_what_it_holds(tmp_path: Path) -> None:
    item = _saved(tmp_path)
    whole = storage.read_manifest(item)
    (w,) = _pieces_of(whole, "['w']")
    # Process 1's copy: rows 4:8 of ``w`` only (its devices' shard), and ``b``.
    copy = dataclasses.replace(
        whole,
        holder=1,
        pieces=(*(p for p in whole.pieces if p is not w), _half(w, 4, 8, 1)),
    )
    write_manifest(item, copy)  # no coverage check for a copy of one process's shards
    with ocp.Checkpointer(storage.StripedCheckpointHandler()) as ckptr:
        restored = ckptr.restore(
            item, args=storage.StripedRestore(partial=True, item={"b": np.zeros(3, np.float32)})
        )
        np.testing.assert_array_equal(restored["b"], np.ones(3, np.float32))
        with pytest.raises(storage.RegionNotHeldError) as e:
            ckptr.restore(item, args=storage.StripedRestore())
    message = str(e.value)
    assert "['w']" in message and "[0, 0]..[8, 2]" in message and "process 1" in message
