"""The write path of a piece: its zarr v3 spec, TensorStore writes, durable directories.

Every piece is a standard zarr v3 array (``zarr3`` driver on the ``file`` kvstore, or on an
object store's), so zarr-python reads it without cocijax. TensorStore writes compressed pieces
and every piece on an object store; the files of uncompressed pieces on local roots are written
by ``_direct``: their chunk files, and the ``zarr.json`` that TensorStore made for them in
memory (:func:`metadata_file`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from cocijax.storage import _direct, _kvpath
from cocijax.storage._kvpath import KvPath


def chunk_shape(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> list[int]:
    """Chunk grid for a piece: whole trailing dimensions, axis 0 cut to about ``chunk_bytes``.

    When a chunk holds several rows, their count is rounded down so that every chunk spans a
    multiple of 4096 bytes: chunks of a page-aligned buffer then stay page-aligned.
    """
    if not shape:
        return []
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, min(shape[0], chunk_bytes // max(row, 1)))
    step = _direct.BLOCK // math.gcd(max(row, 1), _direct.BLOCK)
    if rows < shape[0] and rows >= step:
        rows -= rows % step
    return [rows, *shape[1:]]


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a piece is stored as a zarr v3 array: the size of its chunks and their codec.

    Everything :func:`write_spec` needs beyond the piece itself: two pieces of the same shape
    and dtype written with the same encoding are the same files.

    Attributes:
      chunk_bytes: approximate size of one chunk (one file or object), see :func:`chunk_shape`.
      compression: ``None`` or ``"zstd"``.
      compression_level: the zstd level.

    Raises:
      ValueError: an attribute is out of range (named as the handler's argument of that name).
    """

    chunk_bytes: int
    compression: str | None
    compression_level: int

    def __post_init__(self) -> None:
        for name, low in (("chunk_bytes", 1), ("compression_level", -131072)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {self.compression!r}.")


def write_spec(
    path: pathlib.Path | KvPath, dtype: np.dtype, shape: tuple[int, ...], encoding: Encoding
) -> dict[str, Any]:
    """The TensorStore spec that creates the zarr v3 array of a piece at ``path``."""
    chunks = chunk_shape(shape, dtype.itemsize, encoding.chunk_bytes)
    metadata: dict[str, Any] = {
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": chunks},
        },
    }
    # Pinned rather than left to defaults: _direct writes uncompressed chunk files itself. The
    # "." separator keeps every chunk file in the piece's directory ("c.3.0"), where "/" makes
    # a directory per chunk row ("c/3/0"), each one more file to create and fsync.
    metadata["chunk_key_encoding"] = {
        "name": "default",
        "configuration": {"separator": _direct.SEPARATOR},
    }
    metadata["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if encoding.compression == "zstd":
        zstd = {"name": "zstd", "configuration": {"level": encoding.compression_level}}
        metadata["codecs"].append(zstd)
    return {
        "driver": "zarr3",
        "kvstore": _kvpath.kvstore_spec(path),
        "metadata": metadata,
        "create": True,
        # Zero chunks must exist on disk too: reads refuse missing chunks (see read_spec).
        "store_data_equal_to_fill_value": True,
    }


# The file holding a zarr v3 array's metadata.
ZARR_JSON = "zarr.json"


def metadata_file(spec: dict[str, Any]) -> bytes:
    """The ``zarr.json`` TensorStore writes for ``spec`` (a :func:`write_spec`), byte for byte.

    Made by TensorStore itself, in memory, once per distinct metadata: pieces whose chunk files
    ``_direct`` writes get their ``zarr.json`` written beside them the same way, with no
    TensorStore round trip (a lock file, a rename and two fsyncs per piece) on the save path.
    """
    return _metadata_file(json.dumps(spec["metadata"], sort_keys=True))


@functools.lru_cache(maxsize=1024)
def _metadata_file(metadata: str) -> bytes:
    context = ts.Context()  # a memory kvstore of its own
    spec = {"driver": "zarr3", "kvstore": {"driver": "memory", "path": "a/"}, "create": True}
    ts.open(dict(spec, metadata=json.loads(metadata)), context=context).result()
    store = ts.KvStore.open({"driver": "memory"}, context=context).result()
    return store.read(f"a/{ZARR_JSON}").result().value


async def write_piece(spec: dict[str, Any], data: np.ndarray, context: ts.Context) -> None:
    array = await ts.open(spec, context=context)
    await array.write(data, can_reference_source_data_indefinitely=True)


async def check_written(stripe_dir: KvPath, pieces: dict[str, int]) -> None:
    """Checks that an object store lists every object of the pieces written under ``stripe_dir``.

    An object store has no fsync to wait for: a successful PUT is the durability promise.
    This one LIST makes sure each piece's ``zarr.json`` and all its chunk objects are there
    before a manifest names them.

    Args:
      stripe_dir: the stripe prefix.
      pieces: piece name -> number of chunk objects it must hold.

    Raises:
      OSError: an object is missing (names the piece's URL and what was found).
    """
    keys = await stripe_dir.open().list()
    found: dict[str, int] = {}
    meta: set[str] = set()
    for key in keys:
        name, _, rest = key.decode().partition("/")
        if rest == "zarr.json":
            meta.add(name)
        elif rest.startswith("c"):
            found[name] = found.get(name, 0) + 1
    for name, chunks in pieces.items():
        if name not in meta or found.get(name, 0) != chunks:
            raise OSError(
                f"{stripe_dir / name}: the object store lists {found.get(name, 0)} of {chunks} "
                f"chunk objects{'' if name in meta else ' and no zarr.json'} after the writes "
                "succeeded."
            )


def chunk_count(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> int:
    """How many chunk objects a piece of ``shape`` is stored in (see :func:`chunk_shape`)."""
    return grid_size(shape, chunk_shape(shape, itemsize, chunk_bytes)) if shape else 1


def grid_size(shape: Sequence[int], chunks: Sequence[int]) -> int:
    """How many chunks of shape ``chunks`` an array of ``shape`` has (edge chunks included)."""
    return math.prod(-(-n // c) for n, c in zip(shape, chunks, strict=True))
