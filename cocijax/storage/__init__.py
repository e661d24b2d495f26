"""Striped, asynchronous TensorStore checkpoints for Orbax.

:class:`StripedCheckpointHandler` writes a pytree as standard zarr v3 arrays striped over several
storage roots, in Orbax commit futures; the JSON manifest in the item directory describes it.
This package owns everything about those files; the names below are all that code outside it
uses: the handler and its args, reading and verifying what it wrote (:func:`read_manifest`,
:func:`verify`), and what a manager needs to refuse a tree before saving it
(:func:`check_tree`), to collect the stripes no step references
(:func:`unreferenced_stripe_dirs`, :func:`referenced_stripe_dirs`, :func:`find_stripe_dirs`),
to make a rename or a new directory durable (:func:`fsync_dir`, :func:`make_dirs`), and the
digest a JSON document carries of itself (:func:`with_digest`, :func:`check_digest`), which the
manifest and the manager's policy item share. Roots and items may be on object stores
(:class:`KvPath`: ``s3://``, ``gs://`` through TensorStore's kvstores); :func:`copy_item`
copies a committed item there, every checksum checked, its manifest last, reading pieces into
host buffers a :class:`BufferPool` keeps faulted in from one copy to the next.
"""

from cocijax._files import fsync_dir, make_dirs
from cocijax.storage._codec import DIGEST_KEY, check_digest, with_digest
from cocijax.storage._copy import BufferPool, CopyStats, copy_item
from cocijax.storage._handler import StripedCheckpointHandler, StripedRestore, StripedSave
from cocijax.storage._kvpath import (
    KvPath,
    StoreTimeoutError,
    describe_error,
    is_missing_bucket,
    is_transient,
    is_url,
    probe_writable,
)
from cocijax.storage._manifest_io import read_manifest, write_manifest
from cocijax.storage._read import verify
from cocijax.storage._records import (
    MANIFEST_NAME,
    STRIPE_PREFIX,
    CheckpointFormatError,
    CorruptCheckpointError,
    LeafRecord,
    Manifest,
    PieceRecord,
    Problem,
)
from cocijax.storage._stripes import (
    find_stripe_dirs,
    referenced_stripe_dirs,
    remove_tree,
    unreferenced_stripe_dirs,
)
from cocijax.storage._tree import UnsupportedLeafError, check_tree

__all__ = [
    "DIGEST_KEY",
    "MANIFEST_NAME",
    "STRIPE_PREFIX",
    "BufferPool",
    "CheckpointFormatError",
    "CopyStats",
    "CorruptCheckpointError",
    "KvPath",
    "LeafRecord",
    "Manifest",
    "PieceRecord",
    "Problem",
    "StoreTimeoutError",
    "StripedCheckpointHandler",
    "StripedRestore",
    "StripedSave",
    "UnsupportedLeafError",
    "check_digest",
    "check_tree",
    "copy_item",
    "describe_error",
    "find_stripe_dirs",
    "fsync_dir",
    "is_missing_bucket",
    "is_transient",
    "is_url",
    "make_dirs",
    "probe_writable",
    "read_manifest",
    "referenced_stripe_dirs",
    "remove_tree",
    "unreferenced_stripe_dirs",
    "verify",
    "with_digest",
    "write_manifest",
]
