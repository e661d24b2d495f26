"""Restore planning for the striped handler: which regions each device needs, from which pieces.

Every leaf is planned before any I/O (so a bad target fails fast and each file's number of uses
is known), then all regions of all leaves are read in one concurrent batch across the roots,
and all device buffers are placed with one batched ``jax.device_put``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from cocijax._orbax_compat import TreeMetadata
from cocijax.storage import _io, _layout, _manifest_io, _read, _tree
from cocijax.storage._records import Manifest, PieceRecord
from cocijax.storage._targets import NO_TARGET, LeafPlan, Placements, Request, plan_leaf


def restore_tree(
    directory: pathlib.Path,
    target: Any,
    context: ts.Context,
    pool: concurrent.futures.Executor,
    *,
    verify: bool,
    io_pool: concurrent.futures.Executor | None = None,
    roots: Sequence[os.PathLike | str | None] | None = None,
    partial: bool = False,
    root_options: Mapping[str, Any] | None = None,
) -> Any:
    """Restores the item in ``directory`` into ``target`` (see ``StripedCheckpointHandler``).

    ``roots`` replaces the recorded roots (see ``Manifest.with_roots``); ``root_options`` are
    the kvstore options of object-store roots. With ``partial`` the target may omit saved
    leaves: those are not read.

    Raises:
      CheckpointFormatError: the manifest is missing or invalid.
      ValueError: the target's structure, shapes or dtypes differ (names the leaf), or
        ``partial`` is asked without a target.
      CorruptCheckpointError: a piece is missing or corrupt (names the leaf and the file).
    """
    manifest = _manifest_io.read_manifest(directory).with_roots(roots)
    if isinstance(target, TreeMetadata):
        target = target.tree  # what ``metadata()`` returned: restore as saved
    if partial and target is None:
        raise ValueError(
            f"partial restore of {directory} needs a target: the sub-tree of the saved tree "
            "to read (pass StripedRestore(target, partial=True))."
        )
    if target is None:
        targets: list[Any] = [NO_TARGET] * len(manifest.leaves)
        treedef = order = None
    else:
        flat, treedef = _tree.flatten(target)
        targets, order = _match(manifest, flat, directory, partial=partial)
    reader = _read.PieceReader(
        manifest,
        directory,
        context,
        pool,
        verify=verify,
        io_pool=io_pool,
        root_options=root_options,
    )
    plans = _plan_leaves(reader, manifest, targets, directory)
    # One flat batch of region reads over all leaves (few asyncio tasks per leaf), then
    # one batched device_put for every device buffer of every leaf.
    batch = [
        (i, j, req, _tree.to_dtype(rec.dtype))
        for i, (rec, plan) in enumerate(zip(manifest.leaves, plans, strict=True))
        for j, req in enumerate(plan.requests)
    ]
    values = _place(plans, batch, _read_batch(reader, batch))
    if treedef is None:
        return _tree.rebuild([leaf.keys for leaf in manifest.leaves], values)
    return jax.tree_util.tree_unflatten(
        treedef, [values[o] if isinstance(o, int) else o.value for o in order]
    )


def _plan_leaves(
    reader: _read.PieceReader, manifest: Manifest, targets: list[Any], directory: pathlib.Path
) -> list[LeafPlan]:
    """Every saved leaf's plan, given its target leaf: what to read and how to build it."""
    places = Placements()
    by_leaf: list[list[PieceRecord]] = [[] for _ in manifest.leaves]
    for p in manifest.pieces:
        by_leaf[p.leaf].append(p)
    # Plan every leaf first: bad targets fail before any I/O, and the reader learns how
    # often each file is needed so it can free it after its last use.
    return [
        plan_leaf(reader, rec, t, by_leaf[i], directory, places)
        for i, (rec, t) in enumerate(zip(manifest.leaves, targets, strict=True))
    ]


# One region to read: (leaf index, index of the request in its leaf's plan, the request, the
# leaf's dtype).
_Read = tuple[int, int, Request, np.dtype]


def _read_batch(reader: _read.PieceReader, batch: list[_Read]) -> list[np.ndarray]:
    """The host array of every region of ``batch``, in its order, read in one concurrent batch."""
    # A region that is one whole member of a pack is a view of the pack's buffer (no copy);
    # those are taken together, the other regions are assembled one task each.
    members = {k: m for k, (_, _, req, _) in enumerate(batch) if (m := _pack_member(req))}
    rest = [k for k in range(len(batch)) if k not in members]

    async def run() -> list[np.ndarray]:
        views, built = await _io.gather_all(
            [
                reader.members(list(members.values())),
                _io.gather_all(_assemble(reader, batch[k][3], batch[k][2]) for k in rest),
            ]
        )
        out: list[Any] = [None] * len(batch)
        for k, data in zip([*members, *rest], [*views, *built], strict=True):
            out[k] = data
        return out

    return _io.run_sync(run()) if batch else []


def _place(plans: list[LeafPlan], batch: list[_Read], datas: list[np.ndarray]) -> list[Any]:
    """Every leaf's value, built from its regions' host arrays or from their device buffers."""
    host: list[list[Any]] = [[None] * len(plan.requests) for plan in plans]
    to_put, devices, owners = [], [], []
    for (i, j, _, _), data in zip(batch, datas, strict=True):
        if plans[i].devices is None:
            host[i][j] = data
        else:
            for k, device in enumerate(plans[i].devices[j]):
                # On CPU, device_put adopts the aligned buffer: each device gets its own.
                to_put.append(data if k == 0 else _io.aligned_copy(data))
                devices.append(device)
                owners.append(i)
    placed: list[list[Any]] = [[] for _ in plans]
    # Placed here, in the caller's thread, not as each region arrives: JAX's configuration
    # (jax_enable_x64 above all) is thread-local, and the reads' event loop may run in a
    # thread of its own (``run_sync``), where a 64-bit leaf would silently narrow.
    for i, array in zip(owners, jax.device_put(to_put, devices), strict=True):
        placed[i].append(array)
    return [
        plan.finish(host[i] if plan.devices is None else placed[i]) for i, plan in enumerate(plans)
    ]


# A saved leaf no target leaf has claimed (yet).
_UNMATCHED = object()


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A target leaf returned as it is: an empty node that older manifests did not record."""

    value: Any


def _match(
    manifest: Manifest, flat: list[tuple[Any, Any]], directory: pathlib.Path, *, partial: bool
) -> tuple[list[Any], list[int | _Kept]]:
    """Pairs the target's leaves with the saved ones by key path (dict keys and attributes alike).

    With ``partial``, a saved leaf the target lacks gets ``ocp.PLACEHOLDER`` (it is not read).

    Returns:
      Per saved leaf, its target leaf; per target leaf in flattening order, the index of its
      saved leaf (or a :class:`_Kept`).

    Raises:
      ValueError: the target has a leaf that was not saved, or (without ``partial``) a saved
        leaf is missing from the target (both lists are named).
    """
    index: dict[tuple[Any, ...], int] = {}
    for i, leaf in enumerate(manifest.leaves):
        index.setdefault(_tree.plain_path(leaf.keys), i)
    targets: list[Any] = [_UNMATCHED] * len(manifest.leaves)
    order: list[int | _Kept] = []
    extra = []
    for path, leaf in flat:
        i = index.get(_tree.plain_path(_tree.encode_keys(path)))
        if i is not None and targets[i] is _UNMATCHED:
            targets[i] = leaf
            order.append(i)
        elif _tree.is_empty(leaf) and not isinstance(leaf, dict | list | tuple | type(None)):
            # A field-less dataclass: manifests written before cocijax recorded these lack it.
            order.append(_Kept(leaf))
        else:
            extra.append(jax.tree_util.keystr(path))
    missing = [
        leaf.path for leaf, t in zip(manifest.leaves, targets, strict=True) if t is _UNMATCHED
    ]
    if partial and not extra:
        # Omitted leaves are planned like placeholders: not read, and not in the result (the
        # result is built from the target's own structure).
        return [ocp.PLACEHOLDER if t is _UNMATCHED else t for t in targets], order
    if partial:
        raise ValueError(
            f"Partial restore of {directory}: the target has leaves that were never saved: "
            f"{', '.join(extra)}; a partial target must be a sub-tree of the saved tree "
            f"(saved leaves: {', '.join(leaf.path for leaf in manifest.leaves[:8])}"
            f"{', ...' if len(manifest.leaves) > 8 else ''})."
        )
    if missing or extra:
        raise ValueError(
            f"User-provided restore item and on-disk value in {directory} differ: leaves saved "
            f"but not in the target: {', '.join(missing) or 'none'}; in the target but not "
            f"saved: {', '.join(extra) or 'none'}."
        )
    return targets, order


def _pack_member(request: Request) -> PieceRecord | None:
    """The packed piece that ``request`` is exactly, whole; ``None`` if it is not one."""
    start, stop, parts = request
    if len(parts) != 1 or parts[0][0].offset is None:
        return None
    piece, lo, hi = parts[0]
    return piece if (lo, hi) == (start, stop) == (piece.start, piece.stop) else None


async def _assemble(reader: _read.PieceReader, dtype: np.dtype, request: Request) -> np.ndarray:
    """The host array of one requested region of one leaf, read in place from its pieces."""
    start, stop, parts = request
    out = _io.aligned_empty(tuple(b - a for a, b in zip(start, stop, strict=True)), dtype)
    await _io.gather_all(
        reader.read_into(p, lo, hi, out[_layout.local_slices(lo, hi, start)]) for p, lo, hi in parts
    )
    return out
