"""The durable tier's layout: which steps a listing shows committed, and each step's record.

One prefix per step (see ``_tiers``)::

    <durable>/<step>/...                          every file of the local step directory
    <durable>/<step>/state/cocijax-stripe-*/p*    the state's pieces (zarr v3), from every root
    <durable>/<step>/cocijax_step.json            the other files, with sizes and xxh3_64
    <durable>/<step>/state/cocijax_manifest.json  written last: the step is committed

The record (``cocijax_step.json``) is read from a store anyone may have written to: every field
is checked before it is used, and anything malformed is a
:class:`~cocijax.storage.CorruptCheckpointError` (or a :class:`~cocijax.storage.Problem`)
naming the step and the object's URL, never a bare ``KeyError``.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import xxhash

from cocijax import storage
from cocijax.manager._directory import STATE_ITEM, STEP_RE
from cocijax.storage._kvpath import is_transient, probe_writable
from cocijax.storage._records import MANIFEST_NAME

__all__ = [
    "STEP_FILES",
    "StepRecord",
    "make_record",
    "read_record",
    "scan",
    "scan_within",
    "step_files",
    "verify_durable_step",
]

STEP_FILES = "cocijax_step.json"
"""The durable step's record of its files other than the pieces (path, size, xxh3_64)."""
_STEP_FORMAT = "cocijax-durable-step"
COMMIT_KEY = f"{STATE_ITEM}/{MANIFEST_NAME}"
"""The key, below a step's prefix, whose object commits the step."""


def digest(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class StepRecord:
    """A checked ``cocijax_step.json``: the step's files besides pieces, and who drained it.

    Attributes:
      files: ``(path, size, xxh3_64)`` of each file, ``path`` relative to the step's prefix.
      owner: the writer that drained the step (``"unknown"`` for records without one).
    """

    def __init__(self, files: list[tuple[str, int, int]], owner: str):
        self.files = files
        self.owner = owner


def make_record(step: int, others: Mapping[str, bytes], owner: str) -> bytes:
    """The record of a step whose other files are ``others`` (relative path -> bytes)."""
    files = [{"path": k, "size": len(v), "xxh3_64": digest(v)} for k, v in others.items()]
    record = {"format": _STEP_FORMAT, "version": 1, "step": step, "owner": owner, "files": files}
    return json.dumps(record).encode()


def read_record(prefix: storage.KvPath, step: int) -> StepRecord:
    """Reads and checks the record of the durable step at ``prefix``.

    Raises:
      CorruptCheckpointError: the record is missing, not JSON, or a field is missing or of the
        wrong type, or a path leaves the step (names the step and the record's URL).
      ValueError, OSError: the store cannot be read.
    """
    where = prefix / STEP_FILES
    data = where.read_bytes()

    def bad(what: str) -> storage.CorruptCheckpointError:
        return storage.CorruptCheckpointError(f"step {step}: {where.url}: {what}.")

    if data is None:
        raise bad("missing (every committed durable step has one)")
    try:
        record = json.loads(data)
    except ValueError as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(record, dict) or record.get("format") != _STEP_FORMAT:
        raise bad(f"not a cocijax durable step record (format {_STEP_FORMAT!r} expected)")
    entries = record.get("files")
    if not isinstance(entries, list):
        raise bad("'files' is missing or not a list")
    files = []
    for i, entry in enumerate(entries):
        fields = (
            (entry.get("path"), entry.get("size"), entry.get("xxh3_64"))
            if isinstance(entry, dict)
            else (None, None, None)
        )
        path, size, xxh = fields
        if not isinstance(path, str) or not _inside(path):
            raise bad(f"files[{i}]: 'path' is missing, or not a relative path inside the step")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, xxh)):
            raise bad(f"files[{i}] ({path}): 'size' or 'xxh3_64' is missing or not an int")
        files.append((path, size, xxh))
    owner = record.get("owner")
    return StepRecord(files, owner if isinstance(owner, str) else "unknown")


def _inside(path: str) -> bool:
    # The files are downloaded into a temporary directory: no path may lead out of it.
    parts = pathlib.PurePosixPath(path).parts
    return bool(parts) and not path.startswith("/") and ".." not in parts


def scan(root: storage.KvPath) -> tuple[list[int], list[int]]:
    """A durable tier's committed steps, and its step prefixes without a manifest (drains that
    never committed or are in progress), both sorted, from one listing.

    Raises:
      ValueError, OSError: the tier cannot be listed (TensorStore's error, naming it;
        ``StoreTimeoutError`` past the root's deadline).
    """
    seen: set[int] = set()
    committed: set[int] = set()
    for key in root.list():
        head, _, rest = key.partition("/")
        if STEP_RE.match(head):
            seen.add(int(head))
            if rest == COMMIT_KEY:
                committed.add(int(head))
    return sorted(committed), sorted(seen - committed)


def scan_within(root: storage.KvPath, timeout_s: float | None, *, writable: bool) -> list[int]:
    """A durable tier's committed steps, listed (and, if ``writable``, a probe object written)
    with short request retries; failures that may pass are tried again until ``timeout_s``.

    Raises:
      ValueError, OSError: the tier cannot be listed (or written): the failure that was retried
        rather than the deadline that cut the last try short, which says less.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay, cause = 0.1, None
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        try:
            committed = scan(root.for_probe().with_timeout(left))[0]
            if writable:
                probe_writable(root, left)
            return committed
        except (ValueError, OSError) as e:
            if cause is None or not isinstance(e, TimeoutError):
                cause = e
            left = None if deadline is None else deadline - time.monotonic()
            if not is_transient(e) or (left is not None and left <= delay):
                if cause is e:
                    raise
                raise cause from e
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


def step_files(
    prefix: storage.KvPath, step: int
) -> list[tuple[str, bytes | None, storage.Problem | None]]:
    """Each file a durable step records besides its pieces: ``(path, data, problem)``.

    ``problem`` is ``None`` when the file has the size and xxh3_64 its record says; a record
    that is missing or malformed is one problem (path ``cocijax_step.json``), naming the step.
    """
    try:
        record = read_record(prefix, step)
    except storage.CorruptCheckpointError as e:
        return [(STEP_FILES, None, storage.Problem("", str(prefix / STEP_FILES), str(e)))]
    out = []
    datas = prefix.read_many([path for path, _, _ in record.files])
    for path, size, xxh in record.files:
        where = prefix / path
        data = datas[path]
        problem = None
        if data is None or len(data) != size or digest(data) != xxh:
            found = "missing" if data is None else f"{len(data)} bytes, xxh3_64 {digest(data)}"
            problem = storage.Problem(
                "",
                str(where),
                f"step {step}: {where}: expected {size} bytes with xxh3_64 {xxh}, found {found}.",
            )
        out.append((path, data, problem))
    return out


def verify_durable_step(
    root: storage.KvPath, step: int, *, root_options: Mapping[str, Any] | None = None
) -> list[storage.Problem]:
    """Every problem of a committed durable step: its pieces (``storage.verify``) and its other
    files (sizes and xxh3_64 against its record)."""
    prefix = root / str(step)
    problems = [p for _, _, p in step_files(prefix, step) if p is not None]
    return problems + storage.verify(prefix / STATE_ITEM, root_options=root_options)
