"""Restoring from the durable tier: a step's small files downloaded and checked, its pieces
read where they are."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from cocijax import storage
from cocijax.manager._directory import POLICY_ITEM, STATE_ITEM
from cocijax.manager._policy_item import PolicyStateHandler, PolicyStateRestore
from cocijax.manager._tier_layout import COMMIT_KEY, step_files
from cocijax.storage._records import MANIFEST_NAME

__all__ = ["restore_staged", "restore_step", "stage"]


def restore_step(
    root: storage.KvPath,
    step: int,
    items: dict[str, Any],
    store_options: Mapping[str, Any] | None,
    *,
    process: int | None = None,
) -> Any:
    """Orbax's restore of ``items`` (a ``Composite``'s args) from the durable copy of ``step``.

    The step's files other than pieces are downloaded into a temporary directory (and
    checked), removed whatever happens (an interrupt included); the state's pieces are read
    from the durable tier with ``store_options``. With ``process`` (host-local) this process
    restores alone, with no barrier across processes: the others may restore their own copies.

    Raises:
      FileNotFoundError: the step is not committed on the durable tier.
      CorruptCheckpointError: the record is malformed, or a file is missing or differs from it
        (names the step and the object's URL); or a piece is damaged.
    """
    tmp = tempfile.mkdtemp(prefix="cocijax-durable-")
    try:
        local, pieces = stage(root, step, Path(tmp))
        if STATE_ITEM in items:
            state = dataclasses.replace(items[STATE_ITEM], roots=[pieces])
            items = {**items, STATE_ITEM: state}
        return restore_staged(local, items, store_options, process=process)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def restore_staged(
    local: Path,
    items: dict[str, Any],
    store_options: Mapping[str, Any] | None,
    *,
    process: int | None = None,
) -> Any:
    """Orbax's restore of ``items`` from the staged step directory ``local`` (its pieces read
    where its manifest, or ``items``' roots, say, with ``store_options``); with ``process``
    this process restores alone, with no barrier across processes."""
    handler = ocp.CompositeCheckpointHandler(handler_registry=_registry(store_options))
    alone = ocp.options.MultiprocessingOptions()
    if process is not None:
        alone = ocp.options.MultiprocessingOptions(
            primary_host=None,
            active_processes={process},
            barrier_sync_key_prefix=f"cocijax-durable-{process}",
        )
    with ocp.Checkpointer(handler, multiprocessing_options=alone) as checkpointer:
        return checkpointer.restore(local, args=ocp.args.Composite(**items))


def _registry(store_options: Mapping[str, Any] | None) -> ocp.handlers.CheckpointHandlerRegistry:
    # Pieces on the durable tier are read with its options; the policy item as locally.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = storage.StripedCheckpointHandler(root_options=store_options)
    registry.add(STATE_ITEM, storage.StripedRestore, state)
    registry.add(POLICY_ITEM, PolicyStateRestore, PolicyStateHandler())
    return registry


def stage(root: storage.KvPath, step: int, into: Path) -> tuple[Path, storage.KvPath]:
    """Downloads a durable step's files other than pieces into ``into``; checks them.

    Orbax's handlers read items from local files; the state's pieces stay where they are and
    are read from the durable tier by TensorStore (``StripedRestore(roots=...)``), only those
    the restore needs.

    Returns:
      The local step directory, and the durable state item (where the pieces are).

    Raises:
      FileNotFoundError: the step is not committed on the durable tier.
      CorruptCheckpointError: the record is malformed, or a file is missing or differs from it.
    """
    prefix = root / str(step)
    local = into / str(step)
    manifest = (prefix / COMMIT_KEY).read_bytes()
    if manifest is None:
        raise FileNotFoundError(f"step {step} is not committed on the durable tier {root.url}.")
    shutil.rmtree(local, ignore_errors=True)
    for path, data, problem in step_files(prefix, step):
        if problem is not None:
            raise storage.CorruptCheckpointError(problem.message)
        target = local / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (local / STATE_ITEM).mkdir(parents=True, exist_ok=True)
    (local / STATE_ITEM / MANIFEST_NAME).write_bytes(manifest)
    return local, prefix / STATE_ITEM
