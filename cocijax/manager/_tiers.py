"""The durable tier of :class:`cocijax.CheckpointManager`: committed steps drained behind.

Multi-level checkpointing (LLNL's SCR; Orbax's emergency checkpoint manager): a save commits to
the fast local tier as before, then a background thread copies the committed step to durable
storage (an object store through TensorStore, ``s3://bucket/run``, ``gs://...``, or a path on a
shared file system). Layout of the durable tier, one prefix per step::

    <durable>/<step>/...                          every file of the local step directory
    <durable>/<step>/state/cocijax-stripe-*/p*    the state's pieces (zarr v3), from every root
    <durable>/<step>/cocijax_step.json            the other files, with sizes and xxh3_64
    <durable>/<step>/state/cocijax_manifest.json  written last: the step is committed

Only what an object store promises is assumed: a PUT makes one whole object appear; there is
no rename, no fsync, no directory. So a step is committed on the durable tier when its state
manifest exists, and that object is written after every other object of the step was written
and the pieces' listing checked; a drain killed half-way leaves a prefix without it, which is
not listed and is removed by the next garbage collection (and a new drain of the step first
removes it). Deleting a step removes its manifest first, so a step is never listed without its
data.

The drain never stalls training: ``save`` only hands the step over (:meth:`DurableTier.offer`).
One step is drained at a time; when more steps commit while a drain runs, only the newest is
drained next (the skipped ones are logged and counted in :attr:`DurableTier.skipped`). The step
being drained and the one waiting are *pinned*: local retention does not delete them until
their drain ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import xxhash

from cocijax import storage
from cocijax.manager._directory import POLICY_ITEM, STATE_ITEM, STEP_RE
from cocijax.manager._policy_item import PolicyStateHandler, PolicyStateRestore

__all__ = ["STEP_FILES", "DurableOptions", "DurableTier", "DurableTierError", "pin_steps"]

log = logging.getLogger(__name__)

STEP_FILES = "cocijax_step.json"
"""The durable step's record of its files other than the pieces (path, size, xxh3_64)."""
_STEP_FORMAT = "cocijax-durable-step"
# Local files that are the state item's own commit record or data: copied by copy_item.
_STATE_OWN = (storage.MANIFEST_NAME, "cocijax_manifest.part-")
# How often the drain thread looks for the local commit of the step it waits for (one stat).
_POLL_S = 0.005


class DurableTierError(RuntimeError):
    """A step could not be drained to the durable tier (names the step and the URL)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DurableOptions:
    """What a :class:`DurableTier` is opened with: fixed for its life, so that the drain thread
    reads them without the lock that guards the tier's changing state.

    Attributes:
      local: the local checkpoint directory.
      step_name: the local step directory name of a step (Orbax's name format).
      every: drain every ``every``-th committed step (1: all of them).
      max_to_keep: committed steps kept on the durable tier (``None``: all); the newest is
        never deleted.
      writer: this process drains and collects garbage (the primary writer); otherwise the
        tier is only listed and read.
      store_options: TensorStore kvstore options for an object store (``endpoint``, ...).
      source_options: kvstore options of the local tier's roots when they are on an object
        store themselves (the handler's ``root_options``).
      memory_bytes: piece data held in memory by a drain at once; between drains the tier
        keeps up to this much of host buffers faulted in for the next drain.
      clock: seconds, for the measured drain time.
    """

    local: Path
    step_name: Callable[[int], str]
    every: int
    max_to_keep: int | None
    writer: bool
    store_options: Mapping[str, Any] | None = None
    source_options: Mapping[str, Any] | None = None
    memory_bytes: int = 512 << 20
    clock: Callable[[], float] = time.monotonic


class DurableTier:
    """The durable copy of a checkpoint directory, and the thread that drains steps to it.

    Args:
      where: an object-store URL (``s3://bucket/run42``, ``gs://...``) or a path.
      options: how it is used (see :class:`DurableOptions`).
    """

    def __init__(self, where: str | os.PathLike, options: DurableOptions):
        self.root = storage.KvPath.parse(where, options.store_options)
        self.options = options
        self._cond = threading.Condition()
        self._steps: set[int] | None = None  # committed durable steps; None: not yet listed
        self._offered: int | None = None  # the newest step waiting to be drained
        self._draining: int | None = None
        self._local_settled = True  # no local save in flight (the manager waited for it)
        self._since_offer = 0  # commits since the last offered one (durable_every)
        self._errors: list[DurableTierError] = []
        self.skipped: list[int] = []
        self.drain_s = math.nan
        self._closed = False
        self._thread: threading.Thread | None = None
        # The drains' host buffers, kept from one drain to the next (see storage.BufferPool).
        self._buffers = storage.BufferPool(options.memory_bytes)

    @property
    def url(self) -> str:
        return self.root.url

    # -- listing ----------------------------------------------------------------------------

    def open(self, local_newest: int | None) -> None:
        """Lists the tier and, as the writer, drains the newest local step if it is newer.

        A previous run killed during a drain left the newest local step undrained (and maybe
        a prefix without a manifest, which that drain removes first). A durable tier that
        cannot be listed now is logged, not raised: training goes on locally.
        """
        self.refresh()
        if not self.options.writer:
            return
        self._thread = threading.Thread(target=self._run, name="cocijax-drain", daemon=True)
        self._thread.start()
        newest = max(self._steps or (), default=None)
        if local_newest is not None and (newest is None or local_newest > newest):
            log.info(
                "%s: step %d is not on the durable tier yet: draining it", self.url, local_newest
            )
            self.offer(local_newest, force=True)

    def refresh(self) -> list[int]:
        """Lists the committed steps on the durable tier (a LIST of its objects).

        A tier that cannot be listed (after TensorStore's retries) counts as empty until the
        next listing succeeds (after the next drain), so that callers do not wait for the
        retries again at every call.
        """
        try:
            steps = set(scan(self.root)[0])
        except (ValueError, OSError) as e:
            log.warning(
                "%s: cannot list the durable tier (%s); listed again after the next drain",
                self.url,
                e,
            )
            with self._cond:
                if self._steps is None:
                    self._steps = set()
                return sorted(self._steps)
        with self._cond:
            self._steps = steps
        return sorted(steps)

    def steps(self) -> list[int]:
        """The steps committed on the durable tier, oldest first (as last listed or drained)."""
        if self._steps is None:
            return self.refresh()
        with self._cond:
            return sorted(self._steps)

    def pinned(self) -> set[int]:
        """Steps local retention must keep for now: the one being drained and the next."""
        with self._cond:
            return {s for s in (self._offered, self._draining) if s is not None}

    # -- draining ---------------------------------------------------------------------------

    def offer(self, step: int, *, force: bool = False) -> None:
        """Hands over a step whose local save has started; it is drained once committed.

        Every ``every``-th offered step is taken (``force``: this one whatever the count). A
        step still waiting when a newer one is taken is skipped: only the newest is drained.
        """
        if not self.options.writer:
            return
        with self._cond:
            self._local_settled = False
            self._since_offer += 1
            if not force and self._since_offer < self.options.every:
                return
            self._since_offer = 0
            if self._offered is not None:
                self.skipped.append(self._offered)
                log.info(
                    "%s: step %d skipped: step %d committed while a drain ran",
                    self.url,
                    self._offered,
                    step,
                )
            self._offered = step
            self._cond.notify_all()

    def settle(self) -> None:
        """The manager waited for its local save: a step not committed by now never will be."""
        with self._cond:
            self._local_settled = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._offered is None and not self._closed:
                    self._cond.wait()
                if self._offered is None:
                    return
                step, self._offered, self._draining = self._offered, None, self._offered
            try:
                if self._wait_for_local_commit(step):
                    self._drain(step)
                    self._collect_after_drain()
            except Exception as e:  # any failure is this step's: reported, training goes on
                error = DurableTierError(
                    f"drain of step {step} to {self.root / str(step)} failed: {e}"
                )
                error.__cause__ = e
                log.error("%s", error)
                with self._cond:
                    self._errors.append(error)
            finally:
                with self._cond:
                    self._draining = None
                    self._cond.notify_all()

    def _local_step(self, step: int) -> Path:
        return self.options.local / self.options.step_name(step)

    def _wait_for_local_commit(self, step: int) -> bool:
        """Waits until Orbax renamed the step into place (its manifest is then there)."""
        manifest = self._local_step(step) / STATE_ITEM / storage.MANIFEST_NAME
        while not manifest.exists():
            with self._cond:
                if self._local_settled and not manifest.exists():
                    log.info("%s: step %d never committed locally: not drained", self.url, step)
                    return False
                self._cond.wait(_POLL_S)
        return True

    def _drain(self, step: int) -> None:
        start = self.options.clock()
        source = self._local_step(step)
        dest = self.root / str(step)
        if dest.list():  # an earlier, interrupted drain: never committed, so start afresh
            dest.delete_all()
        others = {}
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(source)
            if rel.parts[0] == STATE_ITEM and (
                rel.parts[1].startswith(storage.STRIPE_PREFIX) or rel.name.startswith(_STATE_OWN)
            ):
                continue  # the state's pieces and manifest: copy_item's, manifest last
            others[rel.as_posix()] = path.read_bytes()
        dest.write_many(others)
        files = [{"path": k, "size": len(v), "xxh3_64": _digest(v)} for k, v in others.items()]
        copied = storage.copy_item(
            source / STATE_ITEM,
            dest / STATE_ITEM,
            source_options=self.options.source_options,
            dest_options=self.options.store_options,
            memory_bytes=self.options.memory_bytes,
            commit=False,
            buffers=self._buffers,
        )
        record = {"format": _STEP_FORMAT, "version": 1, "step": step, "files": files}
        (dest / STEP_FILES).write_bytes(json.dumps(record).encode())
        # The commit: the state manifest, after every other object of the step is there.
        manifest = storage.read_manifest(source / STATE_ITEM).in_item_dir()
        storage.write_manifest(dest / STATE_ITEM, manifest)
        elapsed = self.options.clock() - start
        with self._cond:
            if self._steps is not None:
                self._steps.add(step)
            self.drain_s = elapsed
        log.info(
            "%s: step %d drained (%.1f MiB of pieces, %d other files) in %.2f s",
            self.url,
            step,
            copied.bytes / 2**20,
            len(files),
            elapsed,
        )

    def wait(self, *, raise_errors: bool) -> None:
        """Blocks until no step waits or drains; then raises the first drain error, if asked
        (otherwise the errors are kept for the next call that asks).

        Raises:
          DurableTierError: a drain failed since the errors were last raised (the others are
            in its notes).
        """
        with self._cond:
            while self._offered is not None or self._draining is not None:
                self._cond.wait()
            if not raise_errors:
                return
            errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"also: {other}")
            raise first

    def close(self) -> None:
        """Finishes the drain in progress and the waiting one, then stops the thread."""
        if self._thread is None:
            return
        self.settle()
        self.wait(raise_errors=False)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._thread = None
        self._buffers.clear()

    # -- garbage collection and deletion ------------------------------------------------------

    def _collect_after_drain(self) -> None:
        # A failed collection is not the drained step's failure: said, and tried again later.
        try:
            self.collect_garbage()
        except (ValueError, OSError) as e:
            log.warning("%s: garbage collection failed (%s); will try again", self.url, e)

    def collect_garbage(self) -> None:
        """Deletes committed steps beyond ``max_to_keep`` (never the newest) and the prefixes of
        drains that never committed (except the one in progress)."""
        if not self.options.writer:
            return
        committed, incomplete = scan(self.root)
        with self._cond:
            busy = {self._draining, self._offered}
            self._steps = set(committed)
        for step in incomplete:
            if step not in busy:
                log.info(
                    "%s: removing step %d, never committed (an interrupted drain)", self.url, step
                )
                (self.root / str(step)).delete_all()
        if self.options.max_to_keep is not None:
            for step in committed[: -max(self.options.max_to_keep, 1)]:
                self.delete(step)

    def delete(self, step: int) -> None:
        """Deletes a durable step: its manifest first, so it is never listed without its data."""
        prefix = self.root / str(step)
        (prefix / STATE_ITEM / storage.MANIFEST_NAME).delete()
        with self._cond:
            if self._steps is not None:
                self._steps.discard(step)
        prefix.delete_all()

    # -- restoring --------------------------------------------------------------------------

    def restore(self, step: int, items: dict[str, Any]) -> Any:
        """Orbax's restore of ``items`` (a ``Composite``'s args) from the durable copy of ``step``.

        The step's files other than pieces are downloaded into a temporary directory (and
        checked); the state's pieces are read from the durable tier.
        """
        with tempfile.TemporaryDirectory(prefix="cocijax-durable-") as tmp:
            local, pieces = self.stage(step, Path(tmp))
            if STATE_ITEM in items:
                state = dataclasses.replace(items[STATE_ITEM], roots=[pieces])
                items = {**items, STATE_ITEM: state}
            handler = ocp.CompositeCheckpointHandler(handler_registry=self._registry())
            with ocp.Checkpointer(handler) as checkpointer:
                return checkpointer.restore(local, args=ocp.args.Composite(**items))

    def _registry(self) -> ocp.handlers.CheckpointHandlerRegistry:
        # Pieces on the durable tier are read with its options; the policy item as locally.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        state = storage.StripedCheckpointHandler(root_options=self.options.store_options)
        registry.add(STATE_ITEM, storage.StripedRestore, state)
        registry.add(POLICY_ITEM, PolicyStateRestore, PolicyStateHandler())
        return registry

    def stage(self, step: int, into: Path) -> tuple[Path, storage.KvPath]:
        """Downloads a durable step's files other than pieces into ``into``; checks them.

        Orbax's handlers read items from local files; the state's pieces stay where they are
        and are read from the durable tier by TensorStore (``StripedRestore(roots=...)``), only
        those the restore needs.

        Returns:
          The local step directory, and the durable state item (where the pieces are).

        Raises:
          FileNotFoundError: the step is not committed on the durable tier.
          CorruptCheckpointError: a file is missing or differs from the step's record.
        """
        prefix = self.root / str(step)
        local = into / str(step)
        manifest = (prefix / STATE_ITEM / storage.MANIFEST_NAME).read_bytes()
        if manifest is None:
            raise FileNotFoundError(f"step {step} is not committed on the durable tier {self.url}.")
        shutil.rmtree(local, ignore_errors=True)
        for path, data, problem in step_files(prefix):
            if problem is not None:
                raise storage.CorruptCheckpointError(problem.message)
            target = local / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (local / STATE_ITEM).mkdir(parents=True, exist_ok=True)
        (local / STATE_ITEM / storage.MANIFEST_NAME).write_bytes(manifest)
        return local, prefix / STATE_ITEM


def _digest(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def scan(root: storage.KvPath) -> tuple[list[int], list[int]]:
    """A durable tier's committed steps, and its step prefixes without a manifest (drains that
    never committed), both sorted, from one listing.

    Raises:
      ValueError, OSError: the tier cannot be listed (TensorStore's error, naming it).
    """
    seen: set[int] = set()
    committed: set[int] = set()
    manifest = f"{STATE_ITEM}/{storage.MANIFEST_NAME}"
    for key in root.list():
        head, _, rest = key.partition("/")
        if STEP_RE.match(head):
            seen.add(int(head))
            if rest == manifest:
                committed.add(int(head))
    return sorted(committed), sorted(seen - committed)


def step_files(prefix: storage.KvPath) -> list[tuple[str, bytes | None, storage.Problem | None]]:
    """Each file a durable step records besides its pieces: ``(path, data, problem)``.

    ``problem`` is ``None`` when the file has the size and xxh3_64 its record says (a missing
    or unreadable record is one problem).
    """
    record_path = prefix / STEP_FILES
    try:
        files = json.loads(record_path.read_text())["files"]
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        return [(STEP_FILES, None, storage.Problem("", str(record_path), f"{record_path}: {e}"))]
    out = []
    datas = prefix.read_many([entry["path"] for entry in files])
    for entry in files:
        where = prefix / entry["path"]
        data = datas[entry["path"]]
        problem = None
        if data is None or len(data) != entry["size"] or _digest(data) != entry["xxh3_64"]:
            found = "missing" if data is None else f"{len(data)} bytes, xxh3_64 {_digest(data)}"
            problem = storage.Problem(
                "",
                str(where),
                f"{where}: expected {entry['size']} bytes with xxh3_64 {entry['xxh3_64']}, "
                f"found {found}.",
            )
        out.append((entry["path"], data, problem))
    return out


def verify_durable_step(
    root: storage.KvPath, step: int, *, root_options: Mapping[str, Any] | None = None
) -> list[storage.Problem]:
    """Every problem of a committed durable step: its pieces (``storage.verify``) and its other
    files (sizes and xxh3_64 against its record)."""
    prefix = root / str(step)
    problems = [p for _, _, p in step_files(prefix) if p is not None]
    return problems + storage.verify(prefix / STATE_ITEM, root_options=root_options)


class _Pinned:
    """An Orbax preservation policy that keeps the steps the drain still needs."""

    def __init__(self, pinned: Callable[[], set[int]]):
        self._pinned = pinned

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> Sequence[bool]:
        del context
        pinned = self._pinned()
        return [info.step in pinned for info in checkpoints]


def pin_steps(
    options: ocp.CheckpointManagerOptions, pinned: Callable[[], set[int]]
) -> ocp.CheckpointManagerOptions:
    """Orbax options whose retention also keeps the ``pinned()`` steps (until unpinned).

    ``max_to_keep``, ``keep_period`` and ``keep_time_interval`` become the preservation policy
    Orbax would build from them, combined with one that keeps the pinned steps.
    """
    base = options.preservation_policy
    if base is None:
        parts: list[Any] = [ocp.checkpoint_managers.LatestN(n=options.max_to_keep)]
        if options.keep_period is not None:
            parts.append(ocp.checkpoint_managers.EveryNSteps(options.keep_period))
        if options.keep_time_interval is not None:
            seconds = int(options.keep_time_interval.total_seconds())
            parts.append(ocp.checkpoint_managers.EveryNSeconds(interval_secs=seconds))
        base = ocp.checkpoint_managers.AnyPreservationPolicy(parts)
    return dataclasses.replace(
        options,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy([base, _Pinned(pinned)]),
        max_to_keep=None,
        keep_period=None,
        keep_time_interval=None,
    )


def manager_root(
    root: str | os.PathLike, options: Mapping[str, Any] | None
) -> Path | storage.KvPath:
    """A manager's root: an absolute local path, or an object-store prefix (``s3://...``)."""
    if storage.is_url(root):
        where = storage.KvPath.parse(root, options)
        return Path(where.key) if where.is_local else where
    return Path(root).absolute()


def open_durable(
    durable: str | os.PathLike | None,
    options: Mapping[str, Any] | None,
    *,
    every: int,
    max_to_keep: int | None,
    **kwargs: Any,
) -> DurableTier | None:
    """The durable tier of a manager (``None`` without one), its arguments checked.

    Args:
      durable: the manager's ``durable``; ``options`` its ``durable_options``, ``every`` its
        ``durable_every`` and ``max_to_keep`` its ``durable_max_to_keep``.
      **kwargs: the other :class:`DurableOptions`.

    Raises:
      TypeError: ``durable`` is not a path or URL, ``durable_every``/``durable_max_to_keep``
        not ints, ``durable_options`` not a dict.
      ValueError: ``durable_every`` < 1, ``durable_max_to_keep`` < 1, an unsupported URL
        scheme, or options TensorStore refuses; ``durable_options`` without ``durable``.
    """
    for name, value, low, none_ok in (
        ("durable_every", every, 1, False),
        ("durable_max_to_keep", max_to_keep, 1, True),
    ):
        if value is None and none_ok:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {value!r}.")
        if value < low:
            raise ValueError(
                f"{name}: must be >= {low}, got {value}"
                + ("; the durable tier always keeps its newest step." if none_ok else ".")
            )
    if durable is None:
        if options:
            raise ValueError("durable_options: given without durable=; pass the durable URL.")
        return None
    if not isinstance(durable, str | os.PathLike):
        raise TypeError(
            f"durable: expected a path or an object-store URL (s3://bucket/prefix), got "
            f"{type(durable).__name__}."
        )
    tier = DurableOptions(store_options=options, every=every, max_to_keep=max_to_keep, **kwargs)
    try:
        return DurableTier(durable, tier)
    except (TypeError, ValueError) as e:
        raise type(e)(f"durable={str(durable)!r}: {e}") from e
