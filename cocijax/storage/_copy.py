"""Copying a committed item to another place (a durable tier), every checksum checked.

The copy keeps every piece a zarr v3 array with the same metadata (chunk grid, codecs) and puts
all of them under the destination item itself, so the copy is self-contained: its manifest
records one root, ``None``, the item directory, wherever it is later found or moved (or, given
``dest_roots``, stripes them over those roots as a save does). Each piece file is read once, its
members' checksums are verified (a damaged source is never copied), and its data is written
out, its ``zarr.json`` copied byte for byte before any data: from one local directory to
another, an uncompressed piece's chunk files are written byte for byte from the verified bytes
(``_direct``, as a save writes them), anything else is re-encoded through TensorStore; at most
``memory_bytes`` of pieces are held at a time. The destination's manifest is written last,
after one listing shows every object there (on a local destination, after every file and
directory written is fsynced): on an object store, the item is committed when that object
exists.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import heapq
import math
import mmap
import os
import pathlib
import threading
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from cocijax import _files
from cocijax.storage import _direct, _io, _kvpath, _manifest_io, _read, _tree, _write
from cocijax.storage._kvpath import KvPath
from cocijax.storage._records import (
    CheckpointFormatError,
    Location,
    Manifest,
    PieceRecord,
    _root_string,
)


@typing.final
class BufferPool:
    """Host buffers that copies read pieces into and give back, at most ``limit_bytes`` kept.

    A copy reads each piece into host memory before it writes it out, and faulting fresh
    memory in costs more than reading into memory faulted in before. :func:`copy_item` reuses
    buffers between the pieces of one copy; a caller that copies often (the durable tier drains
    every save) keeps one pool, so that from its second copy of the same shapes on nothing is
    faulted in.

    Between copies the pool holds at most ``limit_bytes`` (buffers of any sizes, the most
    recently given back first); a buffer that would exceed it is freed.

    Example:
      >>> pool = BufferPool(1 << 30)
      >>> first = pool.take(1 << 20)
      >>> pool.give_back(first)
      >>> pool.take(1 << 20) is first, pool.nbytes
      (True, 0)
    """

    def __init__(self, limit_bytes: int):
        self._limit = limit_bytes
        self._free: list[np.ndarray] = []  # newest last
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A flat, page-aligned ``uint8`` buffer of ``nbytes``: a kept one if there is one."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].nbytes == nbytes:
                    return self._free.pop(i)
        return _io.aligned_empty((nbytes,), np.uint8, mmap.PAGESIZE)

    def give_back(self, buffer: np.ndarray) -> None:
        """Keeps ``buffer`` (from :meth:`take`, no longer used), freeing the oldest kept ones
        that no longer fit under the limit."""
        with self._lock:
            self._free.append(buffer)
            while self._free and sum(b.nbytes for b in self._free) > self._limit:
                self._free.pop(0)

    def clear(self) -> None:
        """Frees every kept buffer."""
        with self._lock:
            self._free = []

    @property
    def nbytes(self) -> int:
        """Bytes kept for the next copy."""
        with self._lock:
            return sum(b.nbytes for b in self._free)


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
    buffers: BufferPool | None = None,
    progress: Callable[[], None] | None = None,
    dest_roots: Sequence[Location] | None = None,
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
      buffers: where to take the host buffers pieces are read into, and give them back to;
        default: a pool of this copy's own (see :class:`BufferPool`).
      progress: called after each piece file is written (a caller's watchdog: the copy is
        making progress).
      dest_roots: spread the piece files over these directories (largest first, each onto the
        least-loaded one, as a save stripes them) instead of keeping them under ``dest``; the
        manifest at ``dest`` records them as its roots.

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
    manifest = _manifest_io.read_manifest(source)
    copied_manifest, bases = _destinations(manifest, target, dest_roots, dest_options)
    context = _io.make_context(concurrency)
    host_buffers = BufferPool(memory_bytes) if buffers is None else buffers
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
        limit = asyncio.Semaphore(_files_at_once(manifest, reader, memory_bytes))
        copier = _Copier(manifest, reader, bases, context, host_buffers, limit, progress, io_pool)
        _check_unique(manifest)
        copied = _io.run_sync(copier.run())
        _sync_local(bases, [file for file, _, _ in copied], io_pool)
    if commit:
        _manifest_io.write_manifest(target, copied_manifest)
    return CopyStats(
        bytes=sum(n for _, n, _ in copied),
        files=len(copied),
        seconds=time.perf_counter() - start,
    )


@dataclasses.dataclass(frozen=True)
class _Copier:
    """One copy in flight: the source's pieces, where they go, and what bounds its memory.

    Attributes:
      manifest: the source's manifest.
      reader: reads (and verifies) the source's piece files.
      bases: where each piece file goes (by its name: the file goes under its base).
      context: the TensorStore context of the writes.
      buffers: where host buffers of whole pieces come from and go back to.
      limit: how many piece files may be in memory at once.
      progress: called after each piece file is written, or None.
      io_pool: threads for the blocking writes of raw chunk files.
      direct_ok: per local destination (its URL), whether ``O_DIRECT`` works there.
    """

    manifest: Manifest
    reader: _read.PieceReader
    bases: Mapping[str, KvPath]
    context: ts.Context
    buffers: BufferPool
    limit: asyncio.Semaphore
    progress: Callable[[], None] | None
    io_pool: concurrent.futures.Executor
    direct_ok: dict[str, bool] = dataclasses.field(default_factory=dict)

    async def run(self) -> list[tuple[str, int, int]]:
        """Copies every piece file, then checks the destination lists all their objects.

        Returns:
          Per piece file: its name, bytes of data, and number of chunks.
        """
        await self._copy_metadata()
        files = self.reader.files().values()
        copied = await _io.gather_all(self._copy_file(ps) for ps in files)
        by_stripe: dict[tuple[str, str], dict[str, int]] = {}
        for file, _, chunks in copied:
            stripe, _, name = file.partition("/")
            by_stripe.setdefault((self.bases[file].url, stripe), {})[name] = chunks
        base_of = {base.url: base for base in self.bases.values()}
        await _io.gather_all(
            _write.check_written(base_of[url] / stripe, names)
            for (url, stripe), names in by_stripe.items()
        )
        return copied

    async def _copy_metadata(self) -> None:
        # Every piece file's zarr.json first, byte for byte, all in flight at once: small
        # objects, before the large writes queue up. (Measured: creating each array with
        # TensorStore as its data came took 0.2-1.3 s per piece on a busy S3 server, its
        # metadata requests waiting behind other pieces' uploads; the copy of a 1 GiB tree
        # took 3.6-4.2 s against 3.1-3.3 s this way and 2.9-3.0 s for a plain upload.)
        firsts = [pieces[0] for pieces in self.reader.files().values()]
        sources = await _io.gather_all(self.reader.metadata_bytes(p) for p in firsts)
        stores = {}
        for base in {b.url: b for b in self.bases.values()}.values():
            stores[base.url] = await ts.KvStore.open(base.spec(), context=self.context)
        await _io.gather_all(
            stores[self.bases[p.file].url].write(f"{p.file}/{_write.ZARR_JSON}", data)
            for p, data in zip(firsts, sources, strict=True)
        )

    async def _copy_file(self, pieces: list[PieceRecord]) -> tuple[str, int, int]:
        """Copies one piece file (its ``pieces``, several in a pack): name, bytes, chunks."""
        async with self.limit:
            first = pieces[0]
            buffer = None
            try:
                if len(pieces) == 1 and first.offset is None:
                    # One whole region: read in place (raw chunk files straight into an
                    # aligned buffer where local), its checksum verified there.
                    dtype = _tree.to_dtype(self.manifest.leaves[first.leaf].dtype)
                    buffer = self.buffers.take(math.prod(first.shape) * dtype.itemsize)
                    data = buffer.view(dtype).reshape(first.shape)
                    await self.reader.read_into(first, first.start, first.stop, data)
                else:
                    data = await self.reader.whole_file(first)
                rows = await self._raw_rows(first, data)
                if rows is None:
                    chunks = await self._write_encoded(first, data)
                else:
                    chunks = await self._write_raw(first, data, rows)
            finally:
                if buffer is not None:  # written or failed: nothing uses it any more
                    self.buffers.give_back(buffer)
            self.reader.forget((first.root, first.file))
            if self.progress is not None:
                self.progress()
            return first.file, data.nbytes, chunks

    async def _raw_rows(self, first: PieceRecord, data: np.ndarray) -> int | None:
        """Rows per chunk when the file can be copied byte for byte; ``None`` when it cannot.

        It can when both ends are local, the source's chunk files are ``data``'s raw bytes
        (uncompressed) and their keys use this version's separator (chunk files side by side,
        as ``_direct.chunk_jobs`` writes them): the copy's chunk files are then the source's.
        """
        if not self.bases[first.file].is_local:
            return None
        raw = await self.reader.raw_layout(first)
        if raw is None or raw[0] != data.shape or not _direct.can_write_raw(data):
            return None
        rows, separator = raw[1]
        return rows if separator == _direct.SEPARATOR else None

    async def _write_raw(self, first: PieceRecord, data: np.ndarray, rows: int) -> int:
        """Writes the chunk files of a raw piece from ``data`` (verified): their number.

        ``O_DIRECT`` where the destination takes it; not fsynced here (``_sync_local`` syncs
        every file of the copy at once).
        """
        base = self.bases[first.file]
        loop = asyncio.get_running_loop()
        if base.url not in self.direct_ok:  # probed once per destination directory
            probe = _direct.supports_direct
            self.direct_ok[base.url] = await loop.run_in_executor(
                self.io_pool, probe, pathlib.Path(base.key)
            )
        array_dir = pathlib.Path(base.key) / first.file
        jobs = _direct.chunk_jobs(
            array_dir, data, rows, direct=self.direct_ok[base.url], sync=False
        )
        await _io.gather_all(loop.run_in_executor(self.io_pool, job) for job in jobs)
        return len(jobs)

    async def _write_encoded(self, first: PieceRecord, data: np.ndarray) -> int:
        """Writes a piece file through TensorStore (compressed, or to an object store)."""
        array = await self.reader.array(first)
        metadata = array.spec().to_json()["metadata"]
        # Its zarr.json is already there (_copy_metadata): no metadata I/O here.
        out = await ts.open(
            {
                "driver": "zarr3",
                "kvstore": (self.bases[first.file] / first.file).spec(),
                "metadata": metadata,
                "assume_metadata": True,
                "store_data_equal_to_fill_value": True,
            },
            context=self.context,
        )
        await out.write(data, can_reference_source_data_indefinitely=True)
        grid = metadata["chunk_grid"]["configuration"]["chunk_shape"]
        return _write.grid_size(metadata["shape"], grid)


def _sync_local(
    bases: Mapping[str, KvPath], files: list[str], io_pool: concurrent.futures.Executor
) -> None:
    """Makes the piece files written on local directories durable before any manifest names
    them (as a save's commit does): every file, then every directory that gained entries."""
    written, dirs = [], set()
    for file in files:
        if not bases[file].is_local:
            continue  # an object store: the PUT is the promise (checked by one LIST)
        base = pathlib.Path(bases[file].key)
        piece = base / file
        written += [p for p in piece.rglob("*") if p.is_file()]
        dirs |= {piece, *(d for d in piece.parents if d == base or base in d.parents)}
    list(io_pool.map(_files.fsync_file, written))
    list(io_pool.map(_files.fsync_dir, dirs))


def _destinations(
    manifest: Manifest,
    target: KvPath,
    dest_roots: Sequence[Location] | None,
    dest_options: Mapping[str, Any] | None,
) -> tuple[Manifest, dict[str, KvPath]]:
    """The copy's manifest, and where each piece file goes: under ``target`` itself, or spread
    over ``dest_roots`` largest first, each onto the least-loaded root (as a save stripes)."""
    files: dict[str, list[PieceRecord]] = {}
    for p in manifest.pieces:
        files.setdefault(p.file, []).append(p)
    if not dest_roots:
        return manifest.in_item_dir(), dict.fromkeys(files, target)
    roots = [KvPath.parse(r, dest_options) for r in dest_roots]
    loads = [(0, i) for i in range(len(roots))]
    heapq.heapify(loads)
    index = {}
    for file in sorted(files, key=lambda f: (-_file_bytes(manifest, files[f]), f)):
        load, i = heapq.heappop(loads)
        index[file] = i
        heapq.heappush(loads, (load + _file_bytes(manifest, files[file]), i))
    copied = dataclasses.replace(
        manifest,
        roots=tuple(_root_string(r) for r in dest_roots),
        pieces=tuple(dataclasses.replace(p, root=index[p.file]) for p in manifest.pieces),
    )
    return copied, {file: roots[i] for file, i in index.items()}


def _files_at_once(manifest: Manifest, reader: _read.PieceReader, memory_bytes: int) -> int:
    """How many piece files fit in ``memory_bytes`` at once: at least one, the largest."""
    files = reader.files().values()
    largest = max((_file_bytes(manifest, ps) for ps in files), default=1)
    return max(1, memory_bytes // max(largest, 1))


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
            raise CheckpointFormatError(
                f"piece file {p.file} is on roots {seen[p.file]} and {p.root}: the item cannot "
                "be copied into one directory."
            )
