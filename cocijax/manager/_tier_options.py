"""What the durable tier is opened with, its error, and how the manager's local retention keeps
the steps a drain still needs (:func:`pin_steps`)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from cocijax import storage
from cocijax.manager._tier_lease import owner_id
from cocijax.storage._kvpath import is_url
from cocijax.storage._options import check_writable

__all__ = [
    "DurableOptions",
    "DurableTierError",
    "check_durable_args",
    "check_roots_writable",
    "check_timeout",
    "manager_root",
    "pin_steps",
]


class DurableTierError(RuntimeError):
    """The durable tier failed: a step could not be drained, or the tier cannot be listed
    (names the step, the URL and what to do)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DurableOptions:
    """What a :class:`~cocijax.manager._tiers.DurableTier` is opened with: fixed for its life,
    so that the drain thread reads them without the lock that guards the tier's changing state.

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
      timeout_s: the longest any single wait for the store may take (``None``: no bound but
        TensorStore's retries): each request of the tier's own, the listing at opening, and
        a wait for a drain that makes no progress (``close``, ``wait``).
      owner: this writer's name in the lease and in each step it drains.
      lease_s: the lease's duration (``None``: four times ``timeout_s``, at least 60 s).
      lease_wait_s: how long a drain waits for another writer's lease (``None``: one lease
        duration and one ``timeout_s``).
      attempts: tries of one drain when the store fails in a way that may pass.
      backoff_s: the wait before the second try; doubled before each further one.
      process: host-local (``CheckpointManager(host_local=True)`` with several processes):
        this process's index. Each process drains its own shards and writes its manifest
        part; process 0 commits the step once every part is there, and alone holds the
        lease and deletes. ``None``: one writer drains whole steps.
      processes: how many processes drain parts (host-local).
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
    timeout_s: float | None = 30.0
    owner: str = dataclasses.field(default_factory=owner_id)
    lease_s: float | None = None
    lease_wait_s: float | None = None
    attempts: int = 3
    backoff_s: float = 1.0
    process: int | None = None
    processes: int = 1

    @property
    def committer(self) -> bool:
        """This writer commits steps, holds the lease and deletes (process 0 if host-local)."""
        return self.writer and self.process in (None, 0)

    @property
    def lease_duration_s(self) -> float:
        if self.lease_s is not None:
            return self.lease_s
        return max(60.0, 4 * (self.timeout_s or 60.0))

    @property
    def lease_wait_bound_s(self) -> float:
        if self.lease_wait_s is not None:
            return self.lease_wait_s
        return self.lease_duration_s + (self.timeout_s or 60.0)


def check_timeout(value: Any, name: str = "store_timeout_s") -> float:
    """A deadline in seconds: a positive, finite number.

    Raises:
      TypeError: not a number.
      ValueError: not positive and finite.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a number of seconds, got {value!r}.")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}: must be a positive, finite number of seconds, got {value}.")
    return float(value)


def check_durable_args(
    durable: Any, options: Any, every: Any, max_to_keep: Any, timeout_s: Any
) -> float:
    """Checks the manager's ``durable*`` and ``store_timeout_s`` arguments; the timeout.

    Raises:
      TypeError: ``durable`` is not a path or URL, ``durable_every``/``durable_max_to_keep``
        not ints, ``store_timeout_s`` not a number.
      ValueError: ``durable_every`` < 1, ``durable_max_to_keep`` < 1, ``store_timeout_s`` not
        positive, ``durable_options`` without ``durable``.
    """
    timeout_s = check_timeout(timeout_s)
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
    if durable is None and options:
        raise ValueError("durable_options: given without durable=; pass the durable URL.")
    if durable is not None and not isinstance(durable, str | os.PathLike):
        raise TypeError(
            f"durable: expected a path or an object-store URL (s3://bucket/prefix), got "
            f"{type(durable).__name__}."
        )
    return timeout_s


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
    root: str | os.PathLike, options: Mapping[str, Any] | None, *, timeout_s: float | None = None
) -> Path | storage.KvPath:
    """A manager's root: an absolute local path, or an object-store prefix (``s3://...``) whose
    requests wait at most ``timeout_s`` each."""
    if is_url(root):
        where = storage.KvPath.parse(root, options)
        return Path(where.key) if where.is_local else where.with_timeout(timeout_s)
    return Path(root).absolute()


def check_roots_writable(roots: Sequence[Path | storage.KvPath], timeout_s: float | None) -> None:
    """Raises unless each root can be written (an object store within ``timeout_s``).

    Raises:
      ValueError: naming ``roots[i]``, its path or URL and the cause (read-only, unreachable,
        no bucket, no credentials, no answer in time).
    """
    for i, root in enumerate(roots):
        check_writable(root, f"roots[{i}]", timeout_s)
