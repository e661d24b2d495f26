"""Restoring a step from the local folders of several processes (host-local, another topology).

Host-local, each process's copy of a step holds its own shards only (``Manifest.holder``). A job
restarted on another topology (4 processes -> 2, other devices) needs regions that other
processes saved. Where their folders can be reached from this process (the same machine, a
shared file system), the step is restored from them: every process's copy of the step is found,
the copies' manifests are merged into one of the whole tree (``storage._parts.merge``, as the
durable commit does) and the pieces are read where they are, their checksums checked as they
are read. When the copies found do not hold every region, the step's next copy (the durable
tier's) is tried, as for a process's own copy.

Where the folders are: each process of a host-local job with a durable tier records the path
of its folder there when it opens (``<durable>/cocijax-folders/<digest of the path>.json``).
A reader looks for the step in its own folder and in every recorded one, at the recorded path
(the folders of a job on one machine, or on a file system every process mounts at the same
path); a folder that is gone or holds no copy of the step is passed over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import xxhash

from cocijax import storage
from cocijax.manager._directory import STATE_ITEM
from cocijax.manager._tier_read import restore_staged
from cocijax.storage._manifest_io import read_manifest_file, write_manifest
from cocijax.storage._parts import PART_PREFIX, merge
from cocijax.storage._records import MANIFEST_NAME, STRIPE_PREFIX, Manifest

if TYPE_CHECKING:
    from cocijax.manager._checkpoint_manager import CheckpointManager

__all__ = ["FOLDERS", "is_host_local", "record_folder", "restore_from_folders"]

log = logging.getLogger(__name__)

FOLDERS = "cocijax-folders"
"""The durable tier's prefix where each host-local process records the path of its folder."""


def record_folder(mngr: CheckpointManager) -> None:
    """Records ``mngr``'s folder in its durable tier, for a job on another topology to find it.

    Written once per folder (its key is a digest of the path; read first, written only if it
    differs). A failure is logged, not raised: the record serves later restores only, and the
    durable copy serves them without it.
    """
    path = str(mngr._directory.absolute())
    key = mngr._durable.root / FOLDERS / f"{xxhash.xxh3_64_hexdigest(path.encode())}.json"
    record = json.dumps({"directory": path}).encode()
    try:
        if key.read_bytes() != record:
            key.write_bytes(record)
    except (ValueError, OSError) as e:
        log.warning("%s: cannot record this process's folder in %s (%s)", path, key.url, e)


def is_host_local(item_dir: Path) -> bool:
    """Whether the item at ``item_dir`` is a host-local copy (holds one process's shards)."""
    try:
        return read_manifest_file(item_dir / MANIFEST_NAME).holder is not None
    except (storage.CheckpointFormatError, OSError):
        return False  # its restore says what is wrong with it


def _folders(mngr: CheckpointManager) -> list[Path]:
    """This process's folder, then every folder recorded in the durable tier (unique)."""
    found = [mngr._directory.absolute()]
    if mngr._durable is not None:
        prefix = mngr._durable.root / FOLDERS
        try:
            records = prefix.read_many(prefix.list()).values()
        except (ValueError, OSError) as e:
            log.info("restore: cannot list the recorded folders in %s (%s)", prefix.url, e)
            records = []
        for data in records:
            try:
                folder = Path(json.loads(data)["directory"])
            except (TypeError, ValueError, KeyError):
                continue  # not a record of ours: the folders it would name are not needed
            if folder not in found:
                found.append(folder)
    return found


def _copies(mngr: CheckpointManager, step: int, folders: list[Path]) -> list[tuple[Path, Manifest]]:
    """Every host-local copy of ``step`` in ``folders``: its step directory and manifest (roots
    made absolute), one per holder, of the same save as this process's own copy."""
    name = mngr._name_format.build_name(step)
    found: list[tuple[Path, Manifest]] = []
    for folder in folders:
        step_dir = folder / name
        try:
            manifest = read_manifest_file(step_dir / STATE_ITEM / MANIFEST_NAME)
        except (storage.CheckpointFormatError, OSError):
            continue  # no committed copy there (gone, never saved, another format)
        if manifest.holder is None:
            continue  # a whole copy is a copy of its own (the local or durable one)
        # A root ``None`` is the item directory of that copy, not of the merged one.
        item = str(step_dir / STATE_ITEM)
        roots = tuple(item if r is None else r for r in manifest.roots)
        found.append((step_dir, dataclasses.replace(manifest, roots=roots)))
    # The copies of one save describe the same tree, saved with the same shardings; another
    # save of that step number (an older job's, in a folder this job no longer opens) does not
    # mix in. The save of this process's own copy wins, else the one most processes hold.
    saves: dict[str, list[tuple[Path, Manifest]]] = {}
    for copy in found:
        saves.setdefault(_save_key(copy[1]), []).append(copy)
    if not saves:
        return []
    own = [m for d, m in found if d.parent == mngr._directory.absolute()]
    chosen = saves[_save_key(own[0])] if own else max(saves.values(), key=len)
    by_holder: dict[int, tuple[Path, Manifest]] = {}
    for step_dir, manifest in chosen:
        by_holder.setdefault(manifest.holder, (step_dir, manifest))
    return [by_holder[h] for h in sorted(by_holder)]


def _save_key(manifest: Manifest) -> str:
    leaves = [(x.path, x.dtype, list(x.shape), x.sharding) for x in manifest.leaves]
    return json.dumps(leaves, sort_keys=True)


def restore_from_folders(mngr: CheckpointManager, step: int, items: dict[str, Any]) -> Any:
    """Orbax's restore of ``items`` from every process's local copy of ``step`` (see above).

    The step's files other than pieces are taken from this process's own copy (else the
    lowest holder's) into a temporary directory with the merged manifest; the pieces are read
    where the copies' manifests say. This process restores alone (no barrier).

    Raises:
      RegionNotHeldError: the copies found do not hold every region of the step (names the
        processes whose copies were found and the folders searched).
      CorruptCheckpointError: a piece is missing or damaged.
    """
    folders = _folders(mngr)
    copies = _copies(mngr, step, folders)
    tmp = Path(tempfile.mkdtemp(prefix="cocijax-folders-"))
    try:
        try:  # writing the merged manifest checks that it holds every region of every leaf
            if not copies:
                raise storage.CheckpointFormatError("no host-local copy found")
            merged = merge([(str(d / STATE_ITEM), m) for d, m in copies])
            mine = [d for d, m in copies if m.holder == jax.process_index()]
            local = tmp / copies[0][0].name
            shutil.copytree((mine or [copies[0][0]])[0], local, ignore=_not_copied)
            write_manifest(local / STATE_ITEM, merged)
        except storage.CheckpointFormatError as e:
            held = [m.holder for _, m in copies]
            raise storage.RegionNotHeldError(
                f"step {step}: the local copies found hold the shards of process(es) {held} "
                f"only, not every region (searched {[str(f) for f in folders]}); a "
                "copy of another process is read where its folder is reachable at the path "
                "it was saved at (the same machine or a shared file system)."
            ) from e
        log.info(
            "restore: step %d from the local copies of process(es) %s (%s)",
            step,
            [m.holder for _, m in copies],
            ", ".join(str(d) for d, _ in copies),
        )
        options = mngr._durable.options.source_options if mngr._durable is not None else None
        return restore_staged(local, items, options, process=jax.process_index())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _not_copied(directory: str, names: list[str]) -> list[str]:
    """What the staged step directory leaves out: the pieces and the copy's own manifest."""
    if Path(directory).name != STATE_ITEM:
        return []
    return [n for n in names if n.startswith((STRIPE_PREFIX, PART_PREFIX)) or n == MANIFEST_NAME]
