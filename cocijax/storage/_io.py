"""What the write path (``_write``) and the read path (``_read``) share.

Checksums, page- and cache-aligned host buffers, the TensorStore context, and running many
operations at once: the Python side issues every operation together and awaits them together.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import math
import mmap
import os
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorstore as ts
import xxhash

# xxh3_64 hashes ~15 GB/s per core on the development machine, zlib's CRC-32 ~2 GB/s (measured):
# with CRC-32, hashing was a large share of the CPU time of a save and of a verified restore.
CHECKSUM = "xxh3_64"
# Host buffers from this size up are anonymous mappings (see aligned_empty); smaller ones come
# from numpy's allocator, so that many tiny leaves do not cost one mapping each.
_MMAP_BYTES = 1 << 20
# Reading 256 MiB of tmpfs files into fresh shared anonymous mappings took 0.485 s of CPU,
# into private ones 0.350 s (medians of 7, interleaved, notes/memrestore.md).
_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def checksum(array: np.ndarray) -> int:
    """xxh3_64 of the C-order bytes of ``array`` (the manifest names it as :data:`CHECKSUM`)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def checksums(arrays: Iterable[np.ndarray]) -> list[int]:
    """:func:`checksum` of each array (one thread hop for a pack's many members)."""
    return [checksum(a) for a in arrays]


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


async def gather_all(aws) -> list[Any]:
    """``asyncio.gather`` that lets every task finish before raising the first error."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous host array whose data starts on an ``align``-byte boundary.

    XLA's CPU client adopts a 64-byte-aligned host buffer in ``jax.device_put`` instead of
    copying it (16-byte aligned numpy buffers are copied), so a restore on CPU fills its memory
    once; direct writes need block (4096-byte) alignment. Arrays from ``_MMAP_BYTES`` up get an
    anonymous mapping of their own, page-aligned and without numpy's transparent-huge-page
    advice. The mapping is private: Python's ``mmap.mmap(-1, n)`` is shared by default, which
    Linux backs with shmem, a file of tmpfs, and faulting in and freeing its pages costs more
    CPU than private anonymous memory does (see ``_PRIVATE``).
    """
    # No huge pages: on the development VM faulting in fresh huge pages took 0.3-1.9 s per GiB
    # from run to run, 4 KiB pages a steady 0.55-0.8 s (measured).
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= _MMAP_BYTES and align <= mmap.PAGESIZE:
        memory = mmap.mmap(-1, nbytes, flags=_PRIVATE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where THP is "always", not only on madvise
            memory.madvise(mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(memory, np.uint8).view(dtype).reshape(shape)
    raw = np.empty(nbytes + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


# On the development VM a copy of the 1 GiB tree into fresh pages ran at 0.25-0.9 GiB/s, into
# pages faulted in before at ~5 GiB/s (benchmarks/write_bench.py): hence buffers kept.
class HostBuffers:
    """Page-aligned host buffers that a save hands back for the next save of the same sizes.

    Faulting in fresh memory costs more than copying into memory already faulted in, so a save
    takes its buffers here and its commit gives them back.

    The memory bound: between saves this holds at most the buffers of the last save (one
    copy of this process's share of the tree). :meth:`take` first picks the kept buffers of
    the sizes it needs, frees every other kept buffer, and only then allocates what is missing,
    so a save of other shapes never holds more than its own copy.

    Example:
      >>> pool = HostBuffers()
      >>> first = pool.take([1 << 20])
      >>> pool.give_back(first)
      >>> pool.take([1 << 20])[0] is first[0]
      True
    """

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, sizes: Iterable[int]) -> list[np.ndarray]:
        """One flat, page-aligned ``uint8`` buffer per size, kept ones first."""
        sizes = list(sizes)
        with self._lock:
            free, self._free = self._free, {}
        got = [free[n].pop() if free.get(n) else None for n in sizes]
        del free  # kept buffers of other sizes are freed before anything is allocated
        return [
            aligned_empty((n,), np.uint8, mmap.PAGESIZE) if b is None else b
            for n, b in zip(sizes, got, strict=True)
        ]

    def give_back(self, buffers: Iterable[np.ndarray]) -> None:
        """Keeps ``buffers`` (from :meth:`take`, no longer used) for the next :meth:`take`."""
        with self._lock:
            for b in buffers:
                self._free.setdefault(b.nbytes, []).append(b)

    def clear(self) -> None:
        """Frees every kept buffer."""
        with self._lock:
            self._free = {}

    @property
    def nbytes(self) -> int:
        """Bytes kept for the next save."""
        with self._lock:
            return sum(b.nbytes for bs in self._free.values() for b in bs)


_gc_lock = threading.Lock()
_gc_pauses = 0  # how many pause_gc blocks are open, in any thread
_gc_was_enabled = False


# Restoring 1024 leaves spent 0.2-0.26 s in the collector (measured with gc.callbacks).
@contextlib.contextmanager
def pause_gc():
    """Keeps Python's cyclic garbage collector from running inside the block (any thread).

    A snapshot or a restore of a tree with many leaves allocates enough objects to trigger
    ~100 collections, each walking every object of the process. Reference counting still frees
    what it can; the collector's previous state comes back when the last open block ends.

    Example:
      >>> import gc
      >>> with pause_gc():
      ...     gc.isenabled()
      False
      >>> gc.isenabled()
      True
    """
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def aligned_copy(array: np.ndarray) -> np.ndarray:
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def run_sync(coro: Any) -> Any:
    """Runs ``coro`` to completion from synchronous code, inside a running event loop or not.

    (Orbax's own helper is private; this is all of it that is needed: a thread of its own when
    the caller's thread already runs a loop.)
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:  # outside the except: an error of coro is not chained to "no running loop"
        return asyncio.run(_boxed(coro)).value
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _boxed(coro)).result().value


class _Box:
    __slots__ = ("value",)

    def __repr__(self) -> str:
        return "<run_sync result>"


async def _boxed(coro: Any) -> _Box:
    # asyncio.run formats its main task, result included, when it puts the SIGINT handler
    # back (Python 3.11's signal.getsignal builds an error message holding repr() of the
    # handler, which holds the task): a restore's result is its arrays, and numpy formatting
    # them took 12 of the 98 ms of restoring 1024 leaves of 1 KiB (interleaved A/B, medians).
    box = _Box()
    box.value = await coro
    return box
