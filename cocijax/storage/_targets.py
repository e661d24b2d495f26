"""Restore targets, leaf by leaf: each checked against what was saved, and how it is read.

Before any I/O, :func:`plan_leaf` checks a target leaf against the saved leaf's record (kind,
shape, dtype, whether JAX would narrow it) and returns a :class:`LeafPlan`: the regions to read
(:data:`Request`) and how to build the value from them, on the host or on the devices of the
sharding the target asks for (or the saved one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from orbax.checkpoint import metadata as ocp_metadata

from cocijax.storage import _layout, _read, _tree
from cocijax.storage._metadata import logical, sharding_metadata
from cocijax.storage._records import LeafRecord, PieceRecord, RegionNotHeldError

# Leaf target of a restore without a target tree (``None`` is a leaf value of its own).
NO_TARGET = object()


class Placements:
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
Request = tuple[tuple[int, ...], tuple[int, ...], list[tuple[PieceRecord, tuple, tuple]]]


def _request(
    reader: _read.PieceReader,
    pieces: list[PieceRecord],
    start: tuple[int, ...],
    stop: tuple[int, ...],
) -> Request:
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


@dataclasses.dataclass
class LeafPlan:
    """How to restore one leaf.

    Attributes:
      requests: regions to read.
      finish: builds the leaf from the requests' host arrays (``devices is None``) or from the
        device buffers, one per device, in ``devices`` order.
      devices: per request, the devices that need it; ``None`` for host (numpy) results.
    """

    requests: list[Request]
    finish: Any
    devices: list[list[Any]] | None = None


def plan_leaf(
    reader: _read.PieceReader,
    record: LeafRecord,
    target: Any,
    pieces: list[PieceRecord],
    directory: pathlib.Path,
    places: Placements,
) -> LeafPlan:
    """Checks ``target`` against ``record`` and lists the regions to read, before any I/O.

    Raises:
      ValueError: the target does not fit the saved leaf (names the leaf).
      RegionNotHeldError: a host-local manifest (``holder``) does not hold a region this
        process needs (names the leaf, the region and the process).
    """
    plan = _plan(reader, record, target, pieces, directory, places)
    holder = reader.manifest.holder
    if holder is None:
        return plan  # a whole manifest covers every leaf (checked when it was read)
    for start, stop, parts in plan.requests:
        # The pieces of one process's copy never overlap: equal volume means full cover.
        have = sum(math.prod(b - a for a, b in zip(lo, hi, strict=True)) for _, lo, hi in parts)
        if have != math.prod(b - a for a, b in zip(start, stop, strict=True)):
            raise RegionNotHeldError(
                f"Leaf {record.path} in {directory}: region {list(start)}..{list(stop)} is not "
                f"in this copy, which holds the shards of process {holder} only (a host-local "
                "copy restores on the devices it was saved from); restore this step from a copy "
                "holding every region (the durable tier's), or an older step."
            )
    return plan


def _plan(
    reader: _read.PieceReader,
    record: LeafRecord,
    target: Any,
    pieces: list[PieceRecord],
    directory: pathlib.Path,
    places: Placements,
) -> LeafPlan:
    if target is ocp.PLACEHOLDER:
        return LeafPlan([], lambda _: ocp.PLACEHOLDER)  # not asked for: not read
    if isinstance(target, ocp_metadata.Metadata):
        target = _from_metadata(record, target, directory)
    if record.kind == _tree.EMPTY_KIND:
        return _plan_empty(record, target, directory)
    if _tree.is_empty(target):
        if isinstance(target, optax.MaskedNode):
            return LeafPlan([], lambda _: target)  # masked out in the target: not restored
        raise ValueError(
            f"Leaf {record.path} in {directory}: the checkpoint holds a value, but the target "
            f"holds {type(target).__name__}."
        )
    if record.kind == _tree.STR_KIND:
        if target is not NO_TARGET and not isinstance(target, str):
            raise ValueError(
                f"Leaf {record.path} in {directory}: the checkpoint holds a string, but the "
                f"target holds {type(target).__name__}."
            )
        return LeafPlan([], lambda _: record.value)
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
    if target is NO_TARGET:
        if record.kind == "jax":  # back where it was saved, as Orbax restores it
            return _plan_device(reader, record, pieces, places.saved_or_default(record), False)
        full = _request(reader, pieces, *whole)
        return LeafPlan([full], lambda d: d[0][()] if record.kind == "np_scalar" else d[0])
    if isinstance(target, np.ndarray | np.generic):
        _target_spec(record, target, directory)
        full = _request(reader, pieces, *whole)
        return LeafPlan([full], lambda d: d[0][()] if isinstance(target, np.generic) else d[0])
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

        return LeafPlan([_request(reader, pieces, *whole)], to_python)
    _check_array_target(record, target, directory)
    sharding = _target_spec(record, target, directory)
    if sharding is not None:
        return _plan_device(reader, record, pieces, sharding, True, directory)
    # No sharding asked for: the leaf goes back as saved (as Orbax's StandardCheckpointHandler
    # does): a jax.Array on its saved sharding (or the default device), a numpy array as numpy.
    if record.kind == "jax":
        return _plan_device(reader, record, pieces, places.saved_or_default(record), False)
    return LeafPlan([_request(reader, pieces, *whole)], lambda d: d[0])


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
        shape, dtype = logical(record)
        if tuple(target.shape) != shape or str(target.dtype) != str(dtype):
            raise ValueError(
                f"Leaf {record.path} in {directory}: the target's metadata describes shape "
                f"{tuple(target.shape)} dtype {target.dtype}, but the checkpoint holds shape "
                f"{shape} dtype {dtype}."
            )
    return NO_TARGET


def _plan_empty(record: LeafRecord, target: Any, directory: pathlib.Path) -> LeafPlan:
    if target is NO_TARGET:
        return LeafPlan([], lambda _: _tree.rebuild_empty(record.value))
    if _tree.is_empty(target):
        return LeafPlan([], lambda _: target)  # the target's own (empty) object
    if record.value == "masked":
        # A masked optimizer state restored with an unmasked target: the leaf has no value.
        return LeafPlan([], lambda _: None)
    raise ValueError(
        f"Leaf {record.path} in {directory}: the checkpoint holds None or an empty node, but "
        f"the target holds {type(target).__name__}."
    )


def _plan_scalar(record: LeafRecord, target: Any, directory: pathlib.Path) -> LeafPlan:
    """A saved Python scalar: as it is, or into a 0-d array target that holds it exactly."""
    value = {"bool": bool, "int": int, "float": float}[record.kind](record.value)
    if target is NO_TARGET or isinstance(target, bool | int | float):
        return LeafPlan([], lambda _: value)
    _check_array_target(record, target, directory)
    # A saved Python scalar restores into a 0-d array target (e.g. from jax.eval_shape).
    if tuple(target.shape) != ():
        raise ValueError(
            f"Leaf {record.path} in {directory}: the target asks for shape "
            f"{tuple(target.shape)}, but the checkpoint holds a Python {record.kind}."
        )
    data = _exact_scalar(record, value, np.dtype(target.dtype), directory)
    if isinstance(target, np.ndarray | np.generic):
        return LeafPlan([], lambda _: data if isinstance(target, np.ndarray) else data[()])
    sharding = getattr(target, "sharding", None)
    if not jax_can_hold(data.dtype):
        if sharding is not None:
            raise _narrowing_error(record, data.dtype, directory)
        return LeafPlan([], lambda _: data)
    return LeafPlan([], lambda _: jax.device_put(data, sharding))


def _plan_device(
    reader: _read.PieceReader,
    record: LeafRecord,
    pieces: list[PieceRecord],
    sharding: jax.sharding.Sharding,
    asked: bool,
    directory: pathlib.Path | None = None,
) -> LeafPlan:
    """A jax.Array on ``sharding``, one region read per distinct device region.

    A dtype that JAX would narrow (x64 off) raises when the target ``asked`` for the sharding
    and otherwise comes back as a numpy array that keeps every bit (as Orbax returns it).
    """
    dtype = _tree.to_dtype(record.dtype)
    if not jax_can_hold(dtype):
        if asked:
            raise _narrowing_error(record, dtype, directory)
        whole = ((0,) * len(record.shape), record.shape)
        return LeafPlan([_request(reader, pieces, *whole)], lambda d: d[0])
    boxes: dict[tuple, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(record.shape).items():
        boxes.setdefault(_layout.box(index, record.shape), []).append(device)
    requests = [_request(reader, pieces, *box) for box in boxes]

    def finish(arrays: list[jax.Array]) -> jax.Array:
        if len(arrays) == 1 and arrays[0].sharding == sharding:
            return arrays[0]  # one device: what device_put made is the array (~10 µs a leaf)
        return jax.make_array_from_single_device_arrays(record.shape, sharding, arrays)

    return LeafPlan(requests, finish, devices=list(boxes.values()))


def _key_sharding(
    record: LeafRecord, target: Any, directory: pathlib.Path, places: Placements
) -> jax.sharding.Sharding:
    """Where typed PRNG keys go: the target's sharding, else where they were saved."""
    shape, key_dtype = logical(record)
    if target is NO_TARGET:
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
) -> LeafPlan:
    """Typed PRNG keys: their key data is read, then wrapped with the saved implementation."""
    shape, _ = logical(record)
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

    return LeafPlan([_request(reader, pieces, *whole)], finish)


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
