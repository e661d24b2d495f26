"""Direct writes (and reads) of uncompressed zarr v3 chunk files.

FastPersist's main device-side technique (Wang et al., 2024, arXiv:2406.13768): checkpoint bytes
are written with ``O_DIRECT`` from page-aligned host buffers, so the kernel neither copies them
into the page cache nor faults in cache pages (BENCHMARKS.md, "Measurements behind design
choices", has what that saved).

TensorStore makes every piece's ``zarr.json`` (``_write.metadata_file``) and reads compressed
pieces and parts of pieces; this module moves the files of pieces stored with the plain
``bytes`` codec, whose encoding is the array's little-endian C-order bytes (see
``_write.write_spec``, which pins codec and chunk keys). Whole pieces are read back the same
way, with ``O_DIRECT`` straight into the destination buffer: TensorStore's read path adds a
buffer and a copy per chunk, and a buffered read fills page-cache pages and then copies them.
A chunk whose address is not block-aligned, the unaligned tail of a file and every file on a
file system without ``O_DIRECT`` (tmpfs before Linux 6.6) go through the page cache instead.
Every file is fsynced before its job returns.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

# Alignment of addresses, offsets and lengths for O_DIRECT (covers 512-byte and 4 KiB logical
# blocks); _write.chunk_shape also starts chunks on it when their rows allow.
BLOCK = 4096
# Linux writes at most about 2 GiB per write(2) call.
_MAX_WRITE = 1 << 30
# Chunk key separator of the pieces this version writes: chunk files "c.<i>.0..." side by side
# in the piece directory (``_write.write_spec``). Pieces written with "/" are still read.
SEPARATOR = "."


def can_write_raw(data: np.ndarray) -> bool:
    """Whether ``data``'s memory is exactly its uncompressed zarr encoding."""
    return (
        data.ndim >= 1
        and data.size > 0
        and data.flags.c_contiguous
        and (sys.byteorder == "little" or data.dtype.itemsize == 1)
    )


def supports_direct(directory: pathlib.Path) -> bool:
    """Whether files in ``directory`` accept ``O_DIRECT`` (tmpfs before Linux 6.6 does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".cocijax-direct-probe-") as f:
        try:
            os.close(os.open(f.name, os.O_WRONLY | os.O_DIRECT))
        except OSError:
            return False
    return True


def chunk_jobs(
    array_dir: pathlib.Path, data: np.ndarray, chunk_rows: int, *, direct: bool, sync: bool = True
) -> list[Callable[[], pathlib.Path]]:
    """One job per chunk file of the zarr array at ``array_dir``: writes it (:func:`write_file`).

    Chunks cut axis 0 into ``chunk_rows`` rows (whole trailing dimensions, as
    ``_write.chunk_shape`` plans them); the last chunk is zero-extended (zero is the fill value) to
    the full chunk shape, as zarr stores edge chunks. Chunk keys follow zarr v3's default
    encoding with :data:`SEPARATOR`: ``c.<i>.0...``. ``array_dir`` is created here.
    """
    array_dir.mkdir(parents=True, exist_ok=True)
    return [
        lambda p=path, c=chunk: _write_chunk(p, c, chunk_rows, direct, sync)
        for path, chunk in _chunk_files(array_dir, data, chunk_rows, SEPARATOR)
    ]


def _chunk_files(
    array_dir: pathlib.Path, array: np.ndarray, chunk_rows: int, separator: str
) -> list[tuple[pathlib.Path, np.ndarray]]:
    """Each chunk file's path with the rows of ``array`` it holds (zarr v3 default keys)."""
    zeros = ["0"] * (array.ndim - 1)
    return [
        (array_dir / separator.join(["c", str(i), *zeros]), array[start : start + chunk_rows])
        for i, start in enumerate(range(0, array.shape[0], chunk_rows))
    ]


def _write_chunk(
    path: pathlib.Path, chunk: np.ndarray, chunk_rows: int, direct: bool, sync: bool
) -> pathlib.Path:
    # An edge chunk is stored full size: the missing rows read as zeros (the fill value).
    size = chunk.nbytes // chunk.shape[0] * chunk_rows
    data = memoryview(chunk.reshape(-1).view(np.uint8))
    return write_file(path, data, direct=direct, size=size, sync=sync)


def write_file(
    path: pathlib.Path,
    data: memoryview,
    *,
    direct: bool,
    size: int | None = None,
    sync: bool = True,
) -> pathlib.Path:
    """Creates ``path`` holding ``data``, zero-extended to ``size`` bytes; returns ``path``.

    With ``direct``, the block-aligned head goes through ``O_DIRECT`` when ``data`` starts on a
    block boundary; the rest is written through the page cache. ``sync`` fsyncs the file;
    without it the caller does (:func:`fsync_file`).
    """
    aligned = direct and np.frombuffer(data, np.uint8).ctypes.data % BLOCK == 0
    head = len(data) // BLOCK * BLOCK if aligned else 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if head else 0)
    fd = os.open(path, flags, 0o644)
    try:
        _write_all(fd, data[:head])
        if head < len(data):
            if head:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _write_all(fd, data[head:])
        if size is not None and size > len(data):
            os.ftruncate(fd, size)
        if sync:
            os.fsync(fd)
    except OSError as e:  # write(2) and fsync(2) errors do not name the file: a full disk must.
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        os.close(fd)
    return path


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done : done + _MAX_WRITE])


def raw_chunk_layout(metadata: dict[str, Any]) -> tuple[int, str] | None:
    """Rows per chunk and key separator when a zarr v3 array's chunk files are its raw bytes.

    ``metadata`` is the array's stored metadata (``TensorStore.spec().to_json()["metadata"]``):
    the plain little-endian ``bytes`` codec, default chunk keys (``.`` or ``/``) and chunks of
    whole trailing dimensions, as ``_write.write_spec`` makes uncompressed pieces. ``None``
    otherwise.
    """
    codecs = metadata.get("codecs", [])
    encoding = metadata.get("chunk_key_encoding", {})
    shape = metadata.get("shape", [])
    chunks = metadata.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", [])
    plain = (
        len(codecs) == 1
        and codecs[0].get("name") == "bytes"
        and codecs[0].get("configuration", {}).get("endian", "little") == "little"
        and sys.byteorder == "little"
    )
    separator = encoding.get("configuration", {}).get("separator", "/")
    default_keys = encoding.get("name") == "default" and separator in ("/", ".")
    if plain and default_keys and shape and len(chunks) == len(shape) and chunks[1:] == shape[1:]:
        return int(chunks[0]), separator
    return None


def read_jobs(
    array_dir: pathlib.Path, dest: np.ndarray, layout: tuple[int, str]
) -> list[Callable[[], None]]:
    """One job per chunk file of the raw zarr array at ``array_dir``: reads it into ``dest``.

    ``dest`` is C-contiguous with the array's shape; ``layout`` is what
    :func:`raw_chunk_layout` found. Each file must hold a full chunk (edge chunks are
    zero-extended); a missing or short file raises ``OSError`` naming it.
    """
    chunk_rows, separator = layout
    chunk_bytes = dest.nbytes // dest.shape[0] * chunk_rows
    return [
        lambda p=path, r=rows: _read_file(p, r, chunk_bytes)
        for path, rows in _chunk_files(array_dir, dest, chunk_rows, separator)
    ]


def _read_file(path: pathlib.Path, rows: np.ndarray, size: int) -> None:
    """Reads ``path`` into ``rows``: the block-aligned head with ``O_DIRECT`` where it can."""
    into = memoryview(rows.reshape(-1).view(np.uint8))
    aligned = hasattr(os, "O_DIRECT") and rows.ctypes.data % BLOCK == 0
    head = len(into) // BLOCK * BLOCK if aligned else 0
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if head else 0))
    except OSError as e:
        if not head or e.errno != errno.EINVAL:  # EINVAL: no O_DIRECT on this file system
            raise
        head, fd = 0, os.open(path, os.O_RDONLY)
    try:
        stored = os.fstat(fd).st_size
        if stored != size:
            raise OSError(errno.EIO, f"chunk file holds {stored} bytes, expected {size}", str(path))
        _read_all(fd, into[:head], 0, path)
        if head < len(into):
            if head:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _read_all(fd, into[head:], head, path)
    finally:
        os.close(fd)


def _read_all(fd: int, into: memoryview, offset: int, path: pathlib.Path) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done : done + _MAX_WRITE]], offset + done)
        if not got:
            raise OSError(errno.EIO, f"chunk file ended after {offset + done} bytes", str(path))
        done += got
