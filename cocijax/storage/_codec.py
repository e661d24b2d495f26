"""The manifest's JSON: encoded, decoded and checked, and the digest a JSON document carries.

A manifest file is its records (``_records``) as compact JSON, with the format's name and
version; decoding checks the schema (``_schema``) and the digest before a manifest is returned,
so that a damaged file is a :class:`CheckpointFormatError` naming what is wrong.

A checksum over each piece of data catches damaged data, but not a damaged manifest: a flipped
digit in an inline value, a dtype or a region still parses and would restore a wrong tree. So a
manifest carries a digest of its own content (:mod:`cocijax._digest`), checked when it is read.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from cocijax._digest import bytes_match_digest, canonical_bytes, check_digest
from cocijax.storage import _schema
from cocijax.storage._kvpath import KvPath
from cocijax.storage._records import (
    FORMAT,
    MANIFEST_NAME,
    VERSION,
    CheckpointFormatError,
    LeafRecord,
    Manifest,
    PieceRecord,
)


def _to_json(manifest: Manifest) -> dict[str, Any]:
    data = {
        "format": FORMAT,
        "version": manifest.version,
        "checksum": manifest.checksum,
        "roots": list(manifest.roots),
        "leaves": [_leaf_json(leaf) for leaf in manifest.leaves],
        "pieces": [
            {
                "leaf": p.leaf,
                "root": p.root,
                "file": p.file,
                "start": list(p.start),
                "stop": list(p.stop),
                "offset": p.offset,
                "checksum": p.checksum,
                "process": p.process,
            }
            for p in manifest.pieces
        ],
    }
    if manifest.custom_metadata is not None:
        data["custom_metadata"] = manifest.custom_metadata
    if manifest.holder is not None:  # only when set: a whole manifest reads the same anywhere
        data["holder"] = manifest.holder
    return data


def _leaf_json(leaf: LeafRecord) -> dict[str, Any]:
    data = {
        "path": leaf.path,
        "keys": [list(k) for k in leaf.keys],
        "kind": leaf.kind,
        "dtype": leaf.dtype,
        "shape": list(leaf.shape),
        "value": leaf.value,
    }
    # Written only when set, so a manifest without them reads the same in any version.
    if leaf.sharding is not None:
        data["sharding"] = leaf.sharding
    if leaf.key_impl is not None:
        data["key_impl"] = leaf.key_impl
    return data


def _from_json(data: Any, source: str, *, digest_checked: bool) -> Manifest:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointFormatError(
            f"{source} is not a cocijax manifest: expected a JSON object with format={FORMAT!r}."
        )
    if data.get("version") != VERSION:
        raise CheckpointFormatError(
            f"{source} has format version {data.get('version')!r}; this cocijax reads "
            f"version {VERSION}."
        )
    try:
        leaves = tuple(
            LeafRecord(
                path=d["path"],
                keys=tuple((k[0], k[1]) for k in d["keys"]),
                kind=d["kind"],
                dtype=d["dtype"],
                shape=tuple(d["shape"]),
                value=d.get("value"),
                # Optional fields: manifests written before they existed lack them.
                sharding=d.get("sharding"),
                key_impl=d.get("key_impl"),
            )
            for d in data["leaves"]
        )
        pieces = tuple(
            PieceRecord(
                leaf=d["leaf"],
                root=d["root"],
                file=d["file"],
                start=tuple(d["start"]),
                stop=tuple(d["stop"]),
                offset=d.get("offset"),
                checksum=d.get("checksum"),
                process=d.get("process", 0),
            )
            for d in data["pieces"]
        )
        manifest = Manifest(
            version=data["version"],
            checksum=data["checksum"],
            roots=tuple(data["roots"]),
            leaves=leaves,
            pieces=pieces,
            custom_metadata=data.get("custom_metadata"),
            holder=data.get("holder"),
        )
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
        raise CheckpointFormatError(f"{source} is malformed: {e!r}.") from e
    _schema.check_manifest(manifest, source)
    if not (digest_checked or check_digest(data)):
        raise CheckpointFormatError(
            f"{source} does not match its digest: it was changed after it was written."
        )
    return manifest


def decode_manifest(raw: bytes, source: str) -> Manifest:
    """The manifest (or part) in the file bytes ``raw``, read from ``source``, checked.

    The digest is checked over ``raw`` itself when it is a file as :func:`encode_manifest`
    writes it; otherwise (an older writer's) over the parsed document, written back as JSON.

    Raises:
      CheckpointFormatError: ``raw`` is not a cocijax manifest of this version, breaks the
        schema or does not match its digest (names ``source``).
    """
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{source} is not valid JSON: {e}.") from None
    except (RecursionError, ValueError) as e:  # nesting too deep; an integer of 4300+ digits
        raise CheckpointFormatError(f"{source} cannot be a cocijax manifest: {e}.") from None
    return _from_json(data, source, digest_checked=bytes_match_digest(raw))


def encode_manifest(item_dir: pathlib.Path | KvPath, manifest: Manifest) -> bytes:
    """The file of ``manifest`` (for :func:`write_manifest_bytes`), checked to cover every leaf.

    A reader checks a file written so by its digest alone (``check_committed``), so what is
    written here is checked as a reader would check it.

    Raises:
      CheckpointFormatError: the manifest breaks the schema (e.g. a custom pytree node whose
        children's keys repeat or mix kinds), or some leaf is not fully covered by the pieces.
    """
    _schema.check_manifest(manifest, str(item_dir / MANIFEST_NAME))
    _schema.check_coverage(manifest, item_dir)
    return canonical_bytes(_to_json(manifest))


def encode_part(part: Manifest, source: str = "a manifest part") -> bytes:
    """The file of one process's ``part`` (to be written at ``source``), checked as a reader
    checks it; :func:`merge_parts` checks the coverage of all."""
    _schema.check_manifest(part, source)
    return canonical_bytes(_to_json(part))
