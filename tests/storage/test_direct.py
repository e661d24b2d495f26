"""Direct chunk writes (cocijax.storage._direct): same files as TensorStore's, readable by zarr."""

import errno
import os
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import cocijax as cj
from cocijax.storage import _direct, _io, _write

DTYPES = [np.float32, np.int8, np.bool_, np.float64, ml_dtypes.bfloat16, np.complex64]


def _files(item: pathlib.Path) -> dict[str, bytes]:
    """Every file of every piece of a saved item, keyed by root, piece name and relative path."""
    m = cj.storage.read_manifest(item)
    out = {}
    for piece in m.pieces:
        top = m.piece_path(piece, item)
        for path in sorted(top.rglob("*")):
            if path.is_file():
                out[f"{piece.root}/{top.name}/{path.relative_to(top)}"] = path.read_bytes()
    return out


def _save(path: pathlib.Path, state, *, direct: bool, roots) -> None:
    handler = cj.StripedCheckpointHandler(
        roots, small_bytes=256, chunk_bytes=3000, piece_bytes=20_000, direct_writes=direct
    )
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(path, args=cj.StripedSave(state))


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 70),
    cols=st.sampled_from([(), (1,), (7,), (3, 5), (1024,)]),
    dtype=st.sampled_from(DTYPES),
)
def test_direct_writes_make_the_same_files_as_tensorstore(tmp_path_factory, rows, cols, dtype):
    tmp = tmp_path_factory.mktemp("direct")
    rng = np.random.default_rng(rows)
    big = (rng.standard_normal((rows, *cols)) * 50).astype(dtype)
    state = {"big": big, "small": np.arange(5).astype(dtype), "jax": jnp.asarray(big)}
    _save(tmp / "direct", state, direct=True, roots=[tmp / "d0", tmp / "d1"])
    _save(tmp / "ts", state, direct=False, roots=[tmp / "t0", tmp / "t1"])
    direct, via_ts = _files(tmp / "direct"), _files(tmp / "ts")
    assert direct.keys() == via_ts.keys() and direct == via_ts
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        got = ckptr.restore(tmp / "direct", args=cj.StripedRestore())
    for key in state:
        np.testing.assert_array_equal(got[key], np.asarray(state[key]))


def test_zarr_python_reads_directly_written_pieces(tmp_path, roots):
    w = np.random.default_rng(0).standard_normal((257, 130)).astype(np.float32)
    _save(tmp_path / "ckpt", {"w": w}, direct=True, roots=roots)
    m = cj.storage.read_manifest(tmp_path / "ckpt")
    assert len(m.pieces) > 1
    for piece in m.pieces:
        arr = zarr.open_array(str(m.piece_path(piece, tmp_path / "ckpt")), mode="r")
        region = tuple(slice(a, b) for a, b in zip(piece.start, piece.stop, strict=True))
        np.testing.assert_array_equal(arr[...], w[region])


def test_default_handler_writes_chunks_directly(tmp_path, roots, monkeypatch):
    calls = []
    write_file = _direct.write_file
    monkeypatch.setattr(
        _direct,
        "write_file",
        lambda path, data, **kw: (
            calls.append((path.name, kw["direct"])) or write_file(path, data, **kw)
        ),
    )
    state = {"w": np.ones((4096, 256), np.float32)}  # 4 MiB: several 1 MiB chunks
    handler = cj.StripedCheckpointHandler(roots, chunk_bytes=1 << 20, small_bytes=1 << 20)
    with ocp.AsyncCheckpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        ckptr.wait_until_finished()
    chunks = [direct for name, direct in calls if name.startswith("c.")]
    assert len(chunks) >= 4
    assert all(chunks) == _direct.supports_direct(roots[0])
    # Each piece's zarr.json is written beside its chunk files, through the page cache.
    assert [direct for name, direct in calls if name == "zarr.json"] == [False, False]
    assert cj.storage.verify(tmp_path / "ckpt") == []


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("offset", [0, 1, 64])
@pytest.mark.parametrize("size", [1, 4095, 4096, 3 * 4096 + 17])
@pytest.mark.parametrize("extend", [0, 5000])
def test_write_file_writes_exact_bytes_at_any_alignment(tmp_path, direct, offset, size, extend):
    buf = _io.aligned_empty((size + offset,), np.uint8, _direct.BLOCK)
    buf[:] = np.random.default_rng(size).integers(0, 256, buf.size, dtype=np.uint8)
    path = tmp_path / "f"
    direct = direct and _direct.supports_direct(tmp_path)
    _direct.write_file(path, memoryview(buf[offset:]), direct=direct, size=size + extend)
    assert path.read_bytes() == buf[offset:].tobytes() + bytes(extend)


def test_file_system_without_o_direct_falls_back_to_buffered_writes(tmp_path, roots, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(_direct.os, "open", no_direct)
    assert not _direct.supports_direct(tmp_path)
    state = {"w": np.arange(1 << 20, dtype=np.float32)}
    handler = cj.StripedCheckpointHandler(roots, chunk_bytes=1 << 18)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        got = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore())
    np.testing.assert_array_equal(got["w"], state["w"])


def test_raw_chunk_layout_accepts_only_plain_bytes_with_default_keys(tmp_path):
    encoding = _write.Encoding(chunk_bytes=1000, compression=None, compression_level=3)
    plain = _write.write_spec(tmp_path / "a", np.dtype("float32"), (100, 7), encoding)["metadata"]
    assert _direct.raw_chunk_layout(plain) == (35, ".")
    slash = {"name": "default", "configuration": {"separator": "/"}}
    slashes = dict(plain, chunk_key_encoding=slash)
    assert _direct.raw_chunk_layout(slashes) == (35, "/")  # what earlier versions wrote
    zstd = dict(plain, codecs=[*plain["codecs"], {"name": "zstd", "configuration": {"level": 3}}])
    v2_keys = dict(plain, chunk_key_encoding={"name": "v2"})
    split_cols = dict(
        plain, chunk_grid={"name": "regular", "configuration": {"chunk_shape": [35, 3]}}
    )
    big_endian = dict(plain, codecs=[{"name": "bytes", "configuration": {"endian": "big"}}])
    for other in (zstd, v2_keys, split_cols, big_endian):
        assert _direct.raw_chunk_layout(other) is None


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_whole_piece_restore_reads_through_the_right_path(
    tmp_path, roots, compression, monkeypatch
):
    # Uncompressed pieces are read straight from their chunk files; zstd ones through TensorStore.
    direct_reads = []
    read_jobs = _direct.read_jobs
    monkeypatch.setattr(
        _direct, "read_jobs", lambda *a: direct_reads.extend(read_jobs(*a)) or read_jobs(*a)
    )
    state = {"w": np.random.default_rng(1).standard_normal((1000, 33)).astype(np.float32)}
    handler = cj.StripedCheckpointHandler(
        roots, small_bytes=1024, chunk_bytes=10_000, compression=compression
    )
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(state))
        got = ckptr.restore(tmp_path / "ckpt", args=cj.StripedRestore())
    np.testing.assert_array_equal(got["w"], state["w"])
    assert bool(direct_reads) == (compression is None)
