"""Host buffers for restore (cocijax.storage._io)."""

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


def test_aligned_copy_is_an_equal_independent_array():
    source = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:]  # not contiguous
    copy = _io.aligned_copy(source)
    np.testing.assert_array_equal(copy, source)
    assert copy.ctypes.data % 64 == 0 and not np.shares_memory(copy, source)
