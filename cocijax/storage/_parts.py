"""Manifest parts: what each process of a multi-process save wrote, merged into the manifest.

Multi-process saves write one *part* per process (only the pieces that process wrote); the
primary process merges the parts into the manifest in the handler's ``finalize``, which Orbax
calls once every process's commit has finished.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence

from cocijax._files import replace_bytes
from cocijax.storage._manifest_io import read_manifest_file, write_manifest
from cocijax.storage._records import (
    MANIFEST_NAME,
    VERSION,
    CheckpointFormatError,
    Manifest,
    PieceRecord,
)

PART_PREFIX = "cocijax_manifest.part-"


def part_path(item_dir: os.PathLike | str, process: int) -> pathlib.Path:
    return pathlib.Path(item_dir) / f"{PART_PREFIX}{process}.json"


def merge_parts(item_dir: os.PathLike | str) -> Manifest | None:
    """Merges every process's manifest part into the manifest (:func:`merge`, lowest process
    first), then removes the parts. Returns ``None`` when there is nothing to merge (already
    merged).

    Raises:
      CheckpointFormatError: the parts disagree on the tree, some leaf is not fully covered, or
        there is neither a part nor a manifest.
      OSError: the item directory cannot be listed, or a part read or the manifest written.
    """
    item_dir = pathlib.Path(item_dir)
    # os.listdir, not Path.glob: glob answers "no parts" when it may not list the directory
    # (PermissionError), and the step would then be committed without a manifest (libfiu).
    names = [n for n in os.listdir(item_dir) if n.startswith(PART_PREFIX) and n.endswith(".json")]
    part_files = sorted(
        (item_dir / n for n in names), key=lambda p: int(p.stem[len(PART_PREFIX) :])
    )
    if not part_files:
        if (item_dir / MANIFEST_NAME).is_file():
            return None
        raise CheckpointFormatError(
            f"{item_dir}: no manifest part to merge and no manifest: no process wrote its part."
        )
    merged = merge([(str(f), read_manifest_file(f)) for f in part_files])
    write_manifest(item_dir, merged, remove=part_files)
    return merged


def merge(parts: Sequence[tuple[str, Manifest]]) -> Manifest:
    """One manifest of the whole tree from every process's ``(source, part)``, lowest first.

    Leaves come from the first part (all processes flatten the same tree); pieces are the union
    of all parts, with root indices remapped by path so processes may list roots in any order.
    Host-local parts (``holder`` set) may hold the same region twice (a replicated leaf is in
    every process's copy): the first part's copy of a region is kept. The result is not checked
    for coverage: :func:`~cocijax.storage._manifest_io.write_manifest` does that.

    Raises:
      CheckpointFormatError: the parts disagree on the tree (names both sources).
    """
    first_source, first = parts[0]
    roots: list[str | None] = []
    pieces: list[PieceRecord] = []
    held: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for source, part in parts:
        if [(x.path, x.dtype, x.shape) for x in part.leaves] != [
            (x.path, x.dtype, x.shape) for x in first.leaves
        ]:
            raise CheckpointFormatError(
                f"{source} describes a different tree than {first_source}: every process must "
                "save the same pytree structure, shapes and dtypes."
            )
        for piece in part.pieces:
            region = (piece.leaf, piece.start, piece.stop)
            if part.holder is not None and region in held:
                continue
            held.add(region)
            root = part.roots[piece.root]
            if root not in roots:
                roots.append(root)
            pieces.append(dataclasses.replace(piece, root=roots.index(root)))
    return Manifest(
        version=VERSION,
        checksum=first.checksum,
        roots=tuple(roots),
        leaves=first.leaves,
        pieces=tuple(pieces),
        custom_metadata=first.custom_metadata,
    )


def write_part(item_dir: pathlib.Path, process: int, text: bytes) -> None:
    """Writes the manifest part ``text`` (``_codec.encode_part``) of ``process``."""
    # The part need not be durable itself: ``finalize`` reads it and writes the manifest
    # durably before Orbax commits the item, and an item a crash cut before that is not
    # committed.
    replace_bytes(part_path(item_dir, process), text, fsync=False)
