"""The saved tree as Orbax's metadata, read from the manifest without data.

What the handler's ``metadata()`` returns (``StripedCheckpointHandler.metadata``), and the
conversions a restore shares with it: a leaf's shape and dtype as a value (:func:`logical`), and
Orbax's sharding metadata from the JSON the manifest recorded (:func:`sharding_metadata`).
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
from orbax.checkpoint import metadata as ocp_metadata

from cocijax._orbax_compat import TreeMetadata, build_tree_metadata
from cocijax.storage import _manifest_io, _tree
from cocijax.storage._records import LeafRecord


def tree_metadata_of(directory: pathlib.Path) -> TreeMetadata:
    """The saved tree as Orbax's ``TreeMetadata`` (see ``StripedCheckpointHandler.metadata``).

    Its tree is the one a restore without a target returns, with Orbax's value metadata in place
    of the values: ``ArrayMetadata`` (a key array's shape and key dtype for PRNG keys; the saved
    sharding as Orbax's sharding metadata), ``ScalarMetadata`` and ``StringMetadata``.
    """
    manifest = _manifest_io.read_manifest(directory)
    values = []
    for record in manifest.leaves:
        name = ".".join(str(k) for _, k in record.keys)
        if record.kind == _tree.EMPTY_KIND:
            values.append(_tree.rebuild_empty(record.value))
        elif record.kind == _tree.STR_KIND:
            values.append(ocp_metadata.StringMetadata(name=name, directory=directory))
        elif record.kind in _tree.SCALAR_KINDS:
            dtype = np.dtype({"bool": np.bool_, "int": np.int64, "float": np.float64}[record.kind])
            values.append(ocp_metadata.ScalarMetadata(name=name, directory=directory, dtype=dtype))
        else:
            shape, dtype = logical(record)
            sharding = None
            if record.sharding is not None:
                sharding = sharding_metadata(record.sharding)
            values.append(
                ocp_metadata.ArrayMetadata(
                    name=name, directory=directory, shape=shape, sharding=sharding, dtype=dtype
                )
            )
    tree = _tree.rebuild([leaf.keys for leaf in manifest.leaves], values)
    return build_tree_metadata(tree, custom_metadata=manifest.custom_metadata)


def sharding_metadata(saved: dict[str, Any]) -> ocp_metadata.ShardingMetadata:
    """Orbax's sharding metadata from the JSON the manifest recorded (``_snapshot``)."""
    kind = {
        "NamedSharding": ocp_metadata.NamedShardingMetadata,
        "SingleDeviceSharding": ocp_metadata.SingleDeviceShardingMetadata,
    }.get(saved.get("sharding_type"))
    if kind is None:
        raise ValueError(f"unknown sharding type in the manifest: {saved.get('sharding_type')!r}")
    return kind.from_deserialized_dict(saved)


def logical(record: LeafRecord) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype a leaf has as a value (a key array's, not its key data's)."""
    if record.kind == _tree.KEY_KIND:
        key_dtype, key_shape = _tree.key_layout(record.key_impl)
        return record.shape[: len(record.shape) - len(key_shape)], key_dtype
    if record.dtype is None:
        return (), None
    return record.shape, _tree.to_dtype(record.dtype)
