"""The manifest file: read once per content, written last (the commit record of a save).

Every reader of a manifest comes through :func:`read_manifest_file`, which keeps what it parsed
by the bytes it read, or through :func:`check_committed`, the commit check of a listing, which
needs no parse for a manifest written by this version; every writer through
:func:`write_manifest_bytes`, durably on a local directory and in one PUT on an object store.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from cocijax._digest import bytes_match_digest
from cocijax._files import fsync_dir, replace_bytes
from cocijax.storage import _kvpath, _schema
from cocijax.storage._codec import decode_manifest, encode_manifest
from cocijax.storage._kvpath import KvPath
from cocijax.storage._records import (
    FORMAT,
    MANIFEST_NAME,
    VERSION,
    CheckpointFormatError,
    Location,
    Manifest,
)


def read_manifest_file(path: pathlib.Path | KvPath) -> Manifest:
    """The manifest (or part) at ``path``, parsed and checked once per version of its bytes.

    Every reader of a manifest comes here: the commit check of a listing, garbage collection's
    callers, a restore, a merge. A file is read whole each time (cheap), and its bytes' digest
    keys the parse (JSON, records, schema, digest; the expensive part): a file read again with
    the same bytes is not parsed again, and a file replaced by other bytes is, whatever its
    timestamps say (a coarse clock could not tell a new manifest from the one it replaced).
    The outcome is remembered either way, the manifest or the reason it was refused.

    Raises:
      CheckpointFormatError: no file at ``path``, or it is not a cocijax manifest.
      OSError: it cannot be read (an I/O error): nothing is remembered.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = None
    if raw is None:  # a KvPath answers None for a missing object
        raise CheckpointFormatError(
            f"No cocijax manifest at {path}: the checkpoint is incomplete or was not written "
            "by StripedCheckpointHandler."
        )
    key = (str(path), xxhash.xxh3_128_digest(raw))
    known = _PARSED.get(key)
    if known is None:
        try:
            known = decode_manifest(raw, str(path))
        except CheckpointFormatError as e:
            known = str(e)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))  # the oldest: a job reads its newest steps most
        _PARSED[key] = known
    if isinstance(known, str):
        raise CheckpointFormatError(known)
    return known


# Parsed manifests (or why they were refused) by (path, xxh3_128 of their bytes): see
# read_manifest_file.
_PARSED: dict[tuple[str, bytes], Manifest | str] = {}
_PARSED_MAX = 4096


def read_manifest(item_dir: Location, *, root_options: Mapping[str, Any] | None = None) -> Manifest:
    """Reads the manifest of a committed item.

    Args:
      item_dir: the Orbax item directory the handler saved into, or an item on an object
        store (``s3://bucket/run/7/state``).
      root_options: kvstore options for an object-store ``item_dir`` (e.g. ``endpoint``).

    Returns:
      The parsed :class:`Manifest`.

    Raises:
      CheckpointFormatError: the manifest is missing, not valid JSON, or not a cocijax manifest.

    Example:
      >>> import tempfile, numpy as np, orbax.checkpoint as ocp, cocijax as cj
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "item"
      >>> with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
      ...     ckptr.save(path, args=cj.StripedSave({"w": np.zeros(3), "step": 7}))
      >>> [(leaf.path, leaf.kind, leaf.shape) for leaf in read_manifest(path).leaves]
      [("['step']", 'int', ()), ("['w']", 'numpy', (3,))]
    """
    item_dir = _kvpath.location(item_dir, root_options)
    manifest = read_manifest_file(item_dir / MANIFEST_NAME)
    _schema.check_coverage(manifest, item_dir)
    return manifest


# A manifest file as this version writes it (``_codec``: sorted keys, the digest last) begins
# with the checksum's key, holds the format's name before the leaves, and ends with its version.
_HEAD = b'{"checksum":'
_FORMAT_KEYS = b'"format":"%s","leaves":' % FORMAT.encode()
_VERSION_TAIL = re.compile(rb',"version":%d,"digest":\d{1,20}\}\Z' % VERSION)


def check_committed(item_dir: pathlib.Path | KvPath) -> None:
    """Raises unless ``item_dir`` holds a committed manifest: the commit check of a listing.

    A manifest file as this version writes it is checked by its digest over the raw bytes,
    without parsing: its writer checked it (schema, coverage) before writing it, and the digest
    says these are its bytes, unchanged. Any other file (damaged, or written by an older
    version) is read and checked whole, as :func:`read_manifest` does.

    Raises:
      CheckpointFormatError: as :func:`read_manifest`.
      OSError: the file cannot be read.
    """
    try:
        raw = (item_dir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raw = None
    if raw is not None and _as_written(raw):
        return
    read_manifest(item_dir)


def _as_written(raw: bytes) -> bool:
    return (
        raw.startswith(_HEAD)
        and _VERSION_TAIL.search(raw, max(len(raw) - 48, 0)) is not None
        and _FORMAT_KEYS in raw
        and bytes_match_digest(raw)
    )


def write_manifest(
    item_dir: pathlib.Path | KvPath, manifest: Manifest, *, remove: Sequence[pathlib.Path] = ()
) -> None:
    """Writes ``manifest`` into ``item_dir``: the commit record, so write it last.

    On a local directory it is written durably (temporary file, fsync, rename), and the files
    in ``remove`` (merged parts) are removed with it; on an object store it is one PUT, which
    makes the whole object appear at once or not at all.

    Raises:
      CheckpointFormatError: some leaf is not fully covered by the pieces.
    """
    write_manifest_bytes(item_dir, encode_manifest(item_dir, manifest), remove=remove)


def write_manifest_bytes(
    item_dir: pathlib.Path | KvPath, text: bytes, *, remove: Sequence[pathlib.Path] = ()
) -> None:
    """Writes the manifest file ``text`` (:func:`encode_manifest`), as :func:`write_manifest`."""
    if isinstance(item_dir, KvPath):
        (item_dir / MANIFEST_NAME).write_bytes(text)
        return
    replace_bytes(item_dir / MANIFEST_NAME, text, fsync=True)
    for p in remove:
        p.unlink()
    fsync_dir(item_dir)  # once, for the manifest's rename and the parts' removal
