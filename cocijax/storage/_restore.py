"""Restore planning for the striped handler: which regions each device needs, from which pieces.

Every leaf is planned before any I/O (so a bad target fails fast and each file's number of uses
is known), then all regions of all leaves are read in one concurrent batch across the roots,
and all device buffers are placed with one batched ``jax.device_put``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint import metadata as ocp_metadata

from cocijax._orbax_compat import TreeMetadata, build_tree_metadata
from cocijax.storage import _io, _layout, _manifest_io, _read, _tree
from cocijax.storage._records import LeafRecord, Manifest, PieceRecord


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
    places = _Placements()
    if partial and target is None:
        raise ValueError(
            f"partial restore of {directory} needs a target: the sub-tree of the saved tree "
            "to read (pass StripedRestore(target, partial=True))."
        )
    if target is None:
        targets: list[Any] = [_NO_TARGET] * len(manifest.leaves)
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
    by_leaf: list[list[PieceRecord]] = [[] for _ in manifest.leaves]
    for p in manifest.pieces:
        by_leaf[p.leaf].append(p)
    # Plan every leaf first: bad targets fail before any I/O, and the reader learns how
    # often each file is needed so it can free it after its last use.
    plans = [
        _plan_leaf(reader, rec, t, by_leaf[i], directory, places)
        for i, (rec, t) in enumerate(zip(manifest.leaves, targets, strict=True))
    ]
    # One flat batch of region reads over all leaves (few asyncio tasks per leaf), then
    # one batched device_put for every device buffer of every leaf.
    batch = [
        (i, j, req, _tree.to_dtype(rec.dtype))
        for i, (rec, plan) in enumerate(zip(manifest.leaves, plans, strict=True))
        for j, req in enumerate(plan.requests)
    ]

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

    datas = _io.run_sync(run()) if batch else []
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
    values = [
        plan.finish(host[i] if plan.devices is None else placed[i]) for i, plan in enumerate(plans)
    ]
    if treedef is None:
        return _tree.rebuild([leaf.keys for leaf in manifest.leaves], values)
    return jax.tree_util.tree_unflatten(
        treedef, [values[o] if isinstance(o, int) else o.value for o in order]
    )


# Leaf target of a restore without a target tree (``None`` is a leaf value of its own).
_NO_TARGET = object()
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


class _Placements:
    """Where leaves go when the target does not say: their saved sharding, else one device."""

    def __init__(self):
        self._saved: dict[str, jax.sharding.Sharding | None] = {}

    def saved(self, record: LeafRecord) -> jax.sharding.Sharding | None:
        """The sharding ``record`` was saved with, if this process's devices can rebuild it."""
        if record.sharding is None:
            return None
        key = json.dumps(record.sharding, sort_keys=True)
        if key not in self._saved:
            try:
                meta = sharding_metadata(record.sharding)
                self._saved[key] = meta.to_jax_sharding()
            # Saved on devices this job does not have, or a sharding Orbax cannot parse.
            except (ValueError, KeyError, TypeError, NotImplementedError, AttributeError):
                self._saved[key] = None
        return self._saved[key]

    def saved_or_default(self, record: LeafRecord) -> jax.sharding.Sharding:
        """:meth:`saved`, or the default device when that sharding cannot be rebuilt here."""
        return self.saved(record) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _target_spec(record: LeafRecord, target: Any, directory: pathlib.Path):
    """(shape, dtype, sharding or None) the target asks for; ValueError on mismatch."""
    shape = tuple(int(d) for d in target.shape)
    dtype = np.dtype(target.dtype)
    if shape != record.shape or _tree.dtype_name(dtype) != record.dtype:
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
    reader: _read.PieceReader,
    pieces: list[PieceRecord],
    start: tuple[int, ...],
    stop: tuple[int, ...],
) -> _Request:
    parts = []
    for p in pieces:
        if p.start == start and p.stop == stop:  # the usual case: the piece is the region
            lo, hi = start, stop
        else:
            lo = tuple(max(a, c) for a, c in zip(start, p.start, strict=True))
            hi = tuple(min(b, d) for b, d in zip(stop, p.stop, strict=True))
        if all(a < b for a, b in zip(lo, hi, strict=True)):
            parts.append((p, lo, hi))
            reader.reserve(p)
    return start, stop, parts


def _pack_member(request: _Request) -> PieceRecord | None:
    """The packed piece that ``request`` is exactly, whole; ``None`` if it is not one."""
    start, stop, parts = request
    if len(parts) != 1 or parts[0][0].offset is None:
        return None
    piece, lo, hi = parts[0]
    return piece if (lo, hi) == (start, stop) == (piece.start, piece.stop) else None


async def _assemble(reader: _read.PieceReader, dtype: np.dtype, request: _Request) -> np.ndarray:
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
    reader: _read.PieceReader,
    record: LeafRecord,
    target: Any,
    pieces: list[PieceRecord],
    directory: pathlib.Path,
    places: _Placements,
) -> _LeafPlan:
    """Checks ``target`` against ``record`` and lists the regions to read, before any I/O."""
    if target is ocp.PLACEHOLDER:
        return _LeafPlan([], lambda _: ocp.PLACEHOLDER)  # not asked for: not read
    if isinstance(target, ocp_metadata.Metadata):
        target = _from_metadata(record, target, directory)
    if record.kind == _tree.EMPTY_KIND:
        return _plan_empty(record, target, directory)
    if _tree.is_empty(target):
        if isinstance(target, optax.MaskedNode):
            return _LeafPlan([], lambda _: target)  # masked out in the target: not restored
        raise ValueError(
            f"Leaf {record.path} in {directory}: the checkpoint holds a value, but the target "
            f"holds {type(target).__name__}."
        )
    if record.kind == _tree.STR_KIND:
        if target is not _NO_TARGET and not isinstance(target, str):
            raise ValueError(
                f"Leaf {record.path} in {directory}: the checkpoint holds a string, but the "
                f"target holds {type(target).__name__}."
            )
        return _LeafPlan([], lambda _: record.value)
    if isinstance(target, str):
        raise ValueError(
            f"Leaf {record.path} in {directory}: the target holds a string, but the checkpoint "
            f"holds {record.kind}."
        )
    if record.kind == _tree.KEY_KIND:
        sharding = _key_sharding(record, target, directory, places)
        return _plan_key(reader, record, pieces, sharding, directory)
    if _tree.is_typed_key(target):
        raise ValueError(
            f"Leaf {record.path} in {directory}: the target asks for typed PRNG keys "
            f"({target.dtype}), but the checkpoint holds {record.kind} {record.dtype or ''}."
        )
    if record.kind in _tree.SCALAR_KINDS:
        return _plan_scalar(record, target, directory)
    whole = ((0,) * len(record.shape), record.shape)
    if target is _NO_TARGET:
        if record.kind == "jax":  # back where it was saved, as Orbax restores it
            return _plan_device(reader, record, pieces, places.saved_or_default(record), False)
        full = _request(reader, pieces, *whole)
        return _LeafPlan([full], lambda d: d[0][()] if record.kind == "np_scalar" else d[0])
    if isinstance(target, np.ndarray | np.generic):
        _target_spec(record, target, directory)
        full = _request(reader, pieces, *whole)
        return _LeafPlan([full], lambda d: d[0][()] if isinstance(target, np.generic) else d[0])
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
    _check_array_target(record, target, directory)
    sharding = _target_spec(record, target, directory)
    if sharding is not None:
        return _plan_device(reader, record, pieces, sharding, True, directory)
    # No sharding asked for: the leaf goes back as saved (as Orbax's StandardCheckpointHandler
    # does): a jax.Array on its saved sharding (or the default device), a numpy array as numpy.
    if record.kind == "jax":
        return _plan_device(reader, record, pieces, places.saved_or_default(record), False)
    return _LeafPlan([_request(reader, pieces, *whole)], lambda d: d[0])


def _check_array_target(record: LeafRecord, target: Any, directory: pathlib.Path) -> None:
    if not (hasattr(target, "shape") and hasattr(target, "dtype")):
        raise ValueError(
            f"Leaf {record.path} in {directory}: unsupported restore target "
            f"{type(target).__name__}; expected jax.ShapeDtypeStruct, jax.Array, numpy "
            "array/scalar, a Python scalar or string, ocp.PLACEHOLDER or Orbax metadata."
        )


def _from_metadata(record: LeafRecord, target: Any, directory: pathlib.Path) -> Any:
    """A leaf of Orbax metadata (what ``metadata()`` returns) as a target: restore as saved."""
    if isinstance(target, ocp_metadata.ArrayMetadata) and not isinstance(
        target, ocp_metadata.ScalarMetadata
    ):
        shape, dtype = _logical(record)
        if tuple(target.shape) != shape or str(target.dtype) != str(dtype):
            raise ValueError(
                f"Leaf {record.path} in {directory}: the target's metadata describes shape "
                f"{tuple(target.shape)} dtype {target.dtype}, but the checkpoint holds shape "
                f"{shape} dtype {dtype}."
            )
    return _NO_TARGET


def _logical(record: LeafRecord) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype a leaf has as a value (a key array's, not its key data's)."""
    if record.kind == _tree.KEY_KIND:
        key_dtype, key_shape = _tree.key_layout(record.key_impl)
        return record.shape[: len(record.shape) - len(key_shape)], key_dtype
    if record.dtype is None:
        return (), None
    return record.shape, _tree.to_dtype(record.dtype)


def _plan_empty(record: LeafRecord, target: Any, directory: pathlib.Path) -> _LeafPlan:
    if target is _NO_TARGET:
        return _LeafPlan([], lambda _: _tree.rebuild_empty(record.value))
    if _tree.is_empty(target):
        return _LeafPlan([], lambda _: target)  # the target's own (empty) object
    if record.value == "masked":
        # A masked optimizer state restored with an unmasked target: the leaf has no value.
        return _LeafPlan([], lambda _: None)
    raise ValueError(
        f"Leaf {record.path} in {directory}: the checkpoint holds None or an empty node, but "
        f"the target holds {type(target).__name__}."
    )


def _plan_scalar(record: LeafRecord, target: Any, directory: pathlib.Path) -> _LeafPlan:
    """A saved Python scalar: as it is, or into a 0-d array target that holds it exactly."""
    value = {"bool": bool, "int": int, "float": float}[record.kind](record.value)
    if target is _NO_TARGET or isinstance(target, bool | int | float):
        return _LeafPlan([], lambda _: value)
    _check_array_target(record, target, directory)
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


def _plan_device(
    reader: _read.PieceReader,
    record: LeafRecord,
    pieces: list[PieceRecord],
    sharding: jax.sharding.Sharding,
    asked: bool,
    directory: pathlib.Path | None = None,
) -> _LeafPlan:
    """A jax.Array on ``sharding``, one region read per distinct device region.

    A dtype that JAX would narrow (x64 off) raises when the target ``asked`` for the sharding
    and otherwise comes back as a numpy array that keeps every bit (as Orbax returns it).
    """
    dtype = _tree.to_dtype(record.dtype)
    if not jax_can_hold(dtype):
        if asked:
            raise _narrowing_error(record, dtype, directory)
        whole = ((0,) * len(record.shape), record.shape)
        return _LeafPlan([_request(reader, pieces, *whole)], lambda d: d[0])
    boxes: dict[tuple, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(record.shape).items():
        boxes.setdefault(_layout.box(index, record.shape), []).append(device)
    requests = [_request(reader, pieces, *box) for box in boxes]

    def finish(arrays: list[jax.Array]) -> jax.Array:
        if len(arrays) == 1 and arrays[0].sharding == sharding:
            return arrays[0]  # one device: what device_put made is the array (~10 µs a leaf)
        return jax.make_array_from_single_device_arrays(record.shape, sharding, arrays)

    return _LeafPlan(requests, finish, devices=list(boxes.values()))


def _key_sharding(
    record: LeafRecord, target: Any, directory: pathlib.Path, places: _Placements
) -> jax.sharding.Sharding:
    """Where typed PRNG keys go: the target's sharding, else where they were saved."""
    shape, key_dtype = _logical(record)
    if target is _NO_TARGET:
        sharding = places.saved_or_default(record)
    elif _tree.is_typed_key(target) and hasattr(target, "shape"):
        if tuple(target.shape) != shape or str(target.dtype) != str(key_dtype):
            raise ValueError(
                f"Leaf {record.path} in {directory}: the target asks for shape "
                f"{tuple(target.shape)} dtype {target.dtype}, but the checkpoint holds typed "
                f"PRNG keys of shape {shape} dtype {key_dtype}."
            )
        sharding = getattr(target, "sharding", None) or places.saved_or_default(record)
    else:
        raise ValueError(
            f"Leaf {record.path} in {directory}: the checkpoint holds typed PRNG keys (shape "
            f"{shape}, dtype {key_dtype}); the target must be a jax.ShapeDtypeStruct or "
            f"jax.Array of that dtype, got {type(target).__name__} "
            f"{getattr(target, 'dtype', '')}."
        )
    return sharding


def _plan_key(
    reader: _read.PieceReader,
    record: LeafRecord,
    pieces: list[PieceRecord],
    sharding: jax.sharding.Sharding,
    directory: pathlib.Path,
) -> _LeafPlan:
    """Typed PRNG keys: their key data is read, then wrapped with the saved implementation."""
    shape, _ = _logical(record)
    data_sharding = _key_data_sharding(sharding, len(record.shape) - len(shape))
    if data_sharding is not None:
        plan = _plan_device(reader, record, pieces, data_sharding, True, directory)
        wrap = plan.finish
        plan.finish = lambda arrays: jax.random.wrap_key_data(wrap(arrays), impl=record.key_impl)
        return plan
    # Another sharding type: wrap on the default device, then move (keys are small).
    whole = ((0,) * len(record.shape), record.shape)

    def finish(d: list[np.ndarray]) -> jax.Array:
        return jax.device_put(jax.random.wrap_key_data(d[0], impl=record.key_impl), sharding)

    return _LeafPlan([_request(reader, pieces, *whole)], finish)


def _key_data_sharding(
    sharding: jax.sharding.Sharding, extra_dims: int
) -> jax.sharding.Sharding | None:
    """The sharding of a key array's data: the keys' own, its key dimensions not split."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(*sharding.spec, *([None] * extra_dims))
        return jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
    return None


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
            shape, dtype = _logical(record)
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
