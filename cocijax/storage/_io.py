"""Piece I/O: zarr3 specs, concurrent writes and reads, checksums, host buffers, ``verify``.

Every piece is a standard zarr v3 array (``zarr3`` driver on the ``file`` kvstore), so
zarr-python reads it without cocijax. TensorStore opens every array and moves compressed pieces
and parts of pieces; whole uncompressed pieces are read from their chunk files by ``_direct``.
The Python side issues every operation at once and awaits them together.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import mmap
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts
import xxhash
from orbax.checkpoint._src import asyncio_utils

from cocijax.storage import _direct, _layout, _manifest, _tree
from cocijax.storage._manifest import CorruptCheckpointError, Manifest, PieceRecord, Problem

# xxh3_64 hashes ~15 GB/s per core on the development machine, zlib's CRC-32 ~2 GB/s (measured):
# with CRC-32, hashing was a large share of the CPU time of a save and of a verified restore.
CHECKSUM = "xxh3_64"
# Host buffers from this size up are anonymous mappings (see aligned_empty); smaller ones come
# from numpy's allocator, so that many tiny leaves do not cost one mapping each.
_MMAP_BYTES = 1 << 20


def checksum(array: np.ndarray) -> int:
    """xxh3_64 of the C-order bytes of ``array`` (the manifest names it as :data:`CHECKSUM`)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def make_context(concurrency: int) -> ts.Context:
    """TensorStore context: ``concurrency`` parallel file operations, fsync on, no caching."""
    return ts.Context(
        {
            "file_io_concurrency": {"limit": concurrency},
            "data_copy_concurrency": {"limit": max(1, os.cpu_count() or 1)},
            # fsyncs each chunk file and its directory before the write future completes.
            # (Measured: syncing all files once at the end instead was not faster here.)
            "file_io_sync": True,
            # Pieces are written once and read once: a cache only costs memory.
            "cache_pool": {"total_bytes_limit": 0},
        }
    )


def chunk_shape(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> list[int]:
    """Chunk grid for a piece: whole trailing dimensions, axis 0 cut to about ``chunk_bytes``.

    When a chunk holds several rows, their count is rounded down so that every chunk spans a
    multiple of 4096 bytes: chunks of a page-aligned buffer then stay page-aligned.
    """
    if not shape:
        return []
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, min(shape[0], chunk_bytes // max(row, 1)))
    step = _direct.BLOCK // math.gcd(max(row, 1), _direct.BLOCK)
    if rows < shape[0] and rows >= step:
        rows -= rows % step
    return [rows, *shape[1:]]


def write_spec(
    path: pathlib.Path,
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    chunk_bytes: int,
    compression: str | None,
    compression_level: int,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": chunk_shape(shape, dtype.itemsize, chunk_bytes)},
        },
    }
    # Pinned rather than left to defaults: _direct writes uncompressed chunk files itself.
    metadata["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
    metadata["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression == "zstd":
        metadata["codecs"].append({"name": "zstd", "configuration": {"level": compression_level}})
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "metadata": metadata,
        "create": True,
        # Zero chunks must exist on disk too: reads refuse missing chunks (see read_spec).
        "store_data_equal_to_fill_value": True,
    }


def read_spec(path: pathlib.Path) -> dict[str, Any]:
    # A missing chunk file must fail the read, not come back as zeros.
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "open": True,
        "fill_missing_data_reads": False,
    }


async def gather_all(aws) -> list[Any]:
    """``asyncio.gather`` that lets every task finish before raising the first error."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def write_piece(spec: dict[str, Any], data: np.ndarray, context: ts.Context) -> None:
    array = await ts.open(spec, context=context)
    await array.write(data, can_reference_source_data_indefinitely=True)


def fsync_tree(top: pathlib.Path) -> None:
    """fsyncs ``top``, every directory below it, and ``top``'s parent (which gained an entry).

    TensorStore already fsynced every file and the directory holding it; the directories it
    created (``c/``, ``c/0/``) and the stripe directory itself are made durable here.
    """
    for dirpath, _, _ in os.walk(top):
        _manifest.fsync_dir(dirpath)
    _manifest.fsync_dir(top.parent)


def _leaf_name(manifest: Manifest, piece: PieceRecord) -> str:
    return manifest.leaves[piece.leaf].path


class PieceReader:
    """Reads pieces of one manifest, each file at most once, verifying checksums.

    Full pieces are read (and cached until :meth:`clear`) when checksums are verified, since a
    checksum needs every byte; otherwise only the requested region of a piece is read.
    """

    def __init__(
        self,
        manifest: Manifest,
        item_dir: pathlib.Path,
        context: ts.Context,
        pool: concurrent.futures.Executor,
        *,
        verify: bool,
        io_pool: concurrent.futures.Executor | None = None,
    ):
        self._m = manifest
        self._dir = item_dir
        self._ctx = context
        self._pool = pool  # checksums
        self._io_pool = io_pool or pool  # blocking chunk-file reads
        if manifest.checksum not in (None, CHECKSUM):
            raise _manifest.CheckpointFormatError(
                f"{item_dir}: checksums are {manifest.checksum!r}; this version of cocijax "
                f"reads {CHECKSUM!r} only."
            )
        self._verify = verify and manifest.checksum is not None
        self._files: dict[tuple[int, str], list[PieceRecord]] = {}
        for p in manifest.pieces:
            self._files.setdefault((p.root, p.file), []).append(p)
        self._open: dict[tuple[int, str], asyncio.Future] = {}
        self._full: dict[tuple[int, str], asyncio.Future] = {}
        self._uses: dict[tuple[int, str], int] = {}

    def _error(self, piece: PieceRecord, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"Leaf {_leaf_name(self._m, piece)}: {message} in piece "
            f"{self._m.piece_path(piece, self._dir)}."
        )

    async def _array(self, piece: PieceRecord) -> ts.TensorStore:
        key = (piece.root, piece.file)
        if key not in self._open:
            self._open[key] = asyncio.ensure_future(
                ts.open(read_spec(self._m.piece_path(piece, self._dir)), context=self._ctx)
            )
        try:
            array = await self._open[key]
        except Exception as e:  # TensorStore raises ValueError for most I/O failures.
            raise self._error(piece, f"cannot open the zarr array ({e})") from e
        expected = piece.shape if piece.offset is None else None
        if expected is not None and tuple(array.shape) != expected:
            raise self._error(piece, f"stored shape {tuple(array.shape)}, expected {expected}")
        return array

    async def _read_full(self, piece: PieceRecord) -> tuple[np.ndarray, dict[Any, str]]:
        key = (piece.root, piece.file)
        if key not in self._full:
            self._full[key] = asyncio.ensure_future(self._load_and_check(piece))
        return await self._full[key]

    async def _load_and_check(self, piece: PieceRecord) -> tuple[np.ndarray, dict[Any, str]]:
        """The whole file, and the checksum failures of its members (a pack holds many)."""
        array = await self._array(piece)
        try:
            data = await array.read()
        except Exception as e:
            raise self._error(piece, f"cannot read the data ({e})") from e
        bad: dict[Any, str] = {}
        if self._verify:
            loop = asyncio.get_running_loop()
            members = self._files[(piece.root, piece.file)]
            sums = await asyncio.gather(
                *[loop.run_in_executor(self._pool, checksum, _member(data, m)) for m in members]
            )
            for m, got in zip(members, sums, strict=True):
                if m.checksum is not None and got != m.checksum:
                    bad[_ident(m)] = _mismatch(m.checksum, got)
        return data, bad

    async def read_into(
        self,
        piece: PieceRecord,
        start: tuple[int, ...],
        stop: tuple[int, ...],
        dest: np.ndarray,
    ) -> None:
        """Reads the part ``[start, stop)`` (global indices, inside the piece) into ``dest``.

        A whole unpacked piece goes straight from TensorStore into ``dest`` and is checksummed
        there; a part of a piece, or a packed member, is copied from the whole file (read once,
        verified, and held until its last announced use) unless no checksum is needed.
        """
        key = (piece.root, piece.file)
        local = _layout.local_slices(start, stop, piece.start)
        whole = piece.offset is None and start == piece.start and stop == piece.stop
        if piece.offset is None and (whole or not self._verify):
            self._release(key)
            array = await self._array(piece)
            try:
                await self._read_array(piece, array, local, dest, whole)
            except Exception as e:
                raise self._error(piece, f"cannot read the data ({e})") from e
            if whole and self._verify and piece.checksum is not None:
                loop = asyncio.get_running_loop()
                got = await loop.run_in_executor(self._pool, checksum, dest)
                if got != piece.checksum:
                    raise self._error(piece, _mismatch(piece.checksum, got))
            return
        try:
            data, bad = await self._read_full(piece)
        finally:
            self._release(key)
        if _ident(piece) in bad:
            raise self._error(piece, bad[_ident(piece)])
        dest[...] = _member(data, piece)[local]

    async def _read_array(
        self, piece: PieceRecord, array: ts.TensorStore, local: tuple, dest: np.ndarray, whole: bool
    ) -> None:
        rows = None
        if whole and dest.flags.c_contiguous:
            rows = _direct.raw_chunk_rows(array.spec().to_json().get("metadata", {}))
        if rows is None:
            await ts.array(dest, copy=False, write=True).write(array[local])
            return
        # Raw chunk files of a whole piece: read straight into their rows of ``dest``.
        loop = asyncio.get_running_loop()
        path = self._m.piece_path(piece, self._dir)
        await gather_all(
            loop.run_in_executor(self._io_pool, job) for job in _direct.read_jobs(path, dest, rows)
        )

    def reserve(self, piece: PieceRecord) -> None:
        """Announces one future :meth:`read_into` call on ``piece``'s file.

        A whole file read for checksumming is dropped from memory after its last announced
        use, so a restore holds only the pieces still in flight, not the whole checkpoint.
        """
        key = (piece.root, piece.file)
        self._uses[key] = self._uses.get(key, 0) + 1

    def _release(self, key: tuple[int, str]) -> None:
        if key in self._uses:
            self._uses[key] -= 1
            if self._uses[key] <= 0:
                del self._uses[key]
                self.forget(key)

    def files(self) -> dict[tuple[int, str], list[PieceRecord]]:
        """Pieces grouped by the file holding them."""
        return self._files

    def forget(self, key: tuple[int, str]) -> None:
        """Drops the cached data of one file."""
        self._full.pop(key, None)
        self._open.pop(key, None)


def _mismatch(expected: int, got: int) -> str:
    return f"checksum mismatch ({CHECKSUM} expected {expected}, got {got})"


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous host array whose data starts on an ``align``-byte boundary.

    XLA's CPU client adopts a 64-byte-aligned host buffer in ``jax.device_put`` instead of
    copying it (16-byte aligned numpy buffers are copied), so a restore on CPU fills its memory
    once; direct writes need block (4096-byte) alignment. Arrays from ``_MMAP_BYTES`` up get an
    anonymous mapping of their own, page-aligned and without numpy's transparent-huge-page
    advice: on the development VM, faulting in fresh huge pages took 0.3-1.9 s per GiB from run
    to run, 4 KiB pages a steady 0.55-0.8 s (measured).
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= _MMAP_BYTES and align <= mmap.PAGESIZE:
        return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8).view(dtype).reshape(shape)
    raw = np.empty(nbytes + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def _ident(piece: PieceRecord) -> tuple[Any, ...]:
    return (piece.leaf, piece.start, piece.offset)


def _member(data: np.ndarray, piece: PieceRecord) -> np.ndarray:
    if piece.offset is None:
        return data
    n = math.prod(piece.shape)
    flat = data[piece.offset : piece.offset + n]
    if flat.size != n:
        raise CorruptCheckpointError(
            f"packed array holds {data.size} elements, expected at least {piece.offset + n}"
        )
    return flat.reshape(piece.shape)


def verify(
    item_dir: os.PathLike | str, roots: Sequence[os.PathLike | str | None] | None = None
) -> list[Problem]:
    """Checks every piece of a committed item against its manifest.

    Reads every byte and recomputes the checksums; also catches missing files, unreadable zarr
    metadata and wrong shapes. A missing or invalid manifest is reported as one problem with an
    empty ``leaf_path``.

    Args:
      item_dir: the Orbax item directory.
      roots: where the stripes are now, if they were moved (see ``Manifest.with_roots``).

    Returns:
      The problems found, one per defective piece; ``[]`` when the item is intact.

    Example:
      >>> assert cj.storage.verify(path / "default") == []  # doctest: +SKIP
    """
    item_dir = pathlib.Path(item_dir)
    try:
        manifest = _manifest.read_manifest(item_dir)
    except _manifest.CheckpointFormatError as e:
        return [Problem("", str(item_dir / _manifest.MANIFEST_NAME), str(e))]
    manifest = manifest.with_roots(roots)
    context = make_context(16)
    with (
        concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 1)) as pool,
        concurrent.futures.ThreadPoolExecutor(16) as io_pool,
    ):
        reader = PieceReader(manifest, item_dir, context, pool, verify=True, io_pool=io_pool)

        limit = asyncio.Semaphore(8)

        async def check(key: tuple[int, str], pieces: list[PieceRecord]) -> list[Problem]:
            out = []
            async with limit:
                for piece in pieces:
                    try:
                        dtype = _tree.to_dtype(manifest.leaves[piece.leaf].dtype)
                        scratch = aligned_empty(piece.shape, dtype)
                        await reader.read_into(piece, piece.start, piece.stop, scratch)
                    except CorruptCheckpointError as e:
                        file = str(manifest.piece_path(piece, item_dir))
                        out.append(Problem(_leaf_name(manifest, piece), file, str(e)))
                # Bounded memory: at most `limit` whole files are held at once.
                reader.forget(key)
            return out

        async def run() -> list[list[Problem]]:
            return await asyncio.gather(*[check(k, v) for k, v in reader.files().items()])

        found = asyncio_utils.run_sync(run())
    return [p for problems in found for p in problems]
