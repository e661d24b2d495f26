"""Restore planning for the striped handler: which regions each device needs, from which pieces.

Every leaf is planned before any I/O (so a bad target fails fast and each file's number of uses
is known), then all regions of all leaves are read in one concurrent batch across the roots,
and all device buffers are placed with one batched ``jax.device_put``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from orbax.checkpoint._src import asyncio_utils

from cocijax.storage import _io, _layout, _manifest, _tree
from cocijax.storage._manifest import LeafRecord, Manifest, PieceRecord


def restore_tree(
    directory: pathlib.Path,
    target: Any,
    context: ts.Context,
    pool: concurrent.futures.Executor,
    *,
    verify: bool,
    io_pool: concurrent.futures.Executor | None = None,
    roots: Sequence[os.PathLike | str | None] | None = None,
) -> Any:
    """Restores the item in ``directory`` into ``target`` (see ``StripedCheckpointHandler``).

    ``roots`` replaces the recorded roots (see ``Manifest.with_roots``).

    Raises:
      CheckpointFormatError: the manifest is missing or invalid.
      ValueError: the target's structure, shapes or dtypes differ (names the leaf).
      CorruptCheckpointError: a piece is missing or corrupt (names the leaf and the file).
    """
    manifest = _manifest.read_manifest(directory).with_roots(roots)
    if target is None:
        targets: list[Any] = [_NO_TARGET] * len(manifest.leaves)
        treedef = None
    else:
        flat, treedef = _tree.flatten(target)
        _check_structure(manifest, [jax.tree_util.keystr(p) for p, _ in flat], directory)
        targets = [leaf for _, leaf in flat]
    reader = _io.PieceReader(manifest, directory, context, pool, verify=verify, io_pool=io_pool)
    by_leaf: list[list[PieceRecord]] = [[] for _ in manifest.leaves]
    for p in manifest.pieces:
        by_leaf[p.leaf].append(p)
    # Plan every leaf first: bad targets fail before any I/O, and the reader learns how
    # often each file is needed so it can free it after its last use.
    plans = [
        _plan_leaf(reader, rec, t, by_leaf[i], directory)
        for i, (rec, t) in enumerate(zip(manifest.leaves, targets, strict=True))
    ]
    # One flat batch of region reads over all leaves (few asyncio tasks per leaf), then
    # one batched device_put for every device buffer of every leaf.
    batch = [
        (i, j, req, _tree.to_dtype(rec.dtype))
        for i, (rec, plan) in enumerate(zip(manifest.leaves, plans, strict=True))
        for j, req in enumerate(plan.requests)
    ]

    async def run() -> list[np.ndarray]:
        return await _io.gather_all(_assemble(reader, dt, req) for _, _, req, dt in batch)

    datas = asyncio_utils.run_sync(run()) if batch else []
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
    for i, array in zip(owners, jax.device_put(to_put, devices), strict=True):
        placed[i].append(array)
    values = [
        plan.finish(host[i] if plan.devices is None else placed[i]) for i, plan in enumerate(plans)
    ]
    if treedef is None:
        return _tree.rebuild([leaf.keys for leaf in manifest.leaves], values)
    return jax.tree_util.tree_unflatten(treedef, values)


# Leaf target of a restore without a target tree (``None`` is a leaf value of its own).
_NO_TARGET = object()


def _check_structure(manifest: Manifest, paths: list[str], directory: pathlib.Path) -> None:
    saved = [leaf.path for leaf in manifest.leaves]
    if saved == paths:
        return
    missing = sorted(set(saved) - set(paths))
    extra = sorted(set(paths) - set(saved))
    raise ValueError(
        f"The restore target's tree differs from the one saved in {directory}: leaves saved "
        f"but not in the target: {', '.join(missing) or 'none'}; in the target but not saved: "
        f"{', '.join(extra) or 'none'}" + ("" if missing or extra else "; leaf order differs") + "."
    )


def _target_spec(record: LeafRecord, target: Any, directory: pathlib.Path):
    """(shape, dtype, sharding or None) the target asks for; ValueError on mismatch."""
    shape = tuple(int(d) for d in target.shape)
    dtype = np.dtype(target.dtype)
    if shape != record.shape or dtype.name != record.dtype:
        raise ValueError(
            f"Leaf {record.path} in {directory}: the target asks for shape {shape} dtype "
            f"{dtype.name}, but the checkpoint holds shape {record.shape} dtype {record.dtype}."
        )
    return getattr(target, "sharding", None)


def jax_can_hold(dtype: np.dtype) -> bool:
    """Whether a ``jax.Array`` holds ``dtype`` as it is.

    With ``jax_enable_x64`` off, JAX stores 64-bit types in 32 bits (int64 -> int32, float64 ->
    float32, complex128 -> complex64): such a leaf must never be placed on a device silently.
    """
    return jax.dtypes.canonicalize_dtype(dtype) == dtype


def _narrowing_error(record: LeafRecord, dtype: np.dtype, directory: pathlib.Path) -> ValueError:
    narrowed = jax.dtypes.canonicalize_dtype(dtype)
    return ValueError(
        f"Leaf {record.path} in {directory}: the checkpoint holds {dtype.name}, but a jax.Array "
        f"would narrow it to {narrowed.name} because jax_enable_x64 is off. Enable it "
        "(jax.config.update('jax_enable_x64', True)), or restore this leaf without a sharding "
        "(a numpy target, or a jax.ShapeDtypeStruct with sharding=None) to get a numpy array."
    )


def _same_value(a: Any, b: Any) -> bool:
    """Equal, counting NaN equal to NaN and telling bool from int (True is not 1 here)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _exact_scalar(
    record: LeafRecord, value: Any, dtype: np.dtype, directory: pathlib.Path
) -> np.ndarray:
    """``value`` (a saved Python scalar) as a 0-d array of ``dtype``; ValueError if inexact."""
    try:
        data = np.asarray(value, dtype=dtype)
        exact = _same_value(type(value)(data.item()), value)
    except (OverflowError, ValueError, TypeError):
        exact = False
    if not exact:
        raise ValueError(
            f"Leaf {record.path} in {directory}: the checkpoint holds the Python {record.kind} "
            f"{value!r}, which the target's dtype {dtype.name} cannot hold exactly; use a "
            "target of a wider dtype (or a Python scalar)."
        )
    return data


# A region to restore: global start, stop, and the (piece, lo, hi) overlaps that fill it.
_Request = tuple[tuple[int, ...], tuple[int, ...], list[tuple[PieceRecord, tuple, tuple]]]


def _request(
    reader: _io.PieceReader,
    pieces: list[PieceRecord],
    start: tuple[int, ...],
    stop: tuple[int, ...],
) -> _Request:
    parts = []
    for p in pieces:
        lo = tuple(max(a, c) for a, c in zip(start, p.start, strict=True))
        hi = tuple(min(b, d) for b, d in zip(stop, p.stop, strict=True))
        if all(a < b for a, b in zip(lo, hi, strict=True)):
            parts.append((p, lo, hi))
            reader.reserve(p)
    return start, stop, parts


async def _assemble(reader: _io.PieceReader, dtype: np.dtype, request: _Request) -> np.ndarray:
    """The host array of one requested region of one leaf, read in place from its pieces."""
    start, stop, parts = request
    out = _io.aligned_empty(tuple(b - a for a, b in zip(start, stop, strict=True)), dtype)
    await _io.gather_all(
        reader.read_into(p, lo, hi, out[_layout.local_slices(lo, hi, start)]) for p, lo, hi in parts
    )
    return out


@dataclasses.dataclass
class _LeafPlan:
    """How to restore one leaf.

    Attributes:
      requests: regions to read.
      finish: builds the leaf from the requests' host arrays (``devices is None``) or from the
        device buffers, one per device, in ``devices`` order.
      devices: per request, the devices that need it; ``None`` for host (numpy) results.
    """

    requests: list[_Request]
    finish: Any
    devices: list[list[Any]] | None = None


def _plan_leaf(
    reader: _io.PieceReader,
    record: LeafRecord,
    target: Any,
    pieces: list[PieceRecord],
    directory: pathlib.Path,
) -> _LeafPlan:
    """Checks ``target`` against ``record`` and lists the regions to read, before any I/O."""
    if target is _NO_TARGET and record.kind == _tree.EMPTY_KIND:
        return _LeafPlan([], lambda _: _tree.rebuild_empty(record.value))
    if (record.kind == _tree.EMPTY_KIND) != _tree.is_empty(target):
        held = "None or an empty container" if record.kind == _tree.EMPTY_KIND else "a value"
        raise ValueError(
            f"Leaf {record.path} in {directory}: the checkpoint holds {held}, but the target "
            f"holds {type(target).__name__}."
        )
    if record.kind == _tree.EMPTY_KIND:
        return _LeafPlan([], lambda _: target)  # the target's own (empty) object
    if record.kind in _tree.SCALAR_KINDS:
        value = {"bool": bool, "int": int, "float": float}[record.kind](record.value)
        if target is _NO_TARGET or isinstance(target, bool | int | float):
            return _LeafPlan([], lambda _: value)
        # A saved Python scalar restores into a 0-d array target (e.g. from jax.eval_shape).
        if tuple(target.shape) != ():
            raise ValueError(
                f"Leaf {record.path} in {directory}: the target asks for shape "
                f"{tuple(target.shape)}, but the checkpoint holds a Python {record.kind}."
            )
        data = _exact_scalar(record, value, np.dtype(target.dtype), directory)
        if isinstance(target, np.ndarray | np.generic):
            return _LeafPlan([], lambda _: data if isinstance(target, np.ndarray) else data[()])
        sharding = getattr(target, "sharding", None)
        if not jax_can_hold(data.dtype):
            if sharding is not None:
                raise _narrowing_error(record, data.dtype, directory)
            return _LeafPlan([], lambda _: data)
        return _LeafPlan([], lambda _: jax.device_put(data, sharding))
    whole = ((0,) * len(record.shape), record.shape)
    if target is _NO_TARGET or isinstance(target, np.ndarray | np.generic):
        if target is not _NO_TARGET:
            _target_spec(record, target, directory)
        full = _request(reader, pieces, *whole)
        scalar = (
            record.kind == "np_scalar" if target is _NO_TARGET else isinstance(target, np.generic)
        )
        return _LeafPlan([full], lambda d: d[0][()] if scalar else d[0])
    if isinstance(target, bool | int | float):
        kind = type(target)

        def to_python(d: list[np.ndarray]) -> Any:
            saved = d[0].item()
            value = kind(saved)
            if not _same_value(value, saved):
                raise ValueError(
                    f"Leaf {record.path} in {directory}: the target is a Python "
                    f"{kind.__name__}, which cannot hold the saved {record.dtype} value {saved!r} "
                    "exactly; use a target of the saved dtype."
                )
            return value

        return _LeafPlan([_request(reader, pieces, *whole)], to_python)
    if not (hasattr(target, "shape") and hasattr(target, "dtype")):
        raise ValueError(
            f"Leaf {record.path}: unsupported restore target {type(target).__name__}; expected "
            "jax.ShapeDtypeStruct, jax.Array, numpy array/scalar or a Python scalar."
        )
    sharding = _target_spec(record, target, directory)
    if not jax_can_hold(_tree.to_dtype(record.dtype)):
        if sharding is not None:
            raise _narrowing_error(record, _tree.to_dtype(record.dtype), directory)
        # No placement asked for: a numpy array keeps every bit (as Orbax returns it).
        return _LeafPlan([_request(reader, pieces, *whole)], lambda d: d[0])
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    boxes: dict[tuple, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(record.shape).items():
        boxes.setdefault(_layout.box(index, record.shape), []).append(device)
    requests = [_request(reader, pieces, *box) for box in boxes]

    def finish(arrays: list[jax.Array]) -> jax.Array:
        return jax.make_array_from_single_device_arrays(record.shape, sharding, arrays)

    return _LeafPlan(requests, finish, devices=list(boxes.values()))
