"""One drain: a committed local step copied to the durable tier, its manifest written last.

Only what an object store promises is assumed: a PUT makes one whole object appear. So a step is
committed on the durable tier when its state manifest exists, and that object is written after
every other object of the step (the step's record last but one), and only while this writer
holds the tier's lease. A drain never replaces a step another writer committed there, and a
failed drain removes what it wrote at once.

Host-local processes (``DurableOptions.process`` set) each copy their own pieces and write their
manifest part (``cocijax_manifest.part-<process>.json``); process 0 also copies the step's other
files, waits for every part and commits the manifest merged from them (``_parts.merge``). A
part is named by the job's run (:func:`part_name`), so an earlier run's part of the same step
number (its process 0 killed before the commit) is never merged into this run's step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cocijax import storage
from cocijax.manager._directory import STATE_ITEM
from cocijax.manager._tier_layout import COMMIT_KEY, STEP_FILES, make_record, read_record
from cocijax.manager._tier_lease import LeaseError
from cocijax.manager._tier_options import DurableTierError
from cocijax.storage import _codec, _parts
from cocijax.storage._kvpath import describe_error, is_transient
from cocijax.storage._manifest_io import write_manifest
from cocijax.storage._records import MANIFEST_NAME, STRIPE_PREFIX

if TYPE_CHECKING:
    from cocijax.manager._tiers import DurableTier

__all__ = ["AlreadyCommitted", "clean_failed", "drain_step", "drain_with_retries", "part_name"]

log = logging.getLogger(__name__)

# Local files that are the state item's own commit record or data: copied by copy_item.
_STATE_OWN = (MANIFEST_NAME, _parts.PART_PREFIX)
# How often process 0 lists the parts of a host-local step that the others still drain.
_PARTS_POLL_S = 0.05


class AlreadyCommitted(Exception):
    """The step is committed on the durable tier already (by another writer): not replaced."""


def drain_with_retries(tier: DurableTier, step: int) -> None:
    """Drains ``step`` (the committer first takes the tier's lease, waiting up to
    ``lease_wait_bound_s``), trying again with backoff after failures that may pass.

    Raises:
      LeaseError: the lease is held by another writer past the bound, or was lost.
      Exception: the last attempt's failure, or the first one that will not pass.
    """
    if tier.options.committer:

        def waiting(holder: str) -> None:
            log.warning(
                "%s: step %d waits (up to %g s) for the durable tier's lease, held by %s",
                tier.url,
                step,
                tier.options.lease_wait_bound_s,
                holder,
            )

        tier._lease.acquire(tier.options.lease_wait_bound_s, waiting=waiting)
        tier._touch()
    delay = tier.options.backoff_s
    for attempt in range(1, tier.options.attempts + 1):
        try:
            drain_step(tier, step)
            return
        except AlreadyCommitted:
            return
        except Exception as e:
            clean_failed(tier, step)
            last = attempt == tier.options.attempts or tier._abandoned
            if last or not is_transient(e) or isinstance(e, LeaseError):
                raise
            log.warning(
                "%s: drain of step %d failed (attempt %d of %d: %s); trying again in %g s",
                tier.url,
                step,
                attempt,
                tier.options.attempts,
                describe_error(e),
                delay,
            )
        time.sleep(delay)  # not progress: close() may give up on the drain meanwhile
        delay *= 2


def drain_step(tier: DurableTier, step: int) -> None:
    """Copies the committed local ``step`` to the durable tier, its manifest last (the commit).

    Host-local, a process other than 0 copies its pieces and its manifest part only; process 0
    commits once every part is there.

    Raises:
      AlreadyCommitted: another writer committed the step there already (not replaced).
      DurableTierError: abandoned by ``close()``, the lease was lost, or (host-local) another
        process's part did not come in time (nothing committed).
    """
    start = tier.options.clock()
    source = tier._local_step(step)
    dest = tier.root / str(step)
    if (dest / COMMIT_KEY).read_bytes() is not None:
        _skip_committed(tier, step, dest)
    host = tier.options.process
    manifest = storage.read_manifest(source / STATE_ITEM).in_item_dir()
    if host is None and manifest.holder is not None:
        # A job of one writer (e.g. one process) opened a host-local job's folder: its copy
        # holds process ``holder``'s shards only, and a durable step must hold every region.
        log.warning(
            "%s: step %d not drained: %s is process %d's host-local copy (its shards only); "
            "the durable tier takes whole steps (a host-local job drains every process's)",
            tier.url,
            step,
            source,
            manifest.holder,
        )
        return
    if host is None and dest.list():  # an interrupted drain's objects, never committed
        dest.delete_all()  # (host-local: other processes' parts are there: left alone)
    # The step's other files (the policy's state, Orbax's): process 0's copy, host-local.
    others = _other_files(source) if host in (None, 0) else {}
    dest.write_many(others)
    tier._touch()
    copied = storage.copy_item(
        source / STATE_ITEM,
        dest / STATE_ITEM,
        source_options=tier.options.source_options,
        dest_options=tier.options.store_options,
        memory_bytes=tier.options.memory_bytes,
        commit=False,
        buffers=tier._buffers,
        progress=tier._touch,
    )
    if host is not None:
        # Host-local: this process's part; process 0 commits once every part is there.
        (dest / STATE_ITEM / part_name(host, tier.run)).write_bytes(
            _codec.encode_part(manifest, str(dest / STATE_ITEM))
        )
        tier._touch()
        if host != 0:
            log.info("%s: process %d's shards of step %d drained", tier.url, host, step)
            return
        manifest = _merged_parts(tier, step, dest / STATE_ITEM)
    # The commit: the record, then the state manifest, after every other object is there,
    # and only while this writer holds the lease for longer than the two writes can take.
    if tier._abandoned:
        raise DurableTierError("abandoned by close(): not committed")
    tier._lease.check(margin_s=tier.options.lease_duration_s / 2)
    (dest / STEP_FILES).write_bytes(make_record(step, others, tier.options.owner))
    write_manifest(dest / STATE_ITEM, manifest)
    elapsed = tier.options.clock() - start
    with tier._cond:
        tier._steps.add(step)
        tier.drain_s = elapsed
    log.info(
        "%s: step %d drained (%.1f MiB of pieces, %d other files) in %.2f s",
        tier.url,
        step,
        copied.bytes / 2**20,
        len(others),
        elapsed,
    )


def part_name(process: int, run: str) -> str:
    """The name of ``process``'s manifest part of a step drained in the job's ``run``.

    Named by the run: a step number saved again after a restart (the job resumed before it)
    may find an earlier run's part of another process still on the tier, which holds that
    run's shards, not this one's; process 0 must wait for this run's part instead.
    """
    return f"{_parts.PART_PREFIX}{process}-{run}.json"


def _other_files(source: Path) -> dict[str, bytes]:
    """The files of the local step ``source`` besides the state's pieces and manifest (which
    ``copy_item`` copies, the manifest last), by path relative to it."""
    others = {}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = path.relative_to(source)
        if rel.parts[0] == STATE_ITEM and (
            rel.parts[1].startswith(STRIPE_PREFIX) or rel.name.startswith(_STATE_OWN)
        ):
            continue
        others[rel.as_posix()] = path.read_bytes()
    return others


def _merged_parts(tier: DurableTier, step: int, state: storage.KvPath) -> storage.Manifest:
    """The manifest of ``step`` merged from every process's part, once all are on the tier.

    Waits for the parts (the other processes drain their own shards) up to half of
    ``timeout_s`` without a new one, so that this error, naming the processes, comes before
    ``wait``/``close`` would call the drain stalled (after ``timeout_s`` without progress).

    Raises:
      DurableTierError: some process's part did not come in time (names the processes), or
        the drain was abandoned.
    """
    processes = tier.options.processes
    names = {q: part_name(q, tier.run) for q in range(processes)}
    timeout = (tier.options.timeout_s or 60.0) / 2
    have: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout
    while len(have) < processes:
        for q in [q for q in names if q not in have]:
            data = (state / names[q]).read_bytes()
            if data is not None:
                have[q] = data
                deadline = time.monotonic() + timeout  # progress: another process's part
                tier._touch()
        if len(have) == processes:
            break
        if tier._abandoned or time.monotonic() > deadline:
            missing = sorted(set(names) - set(have))
            raise DurableTierError(
                f"step {step}: the shards of process(es) {missing} did not reach "
                f"{state.url} within {timeout:g} s (half of store_timeout_s) of the last part: not "
                "committed on the durable tier (every process's own tier still holds its "
                "shards); see those processes' logs for their drain's error."
            )
        time.sleep(_PARTS_POLL_S)
    return _parts.merge(
        [(str(state / names[q]), _codec.decode_manifest(have[q], str(state / names[q])))
         for q in range(processes)]
    )  # fmt: skip


def _skip_committed(tier: DurableTier, step: int, dest: storage.KvPath) -> None:
    try:
        owner = read_record(dest, step).owner
    except (storage.CorruptCheckpointError, ValueError, OSError) as e:
        owner = f"unknown ({e})"
    log.error(
        "%s: step %d is committed on the durable tier already, drained by %s: not replaced "
        "(this writer's step %d stays on the local tier only)",
        dest.url,
        step,
        owner,
        step,
    )
    with tier._cond:
        tier._steps.add(step)
    raise AlreadyCommitted(step)


def clean_failed(tier: DurableTier, step: int) -> None:
    """Removes what a failed drain of ``step`` wrote, if the step is not committed and this
    writer still holds the lease (another writer's objects are never touched)."""
    prefix = tier.root / str(step)
    try:
        if tier._lease.held and (prefix / COMMIT_KEY).read_bytes() is None:
            prefix.delete_all()
            log.info("%s: removed the uncommitted objects of step %d", tier.url, step)
    except (ValueError, OSError) as e:  # left for the next garbage collection
        log.warning("%s: cannot remove what the drain of step %d left (%s)", tier.url, step, e)
