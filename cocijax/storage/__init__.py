"""Striped, asynchronous TensorStore checkpoints for Orbax.

:class:`StripedCheckpointHandler` writes a pytree as standard zarr v3 arrays striped over several
storage roots, in Orbax commit futures; the JSON manifest in the item directory describes it.
This package owns everything about those files; the names below are what a user of the handler
calls: the handler and its args, reading and verifying what it wrote (:func:`read_manifest` and
its records, :func:`verify` and its :class:`Problem`), the errors they raise, and, for a plain
``ocp.CheckpointManager`` that deletes item directories but not the stripes on other roots,
finding and removing the stripes no item references (:func:`unreferenced_stripe_dirs`,
:func:`remove_tree`). Roots and items may be on object stores (:class:`KvPath`: ``s3://``,
``gs://`` through TensorStore's kvstores); :func:`copy_item` copies a committed item there, every
checksum checked, its manifest last, reading pieces into host buffers a :class:`BufferPool` keeps
faulted in from one copy to the next. cocijax's own manager, command line and tests import the
rest from the private modules.
"""

from cocijax.storage._copy import BufferPool, CopyStats, copy_item
from cocijax.storage._handler import StripedCheckpointHandler, StripedRestore, StripedSave
from cocijax.storage._kvpath import KvPath, StoreTimeoutError
from cocijax.storage._manifest_io import read_manifest
from cocijax.storage._read import verify
from cocijax.storage._records import (
    CheckpointFormatError,
    CorruptCheckpointError,
    LeafRecord,
    Manifest,
    PieceRecord,
    Problem,
    RegionNotHeldError,
)
from cocijax.storage._stripes import remove_tree, unreferenced_stripe_dirs
from cocijax.storage._tree import UnsupportedLeafError

__all__ = [
    "BufferPool",
    "CheckpointFormatError",
    "CopyStats",
    "CorruptCheckpointError",
    "KvPath",
    "LeafRecord",
    "Manifest",
    "PieceRecord",
    "Problem",
    "RegionNotHeldError",
    "StoreTimeoutError",
    "StripedCheckpointHandler",
    "StripedRestore",
    "StripedSave",
    "UnsupportedLeafError",
    "copy_item",
    "read_manifest",
    "remove_tree",
    "unreferenced_stripe_dirs",
    "verify",
]
