"""Host buffers for restore (cocijax.storage._io)."""

import asyncio

import ml_dtypes
import numpy as np
import pytest

from cocijax.storage import _direct, _io


@pytest.mark.parametrize("shape", [(), (0,), (3,), (5, 7), (512, 1024)])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, ml_dtypes.bfloat16])
@pytest.mark.parametrize("align", [64, _direct.BLOCK])
def test_aligned_empty_is_aligned_and_writable(shape, dtype, align):
    # (512, 1024) is above the size from which buffers are anonymous mappings.
    out = _io.aligned_empty(shape, dtype, align)
    assert out.shape == shape and out.dtype == np.dtype(dtype)
    assert out.size == 0 or out.ctypes.data % align == 0  # an empty array has no data to align
    assert out.flags.c_contiguous and out.flags.writeable
    out[...] = 1
    assert (out == 1).all()


def test_a_large_buffer_is_private_anonymous_memory_not_shmem():
    # Python's mmap.mmap(-1, n) is a shared mapping, which Linux backs with shmem: faulting its
    # pages in and freeing them cost a restore more CPU than private memory (notes/memrestore.md).
    out = _io.aligned_empty((4 << 20,), np.uint8)
    address = out.ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                assert perms.endswith("p"), line  # "rw-p", not "rw-s" (/dev/zero, shmem)
                return
    raise AssertionError(f"no mapping holds {address:#x}")


def test_aligned_copy_is_an_equal_independent_array():
    source = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:]  # not contiguous
    copy = _io.aligned_copy(source)
    np.testing.assert_array_equal(copy, source)
    assert copy.ctypes.data % 64 == 0 and not np.shares_memory(copy, source)


def test_pause_gc_nests_across_threads_and_restores_the_previous_state():
    import gc
    import threading

    inner_open, release = threading.Event(), threading.Event()

    def other_thread():
        with _io.pause_gc():
            inner_open.set()
            release.wait(10)

    was = gc.isenabled()
    try:
        gc.enable()
        with _io.pause_gc():
            worker = threading.Thread(target=other_thread)
            worker.start()
            inner_open.wait(10)
        assert not gc.isenabled()  # the other thread's block is still open
        release.set()
        worker.join(10)
        assert gc.isenabled()
        gc.disable()
        with _io.pause_gc():
            pass
        assert not gc.isenabled()  # a collector the caller had disabled stays disabled
    finally:
        (gc.enable if was else gc.disable)()


def test_host_buffers_reuse_equal_sizes_and_free_the_others_before_allocating():
    pool = _io.HostBuffers()
    a, b = pool.take([1 << 20, 3 * 4096])
    assert a.ctypes.data % 4096 == 0 and b.ctypes.data % 4096 == 0
    pool.give_back([a, b])
    assert pool.nbytes == (1 << 20) + 3 * 4096
    (c,) = pool.take([3 * 4096])
    assert c is b
    assert pool.nbytes == 0  # the 1 MiB buffer no take asked for is freed
    (d,) = pool.take([1 << 20])
    assert d is not a and d.nbytes == 1 << 20
    pool.give_back([d])
    pool.clear()
    assert pool.nbytes == 0


@pytest.mark.parametrize("in_a_loop", [False, True])
def test_run_sync_returns_the_result_without_formatting_it(in_a_loop):
    # asyncio.run formats its main task, result included, when it puts the SIGINT handler
    # back: a restore's result is a list of arrays, and numpy formatting them cost ~12 ms per
    # 1024 small leaves. run_sync must hand the result back untouched.
    formatted = []

    class Result:
        def __repr__(self) -> str:
            formatted.append(self)
            return "Result()"

    result = Result()

    async def work() -> Result:
        return result

    got = []

    async def inside_a_loop() -> None:  # (returns nothing: this asyncio.run formats its result)
        got.append(_io.run_sync(work()))

    if in_a_loop:
        asyncio.run(inside_a_loop())
    else:
        got.append(_io.run_sync(work()))
    assert got == [result]
    assert formatted == []
