"""The commit of a save: a snapshot's pieces written to their roots, made durable, the manifest.

What the handler's commit future runs once Orbax has created the item directory: every piece is
written (all roots in parallel; the chunk files of uncompressed pieces on local roots directly,
by ``_direct``, the others through TensorStore, ``_write``), its checksums computed meanwhile;
then local stripes are fsynced and object stores listed, and only then is the manifest (with
several processes, this process's part of it) written: it names durable pieces only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from cocijax import _files
from cocijax.storage import _codec, _direct, _io, _layout, _manifest_io, _parts, _snapshot, _write
from cocijax.storage._kvpath import KvPath
from cocijax.storage._options import Options
from cocijax.storage._records import VERSION, Manifest, PieceRecord


@dataclasses.dataclass(frozen=True)
class Writer:
    """What writes a handler's saves: its roots, options, threads and TensorStore context.

    Attributes:
      roots: the handler's resolved roots (``None``: the item directory).
      options: the handler's options.
      context: the TensorStore context of the writes.
      pool: threads for checksums and for encoding and writing the manifest.
      io_pool: threads for blocking direct writes and fsyncs.
      buffers: the handler's host buffers; a snapshot's memory goes back there once written
        (with ``options.reuse_host_buffers``).
      direct_ok: per root index, whether ``O_DIRECT`` works there (probed once; the handler
        keeps it from one save to the next).
    """

    roots: tuple[pathlib.Path | KvPath | None, ...]
    options: Options
    context: ts.Context
    pool: concurrent.futures.Executor
    io_pool: concurrent.futures.Executor
    buffers: _io.HostBuffers
    direct_ok: dict[int, bool]

    def start_raw(
        self, stripe_dir: pathlib.Path, piece: _layout.Piece, data: np.ndarray
    ) -> list[concurrent.futures.Future] | None:
        """Starts the direct writes of ``piece``'s chunk files; ``None`` if it needs TensorStore."""
        if not (
            self.options.direct_writes
            and self.options.encoding.compression is None
            and isinstance(stripe_dir, pathlib.Path)
            and _direct.can_write_raw(data)
        ):
            return None
        if piece.root not in self.direct_ok:  # probed once per root
            self.direct_ok[piece.root] = _direct.supports_direct(stripe_dir.parent)
        array_dir = stripe_dir / piece.name
        chunk_bytes = self.options.encoding.chunk_bytes
        rows = _write.chunk_shape(piece.shape, piece.dtype.itemsize, chunk_bytes)[0]
        # Not fsynced one by one: the commit fsyncs every file at once once all are written,
        # which the file system commits together (each file's own fsync, while others were
        # still being written, cost a journal commit of its own).
        direct = self.direct_ok[piece.root]
        jobs = _direct.chunk_jobs(array_dir, data, rows, direct=direct, sync=False)
        # The array's zarr.json: TensorStore's own bytes, made once per metadata in memory.
        meta = memoryview(_write.metadata_file(self._spec(array_dir, piece)))
        path = array_dir / _write.ZARR_JSON
        jobs.append(functools.partial(_direct.write_file, path, meta, direct=False, sync=False))
        return [self.io_pool.submit(job) for job in jobs]

    def _spec(self, array_dir: pathlib.Path, piece: _layout.Piece) -> dict[str, Any]:
        return _write.write_spec(array_dir, piece.dtype, piece.shape, self.options.encoding)

    async def commit(self, directory: pathlib.Path, snapshot: _snapshot.Snapshot) -> None:
        """Writes ``snapshot`` into the item ``directory``, its manifest (or part) last.

        Raises:
          OSError: a piece, an fsync or the manifest failed (names the file), or an object store
            does not list every object written.
          ValueError: TensorStore refused a write (names the array).
          CheckpointFormatError: the pieces do not cover every leaf.
        """
        loop = asyncio.get_running_loop()
        stripe = snapshot.stripe
        used = sorted({p.root for p in snapshot.pieces})
        stripe_dirs = {r: (self.roots[r] or directory) / stripe for r in used}
        local = {r: d for r, d in stripe_dirs.items() if isinstance(d, pathlib.Path)}
        for d in local.values():
            d.mkdir(exist_ok=True)
        sums: list[asyncio.Future] = []
        writes = []
        for piece in snapshot.pieces:
            data = snapshot.data(piece)
            piece_dir = stripe_dirs[piece.root] / piece.name
            started = snapshot.early.get(piece.name)
            if started is None:
                started = self.start_raw(stripe_dirs[piece.root], piece, data)
            if started is None:
                write = _write.write_piece(self._spec(piece_dir, piece), data, self.context)
            else:
                write = _io.gather_all(asyncio.wrap_future(f) for f in started)
            writes.append(write)
            if self.options.checksums:
                # One job per piece, not per member: a pack of 1024 leaves is one thread hop.
                members = snapshot.member_views(piece)
                sums.append(loop.run_in_executor(self.pool, _io.checksums, members))
        # The manifest needs only the checksums, which are done long before the writes: it is
        # built and encoded meanwhile (1024 leaves: ~10 ms that no longer follow the writes).
        written, encoded = await _io.gather_all(
            [_io.gather_all(writes), self._encoded_manifest(directory, snapshot, sums)]
        )
        if self.options.reuse_host_buffers:
            self.buffers.give_back(snapshot.owned)  # every write and checksum is done
        # Local stripes are made durable with fsync: every file at once, then every directory
        # that gained entries (piece directories, stripe directories and the roots holding
        # them). On an object store a successful PUT is the promise, and one LIST checks that
        # every object is there.
        files = [path for paths in written if paths for path in paths]
        await _io.gather_all(
            loop.run_in_executor(self.io_pool, _files.fsync_file, f) for f in files
        )
        dirs = {local[p.root] / p.name for p in snapshot.pieces if p.root in local}
        dirs |= {*local.values(), *(d.parent for d in local.values())}
        await _io.gather_all(
            [loop.run_in_executor(self.io_pool, _files.fsync_dir, d) for d in dirs]
            + [
                _write.check_written(d, self._chunk_counts(snapshot.pieces, r))
                for r, d in stripe_dirs.items()
                if r not in local
            ]
        )
        # The manifest (or part) is the last thing written: it only names durable pieces.
        if not _writes_part(self.options):
            # This process's part is the whole manifest: written as such, durably, it leaves
            # ``finalize`` nothing to merge (no part written, read back and parsed again).
            await loop.run_in_executor(
                self.pool, _manifest_io.write_manifest_bytes, directory, encoded
            )
            return
        _parts.write_part(directory, jax.process_index(), encoded)

    async def _encoded_manifest(
        self, directory: pathlib.Path, snapshot: _snapshot.Snapshot, sums: list[asyncio.Future]
    ) -> bytes:
        """The bytes of this save's manifest (of this process's part, with several)."""
        checks = iter([c for per_piece in await _io.gather_all(sums) for c in per_piece])
        multi = jax.process_count() > 1
        records = []
        for piece in snapshot.pieces:
            for chunk, start, stop, offset in piece.members:
                records.append(
                    PieceRecord(
                        leaf=chunk.leaf,
                        root=piece.root,
                        file=f"{snapshot.stripe}/{piece.name}",
                        start=start,
                        stop=stop,
                        offset=offset,
                        checksum=next(checks) if self.options.checksums else None,
                        process=jax.process_index(),
                    )
                )
        part = Manifest(
            version=VERSION,
            checksum=_io.CHECKSUM if self.options.checksums else None,
            roots=tuple(None if r is None else str(r) for r in self.roots),
            leaves=tuple(snapshot.leaves),
            pieces=tuple(records),
            custom_metadata=snapshot.custom_metadata,
            # A host-local copy of several processes: this process's shards only.
            holder=jax.process_index() if self.options.host_local and multi else None,
        )
        if not _writes_part(self.options):
            encode = functools.partial(_codec.encode_manifest, directory, part)
        else:  # a part: finalize checks that the parts cover every leaf when it merges them
            where = str(_parts.part_path(directory, jax.process_index()))
            encode = functools.partial(_codec.encode_part, part, where)
        return await asyncio.get_running_loop().run_in_executor(self.pool, encode)

    def _chunk_counts(self, pieces: Sequence[_layout.Piece], root: int) -> dict[str, int]:
        chunk_bytes = self.options.encoding.chunk_bytes
        return {
            p.name: _write.chunk_count(p.shape, p.dtype.itemsize, chunk_bytes)
            for p in pieces
            if p.root == root
        }


def _writes_part(options: Options) -> bool:
    """Whether this process writes a manifest part (several processes, one shared item) rather
    than the whole manifest (one process, or a host-local copy of its own)."""
    return jax.process_count() > 1 and not options.host_local
