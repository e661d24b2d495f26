"""A striped handler's options, checked once and kept in one frozen object; its roots, resolved.

What ``StripedCheckpointHandler.__init__`` takes, checked where each value is defined: the
options a save or restore in flight reads (:class:`Options`), and the roots, each resolved to an
absolute local directory or an object-store prefix and proven writable before any save
(:func:`resolve_roots`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from cocijax import _files
from cocijax.storage import _kvpath, _write
from cocijax.storage._kvpath import KvPath


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """A handler's options: its constructor's arguments of the same names, checked.

    One frozen object, as Orbax keeps its options (``MultiprocessingOptions``): a save or
    restore in flight reads the options the handler was built with, and each check lives beside
    the value it checks. ``encoding`` holds ``chunk_bytes``, ``compression`` and
    ``compression_level`` (what a piece's zarr spec follows from); ``primary_host`` is
    ``multiprocessing_options.primary_host``.
    """

    root_options: Mapping[str, Any] | None
    concurrency: int
    encoding: _write.Encoding
    piece_bytes: int
    small_bytes: int
    checksums: bool
    direct_writes: bool
    reuse_host_buffers: bool
    write_while_copying: bool
    primary_host: int | None
    host_local: bool = False

    def __post_init__(self) -> None:
        for name, low in (("concurrency", 1), ("piece_bytes", 1), ("small_bytes", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")


def resolve_roots(
    roots: Sequence[os.PathLike | str],
    root_options: Mapping[str, Any] | None,
    store_timeout_s: float | None,
) -> tuple[pathlib.Path | KvPath | None, ...]:
    """The handler's ``roots``, resolved, distinct and writable; ``(None,)`` when there is none.

    ``None`` stands for the item directory. The arguments are the handler's of the same names.

    Raises:
      TypeError: ``roots`` is a single string or path instead of a sequence.
      ValueError: two roots are the same directory, or a root cannot be created or written.
    """
    if isinstance(roots, str | os.PathLike):
        raise TypeError(
            f"roots must be a sequence of directories, got the single path {roots!r}; "
            "write roots=[...]."
        )
    resolved: list[pathlib.Path | KvPath] = []
    for i, root in enumerate(roots):
        path = _kvpath.location(root, root_options)
        if isinstance(path, KvPath):
            check_writable(path, f"roots[{i}]", store_timeout_s)
        else:
            path = path.expanduser().absolute()
            check_writable(path, f"roots[{i}]", store_timeout_s)
            path = path.resolve()
        if path in resolved:
            raise ValueError(
                f"roots[{i}]={str(root)!r} is the same directory as "
                f"roots[{resolved.index(path)}]; each root must be distinct."
            )
        resolved.append(path)
    return tuple(resolved) or (None,)


def check_writable(path: pathlib.Path | KvPath, name: str, timeout_s: float | None) -> None:
    """Raises ``ValueError`` naming ``name``, the path and the cause unless a file can be
    written at ``path`` (made if missing); an object store must answer within ``timeout_s``."""
    if isinstance(path, KvPath):
        _check_writable_object_store(path, name, timeout_s)
    else:
        _check_writable_local(path, name)


def _check_writable_local(path: pathlib.Path, name: str) -> None:
    try:
        _files.make_dirs(path)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".cocijax-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{name}={str(path)!r} cannot be written: {e}.") from e


def _check_writable_object_store(path: KvPath, name: str, timeout_s: float | None) -> None:
    # The same promise as for a local root: a root that cannot be written fails here, naming
    # it, not at the first save (a wrong endpoint, bucket or credentials).
    try:
        _kvpath.probe_writable(path, timeout_s)
    except (ValueError, OSError) as e:  # TensorStore raises ValueError for I/O failures
        raise ValueError(f"{name}={path.url!r} cannot be written: {e}.") from e
