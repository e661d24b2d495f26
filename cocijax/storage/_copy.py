"""Copying a committed item to another place (a durable tier), every checksum checked.

The copy keeps every piece a zarr v3 array with the same metadata (chunk grid, codecs) and puts
all of them under the destination item itself, so the copy is self-contained: its manifest
records one root, ``None``, the item directory, wherever it is later found or moved. Each piece
file is read once, its members' checksums are verified (a damaged source is never copied), and
it is written through TensorStore; at most ``memory_bytes`` of pieces are held at a time. The
destination's manifest is written last, after one listing shows every object there: on an
object store, the item is committed when that object exists.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from cocijax.storage import _io, _kvpath, _manifest, _read, _tree, _write
from cocijax.storage._kvpath import KvPath
from cocijax.storage._manifest import Location, Manifest, PieceRecord


@dataclasses.dataclass(frozen=True)
class CopyStats:
    """What :func:`copy_item` moved.

    Attributes:
      bytes: bytes of piece data read and written (as stored in memory, before any codec).
      files: piece files (zarr arrays) copied.
      seconds: wall time of the copy, manifest included.
    """

    bytes: int
    files: int
    seconds: float


def copy_item(
    source: Location,
    dest: Location,
    *,
    source_options: Mapping[str, Any] | None = None,
    dest_options: Mapping[str, Any] | None = None,
    memory_bytes: int = 512 << 20,
    concurrency: int = 32,
    commit: bool = True,
) -> CopyStats:
    """Copies the committed item ``source`` to ``dest``, checking every checksum.

    Args:
      source: a committed item (an Orbax item directory the striped handler saved, or a copy).
      dest: the new item: a local directory or an object-store prefix
        (``s3://bucket/run/7/state``); it should hold nothing yet.
      source_options: kvstore options for object-store roots of ``source``.
      dest_options: kvstore options for an object-store ``dest`` (``endpoint``, ...).
      memory_bytes: at most this many bytes of piece data in memory at once (one piece file
        at a time when a single file is larger).
      concurrency: TensorStore file and request concurrency.
      commit: write the destination's manifest at the end. ``False`` leaves the copy
        uncommitted, for a caller that copies more files first and then calls
        :func:`write_manifest` with the returned manifest's :meth:`Manifest.in_item_dir`.

    Returns:
      What was copied.

    Raises:
      CheckpointFormatError: ``source`` has no valid manifest.
      CorruptCheckpointError: a source piece is missing, unreadable or fails its checksum
        (names the leaf and the file); nothing is committed at ``dest``.
      ValueError, OSError: the destination cannot be written (TensorStore's error, naming it).

    Example:
      >>> import tempfile, numpy as np, orbax.checkpoint as ocp, cocijax as cj, pathlib
      >>> tmp = pathlib.Path(tempfile.mkdtemp())
      >>> with ocp.Checkpointer(cj.StripedCheckpointHandler(roots=[tmp / "r0"])) as ckptr:
      ...     ckptr.save(tmp / "item", args=cj.StripedSave({"w": np.arange(3.0)}))
      >>> copy_item(tmp / "item", tmp / "copy").files
      1
      >>> cj.storage.verify(tmp / "copy"), cj.storage.read_manifest(tmp / "copy").roots
      ([], (None,))
    """
    start = time.perf_counter()
    source = _kvpath.location(source, source_options)
    target = KvPath.parse(dest, dest_options)
    manifest = _manifest.read_manifest(source)
    context = _io.make_context(concurrency)
    with (
        concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 1)) as pool,
        concurrent.futures.ThreadPoolExecutor(concurrency) as io_pool,
    ):
        reader = _read.PieceReader(
            manifest,
            source,
            context,
            pool,
            verify=True,
            io_pool=io_pool,
            root_options=source_options,
        )
        files = reader.files()
        largest = max((_file_bytes(manifest, ps) for ps in files.values()), default=1)
        limit = asyncio.Semaphore(max(1, memory_bytes // max(largest, 1)))

        async def copy(pieces: list[PieceRecord]) -> tuple[str, int, int]:
            async with limit:
                first = pieces[0]
                array = await reader.array(first)
                if len(pieces) == 1 and first.offset is None:
                    # One whole region: read in place (raw chunk files straight into an aligned
                    # buffer where local), its checksum verified there.
                    dtype = _tree.to_dtype(manifest.leaves[first.leaf].dtype)
                    data = _io.aligned_empty(first.shape, dtype)
                    await reader.read_into(first, first.start, first.stop, data)
                else:
                    data = await reader.whole_file(first)
                metadata = array.spec().to_json()["metadata"]
                out = await ts.open(
                    {
                        "driver": "zarr3",
                        "kvstore": (target / first.file).spec(),
                        "metadata": metadata,
                        "create": True,
                        "store_data_equal_to_fill_value": True,
                    },
                    context=context,
                )
                await out.write(data, can_reference_source_data_indefinitely=True)
                reader.forget((first.root, first.file))
                grid = metadata["chunk_grid"]["configuration"]["chunk_shape"]
                chunks = _write.grid_size(metadata["shape"], grid)
                return first.file, data.nbytes, chunks

        async def run() -> list[tuple[str, int, int]]:
            copied = await _io.gather_all(copy(ps) for ps in files.values())
            by_stripe: dict[str, dict[str, int]] = {}
            for file, _, chunks in copied:
                stripe, _, name = file.partition("/")
                by_stripe.setdefault(stripe, {})[name] = chunks
            await _io.gather_all(
                _write.check_written(target / stripe, names) for stripe, names in by_stripe.items()
            )
            return copied

        _check_unique(manifest)
        copied = _io.run_sync(run())
    if commit:
        _manifest.write_manifest(target, manifest.in_item_dir())
    return CopyStats(
        bytes=sum(n for _, n, _ in copied),
        files=len(copied),
        seconds=time.perf_counter() - start,
    )


def _file_bytes(manifest: Manifest, pieces: list[PieceRecord]) -> int:
    """Bytes of one piece file: the largest extent its members reach (packed files hold many)."""
    itemsize = _tree.to_dtype(manifest.leaves[pieces[0].leaf].dtype).itemsize
    return max((p.offset or 0) + math.prod(p.shape) for p in pieces) * itemsize


def _check_unique(manifest: Manifest) -> None:
    # Piece files of one save are unique across roots (one stripe name per save and process,
    # unique piece names), so they can all live under one directory; a manifest where two roots
    # hold the same file name could not be copied into one.
    seen: dict[str, int] = {}
    for p in manifest.pieces:
        if seen.setdefault(p.file, p.root) != p.root:
            raise _manifest.CheckpointFormatError(
                f"piece file {p.file} is on roots {seen[p.file]} and {p.root}: the item cannot "
                "be copied into one directory."
            )
