"""copy_item: a committed item copied elsewhere (a local directory, or S3 on moto on 127.0.0.1),
self-contained, every checksum checked, in bounded memory, committed by its manifest last."""

import asyncio
import json
import tracemalloc

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore

import cocijax as cj
from cocijax import storage
from cocijax.storage import _write
from cocijax.storage._records import MANIFEST_NAME

# 32 leaves of 512 KiB, each its own piece file (not packed: small_bytes below them).
TREE = {f"a{i:02d}": np.arange(128 << 10, dtype=np.float32) + i for i in range(32)}


@pytest.fixture
def item(tmp_path):
    handler = cj.StripedCheckpointHandler(
        roots=[tmp_path / "r0", tmp_path / "r1"], small_bytes=64 << 10
    )
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "item", args=cj.StripedSave(TREE))
    return tmp_path / "item"


def _restore(where):
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        return ckptr.restore(where, args=cj.StripedRestore())


def _peak_bytes(copy) -> int:
    tracemalloc.start()
    try:
        copy()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_copy_holds_at_most_memory_bytes_of_pieces(item, tmp_path):
    # Each piece's host buffer (512 KiB, from numpy's allocator) is traced by tracemalloc.
    bounded = _peak_bytes(lambda: storage.copy_item(item, tmp_path / "a", memory_bytes=1 << 20))
    unbounded = _peak_bytes(lambda: storage.copy_item(item, tmp_path / "b", memory_bytes=1 << 30))
    assert unbounded > 8 << 20  # the measure sees the pieces: most of the 16 MiB at once
    assert bounded < 4 << 20  # two pieces at a time (1 MiB), plus bookkeeping
    for copy in (tmp_path / "a", tmp_path / "b"):
        assert storage.verify(copy) == [] and storage.read_manifest(copy).roots == (None,)
        back = _restore(copy)
        assert all(np.array_equal(back[k], v) for k, v in TREE.items())


def test_a_damaged_source_is_never_copied_or_committed(item, s3):
    manifest = storage.read_manifest(item)
    piece = next(p for p in manifest.pieces if manifest.leaves[p.leaf].path == "['a07']")
    chunk = next(f for f in manifest.piece_path(piece, item).iterdir() if f.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(storage.CorruptCheckpointError, match=r"Leaf \['a07'\].*checksum"):
        storage.copy_item(item, s3.url("copy"), dest_options=s3.options)
    assert f"copy/{MANIFEST_NAME}" not in s3.keys("copy/")


def test_a_copy_to_s3_restores_bit_exact_where_it_is(item, s3, tmp_path):
    stats = storage.copy_item(item, s3.url("copy"), dest_options=s3.options)
    assert stats.files == 32 and stats.bytes == 16 << 20
    assert storage.verify(s3.url("copy"), root_options=s3.options) == []
    # Orbax reads item directories from local paths: the manifest comes down, the pieces are
    # read on S3 (roots=), as the manager's durable tier restores.
    manifest = s3.client.get_object(Bucket=s3.name, Key=f"copy/{MANIFEST_NAME}")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / MANIFEST_NAME).write_bytes(manifest["Body"].read())
    handler = cj.StripedCheckpointHandler(root_options=s3.options)
    with ocp.Checkpointer(handler) as ckptr:
        back = ckptr.restore(tmp_path / "local", args=cj.StripedRestore(roots=[s3.url("copy")]))
    assert all(np.array_equal(back[k], v) for k, v in TREE.items())


def test_a_missing_object_fails_the_check_before_any_manifest(item, s3):
    # The LIST that stands in for fsync on an object store: one chunk object gone is named.
    storage.copy_item(item, s3.url("copy"), dest_options=s3.options, commit=False)
    stripe = next(k for k in s3.keys("copy/") if "/c." in k).split("/")[1]
    names = {k.split("/")[2] for k in s3.keys(f"copy/{stripe}/")}
    counts = {n: len(s3.keys(f"copy/{stripe}/{n}/c.")) for n in names}
    where = storage.KvPath.parse(s3.url(f"copy/{stripe}"), s3.options)
    asyncio.run(_write.check_written(where, counts))  # all there
    victim = sorted(names)[0]
    s3.client.delete_object(Bucket=s3.name, Key=s3.keys(f"copy/{stripe}/{victim}/c.")[0])
    with pytest.raises(OSError, match=rf"{s3.url(f'copy/{stripe}/{victim}')}: .* lists 0 of 1"):
        asyncio.run(_write.check_written(where, counts))


def test_a_copy_keeps_every_metadata_file_byte_for_byte(item, tmp_path):
    storage.copy_item(item, tmp_path / "copy")
    manifest = storage.read_manifest(item)
    assert manifest.pieces
    for piece in manifest.pieces:
        source = manifest.piece_path(piece, item) / _write.ZARR_JSON
        assert (tmp_path / "copy" / piece.file / _write.ZARR_JSON).read_bytes() == (
            source.read_bytes()
        )


def test_a_source_without_its_metadata_is_named_and_never_committed(item, s3):
    manifest = storage.read_manifest(item)
    piece = next(p for p in manifest.pieces if manifest.leaves[p.leaf].path == "['a03']")
    (manifest.piece_path(piece, item) / _write.ZARR_JSON).unlink()
    with pytest.raises(storage.CorruptCheckpointError, match=r"Leaf \['a03'\]: no zarr.json"):
        storage.copy_item(item, s3.url("copy"), dest_options=s3.options)
    assert f"copy/{MANIFEST_NAME}" not in s3.keys("copy/")


def test_a_pool_keeps_at_most_its_limit_newest_first():
    pool = storage.BufferPool(3 << 20)
    buffers = [pool.take(1 << 20) for _ in range(4)]
    for b in buffers:
        pool.give_back(b)
    assert pool.nbytes == 3 << 20  # the oldest one was freed
    kept = [pool.take(1 << 20) for _ in range(3)]
    assert [id(b) for b in kept] == [id(b) for b in buffers[:0:-1]]
    assert pool.take(2 << 20).nbytes == 2 << 20 and pool.nbytes == 0


def test_a_second_copy_with_the_same_pool_reads_into_the_kept_buffers(item, tmp_path, monkeypatch):
    pool = storage.BufferPool(1 << 30)
    storage.copy_item(item, tmp_path / "a", buffers=pool)
    assert pool.nbytes == 32 * (512 << 10)  # every piece's buffer came back
    allocated = []
    aligned_empty = storage._io.aligned_empty
    monkeypatch.setattr(
        storage._io, "aligned_empty", lambda *a, **k: allocated.append(a) or aligned_empty(*a, **k)
    )
    storage.copy_item(item, tmp_path / "b", buffers=pool)
    assert allocated == []
    assert storage.verify(tmp_path / "b") == []
    assert all(np.array_equal(_restore(tmp_path / "b")[k], v) for k, v in TREE.items())


def test_a_copy_over_dest_roots_stripes_its_pieces_like_a_save(item, tmp_path):
    roots = [tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"]
    storage.copy_item(item, tmp_path / "copy", dest_roots=roots)
    manifest = storage.read_manifest(tmp_path / "copy")
    assert manifest.roots == tuple(str(r) for r in roots)
    # 32 equal piece files, largest first onto the least-loaded root: 11, 11 and 10.
    per_root = [sum(1 for p in manifest.pieces if p.root == i) for i in range(3)]
    assert sorted(per_root) == [10, 11, 11]
    for piece in manifest.pieces:
        assert (roots[piece.root] / piece.file / "zarr.json").is_file()
    assert [p.name for p in (tmp_path / "copy").iterdir()] == [MANIFEST_NAME]
    assert storage.verify(tmp_path / "copy") == []
    back = _restore(tmp_path / "copy")
    assert all(np.array_equal(back[k], v) for k, v in TREE.items())


def _local_item(path, **options):
    """An item with whole pieces (one with an edge chunk) and packed members, on one root."""
    tree = {
        "big": np.arange(1000 * 300, dtype=np.float32).reshape(1000, 300),  # 12 chunks, edge
        "mid": np.arange(70_000, dtype=np.int32),
        "packed": [np.full(100 + i, i, np.float32) for i in range(5)],
    }
    handler = cj.StripedCheckpointHandler(chunk_bytes=100 << 10, small_bytes=4 << 10, **options)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(path, args=cj.StripedSave(tree))
    return path, tree


def _tensorstore_writes(monkeypatch) -> list:
    """The piece files copy_item writes through TensorStore (opened with assume_metadata)."""
    opened = []
    real = tensorstore.open

    def spy(spec, *args, **kwargs):
        if isinstance(spec, dict) and spec.get("assume_metadata"):
            opened.append(spec)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(tensorstore, "open", spy)
    return opened


def _piece_files(item):
    """Every file of the item's pieces (zarr.json and chunks), by its path under the item."""
    files = {p.file for p in storage.read_manifest(item).pieces}
    return {
        p.relative_to(item): p.read_bytes()
        for file in files
        for p in (item / file).rglob("*")
        if p.is_file()
    }


def _equal(back, tree):
    pairs = zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True)
    return all(np.array_equal(a, b) for a, b in pairs)


def test_a_local_copy_writes_the_verified_chunk_files_byte_for_byte(tmp_path, monkeypatch):
    item, tree = _local_item(tmp_path / "item")
    writes = _tensorstore_writes(monkeypatch)
    stats = storage.copy_item(item, tmp_path / "copy")
    assert writes == []  # nothing decoded and re-encoded
    copied = _piece_files(tmp_path / "copy")
    assert copied == _piece_files(item)  # every zarr.json and chunk file (edge chunk too)
    assert sum(1 for k in copied if k.name.startswith("c.")) > 12
    assert stats.files == len({k.parent for k in copied})
    assert storage.verify(tmp_path / "copy") == []
    assert _equal(_restore(tmp_path / "copy"), tree)


def test_a_damaged_source_is_never_copied_to_a_local_directory(tmp_path):
    item, _ = _local_item(tmp_path / "item")
    manifest = storage.read_manifest(item)
    piece = next(p for p in manifest.pieces if manifest.leaves[p.leaf].path == "['big']")
    chunk = manifest.piece_path(piece, item) / "c.11.0"  # the edge chunk
    data = bytearray(chunk.read_bytes())
    data[4] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(storage.CorruptCheckpointError, match=r"Leaf \['big'\].*checksum"):
        storage.copy_item(item, tmp_path / "copy")
    assert not (tmp_path / "copy" / MANIFEST_NAME).exists()


def _with_slash_keys(item):
    """Rewrites ``item``'s chunk keys as older versions wrote them: ``c/<i>/0`` in folders."""
    manifest = storage.read_manifest(item)
    for file in {p.file for p in manifest.pieces}:
        array = item / file
        meta = json.loads((array / "zarr.json").read_text())
        meta["chunk_key_encoding"]["configuration"]["separator"] = "/"
        (array / "zarr.json").write_text(json.dumps(meta))
        for chunk in [p for p in array.iterdir() if p.name.startswith("c.")]:
            dest = array.joinpath(*chunk.name.split("."))
            dest.parent.mkdir(parents=True, exist_ok=True)
            chunk.rename(dest)


@pytest.mark.parametrize("layout", ["zstd", "slash keys"])
def test_a_piece_stored_otherwise_is_still_copied_through_tensorstore(
    layout, tmp_path, monkeypatch
):
    options = {"compression": "zstd"} if layout == "zstd" else {}
    item, tree = _local_item(tmp_path / "item", **options)
    if layout == "slash keys":
        _with_slash_keys(item)
        assert _equal(_restore(item), tree)
    writes = _tensorstore_writes(monkeypatch)
    storage.copy_item(item, tmp_path / "copy")
    assert len(writes) == len({p.file for p in storage.read_manifest(item).pieces})
    assert storage.verify(tmp_path / "copy") == []
    assert _equal(_restore(tmp_path / "copy"), tree)
