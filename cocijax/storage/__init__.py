"""Striped, asynchronous TensorStore checkpoints for Orbax.

:class:`StripedCheckpointHandler` writes a pytree as standard zarr v3 arrays striped over several
storage roots, in Orbax commit futures; the JSON manifest in the item directory describes it.
The other names here let a manager, a CLI or a test inspect, verify and garbage-collect what it
wrote.
"""

from cocijax.storage._handler import StripedCheckpointHandler, StripedRestore, StripedSave
from cocijax.storage._io import checksum, verify
from cocijax.storage._manifest import (
    MANIFEST_NAME,
    STRIPE_PREFIX,
    CheckpointFormatError,
    CorruptCheckpointError,
    LeafRecord,
    Manifest,
    PieceRecord,
    Problem,
    find_stripe_dirs,
    read_manifest,
    referenced_stripe_dirs,
)
from cocijax.storage._tree import UnsupportedLeafError

__all__ = [
    "MANIFEST_NAME",
    "STRIPE_PREFIX",
    "CheckpointFormatError",
    "CorruptCheckpointError",
    "LeafRecord",
    "Manifest",
    "PieceRecord",
    "Problem",
    "StripedCheckpointHandler",
    "StripedRestore",
    "StripedSave",
    "UnsupportedLeafError",
    "checksum",
    "find_stripe_dirs",
    "read_manifest",
    "referenced_stripe_dirs",
    "verify",
]
