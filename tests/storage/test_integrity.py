"""Corrupt or missing pieces, ``verify``, manifest parsing and multi-process part merging."""

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax.storage import _codec, _parts, _records
from cocijax.storage._records import MANIFEST_NAME

STATE = {
    "big": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024),  # 256 KiB: split pieces
    "small": {"a": np.arange(10, dtype=np.float32), "b": np.ones(7, np.float32)},  # one pack
}


@pytest.fixture
def saved(tmp_path, roots):
    handler = cj.StripedCheckpointHandler(roots, small_bytes=4096, piece_bytes=1 << 16)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "ckpt", args=cj.StripedSave(STATE))
    return handler, tmp_path / "ckpt"


def _piece_of(item, leaf_path):
    m = cj.storage.read_manifest(item)
    piece = next(p for p in m.pieces if m.leaves[p.leaf].path == leaf_path)
    return piece, m.piece_path(piece, item)


def _chunk_files(piece_dir: pathlib.Path):
    return sorted(p for p in piece_dir.iterdir() if p.name.startswith("c."))


def test_intact_checkpoint_verifies_clean(saved):
    _, item = saved
    assert cj.storage.verify(item) == []


def test_flipped_byte_is_caught_naming_leaf_and_file(saved):
    handler, item = saved
    _, piece_dir = _piece_of(item, "['big']")
    chunk = _chunk_files(piece_dir)[0]
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(cj.storage.CorruptCheckpointError) as err:
        handler.restore(item, cj.StripedRestore())
    assert "['big']" in str(err.value) and str(piece_dir) in str(err.value)
    assert "checksum" in str(err.value)
    problems = cj.storage.verify(item)
    assert [(p.leaf_path, p.file) for p in problems] == [("['big']", str(piece_dir))]


def test_corrupt_pack_names_only_the_damaged_leaf(saved):
    handler, item = saved
    piece, pack_dir = _piece_of(item, "['small']['b']")
    assert piece.offset is not None  # packed together with ['small']['a']
    chunk = _chunk_files(pack_dir)[0]
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0x01  # the last element belongs to ['small']['b']
    chunk.write_bytes(bytes(raw))
    problems = cj.storage.verify(item)
    assert [p.leaf_path for p in problems] == ["['small']['b']"]
    with pytest.raises(cj.storage.CorruptCheckpointError, match=r"\['small'\]\['b'\]"):
        handler.restore(item, cj.StripedRestore())


@pytest.mark.parametrize("damage", ["delete_chunk", "truncate_chunk", "delete_piece"])
def test_missing_or_truncated_piece(saved, damage):
    handler, item = saved
    _, piece_dir = _piece_of(item, "['big']")
    chunk = _chunk_files(piece_dir)[0]
    if damage == "delete_chunk":
        chunk.unlink()
    elif damage == "truncate_chunk":
        chunk.write_bytes(chunk.read_bytes()[:-8])
    else:
        shutil.rmtree(piece_dir)
    with pytest.raises(cj.storage.CorruptCheckpointError) as err:
        handler.restore(item, cj.StripedRestore())
    assert "['big']" in str(err.value) and str(piece_dir) in str(err.value)
    problems = cj.storage.verify(item)
    assert problems and {p.leaf_path for p in problems} == {"['big']"}
    assert {p.file for p in problems} == {str(piece_dir)}


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "No cocijax manifest"), ("{not json", "not valid JSON"), ('{"a": 1}', "not a cocijax")],
)
def test_bad_manifest_raises_format_error(saved, content, match):
    handler, item = saved
    path = item / MANIFEST_NAME
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    with pytest.raises(cj.storage.CheckpointFormatError, match=match):
        cj.storage.read_manifest(item)
    with pytest.raises(ValueError, match=match):  # CheckpointFormatError is a ValueError
        handler.restore(item, cj.StripedRestore())
    problems = cj.storage.verify(item)
    assert len(problems) == 1 and problems[0].leaf_path == ""
    assert problems[0].file == str(path)


def test_merge_parts_of_two_processes(saved):
    """Split one committed manifest into two per-process parts; the merge must rebuild it."""
    handler, item = saved
    whole = cj.storage.read_manifest(item)
    (item / MANIFEST_NAME).unlink()
    halves = [whole.pieces[0::2], whole.pieces[1::2]]
    for process, pieces in enumerate(halves):
        # Process 1 lists the roots in the other order: the merge remaps by path.
        roots = whole.roots if process == 0 else whole.roots[::-1]
        remapped = tuple(
            dataclasses.replace(p, root=roots.index(whole.roots[p.root])) for p in pieces
        )
        part = _records.Manifest(whole.version, whole.checksum, roots, whole.leaves, remapped)
        _parts.write_part(item, process, _codec.encode_part(part))
    handler.finalize(item)
    assert not list(item.glob(f"{_parts.PART_PREFIX}*"))
    merged = cj.storage.read_manifest(item)
    key = lambda m: sorted((m.roots[p.root], p.file, p.start, p.offset) for p in m.pieces)
    assert key(merged) == key(whole)
    got = handler.restore(item, cj.StripedRestore())
    np.testing.assert_array_equal(got["big"], STATE["big"])
    handler.finalize(item)  # a second finalize has nothing to merge and changes nothing
    assert key(cj.storage.read_manifest(item)) == key(whole)


def test_merge_refuses_incomplete_coverage(saved):
    handler, item = saved
    whole = cj.storage.read_manifest(item)
    (item / MANIFEST_NAME).unlink()
    part = _records.Manifest(
        whole.version, whole.checksum, whole.roots, whole.leaves, whole.pieces[1:]
    )
    _parts.write_part(item, 0, _codec.encode_part(part))
    with pytest.raises(cj.storage.CheckpointFormatError, match="cover"):
        handler.finalize(item)


def test_merge_without_part_or_manifest_raises(saved):
    """No part and no manifest: no process wrote one, so finalize must fail, not commit."""
    handler, item = saved
    (item / MANIFEST_NAME).unlink()
    with pytest.raises(cj.storage.CheckpointFormatError, match="no manifest part"):
        handler.finalize(item)


def test_manifest_json_is_plain_and_versioned(saved):
    _, item = saved
    data = json.loads((item / MANIFEST_NAME).read_text())
    assert data["format"] == _records.FORMAT and data["version"] == _records.VERSION
    assert data["checksum"] == "xxh3_64"
    assert {leaf["path"] for leaf in data["leaves"]} == {
        "['big']", "['small']['a']", "['small']['b']"
    }  # fmt: skip
    assert data["pieces"]
    assert all({"root", "file", "start", "stop", "checksum"} <= set(p) for p in data["pieces"])


def test_a_manifest_as_written_is_checked_by_its_bytes_and_any_other_by_its_document(
    saved, monkeypatch
):
    # Decoding wrote the parsed manifest back as JSON to check its digest, although the bytes
    # of a file as written match it directly (for 1024 leaves, a third of the decode).
    _, item = saved
    path = item / MANIFEST_NAME
    raw = path.read_bytes()
    written_back = []
    check = _codec.check_digest
    monkeypatch.setattr(_codec, "check_digest", lambda d: written_back.append(1) or check(d))
    assert _codec.decode_manifest(raw, str(path)).leaves
    assert written_back == []
    # The same document laid out by another writer: its digest is checked over the document.
    data = json.loads(raw)
    assert _codec.decode_manifest(json.dumps(data, indent=1).encode(), str(path)).leaves
    assert written_back == [1]
    data["leaves"][0]["path"] += " "  # still a valid manifest: only the digest tells
    with pytest.raises(cj.storage.CheckpointFormatError, match="does not match its digest"):
        _codec.decode_manifest(json.dumps(data, indent=1).encode(), str(path))
