"""The memory tier of ``cocijax.torch.CheckpointManager``: each save lands on tmpfs first.

A folder on a tmpfs (``/dev/shm``) outlives the training process, not the machine: a save there
costs a memory copy, and a restart after a process failure (SIGKILL, an OOM kill, a crash)
restores at memory speed. The rules shared with the JAX manager (the arguments, the folder's
lock and owner, the budget, the two slots) are :mod:`cocijax.core._memory`'s; this module keeps
the torch format.

The tier is a ``cocijax.torch`` checkpoint directory of its own (``_directory``'s layout and
atomic commit), ``<memory>/<namespace>`` with the namespace of the checkpoint directory's
identity (:mod:`cocijax.core._identity`). Its steps also record a CRC-32 of each of their files
(DCP writes none), checked before a memory copy is loaded: a corrupt copy is skipped, never
loaded into the user's modules. A save persisted to the disk is copied there from its memory
copy once that has committed, in the background (one host snapshot per save).

**Several ranks.** Each rank keeps its own state in a memory tier of its own,
``<memory>/<namespace>-rank<r>`` (ranks on one machine share its tmpfs: each its own folder,
lock and run marker), written by DCP in this process alone (``no_dist``): a one-rank DCP
checkpoint of that rank's state dict, which the rank can load without any other rank's files
(a host's memory is its own). The ranks agree on which memory steps all of them hold
(:func:`agree_steps`, at opening; ``_restoring`` at each restore): a step some rank lacks (a
rebooted host, a save cut between the ranks' commits) is not restored from memory on any rank.
A persisted save's disk copy is a collective DCP write of the same staged state into the
directory (``_saving``).
"""

from __future__ import annotations

import logging
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

from cocijax._files import fsync_dir, fsync_file
from cocijax.core._history import MARKER, read_memory_token, write_memory_marker
from cocijax.core._identity import Identity
from cocijax.core._memory import (
    MemoryOptions,
    check_budget,
    claim_folder,
)
from cocijax.core._session import run_all
from cocijax.torch._directory import (
    METADATA_NAME,
    TMP_PREFIX,
    read_metadata,
    remove,
    remove_uncommitted,
    scan_steps,
)
from cocijax.torch._ranks import Ranks

__all__ = [
    "MemoryTier",
    "agree_steps",
    "checksums",
    "copy_step",
    "mark_ranks",
    "open_tier",
    "tier_name",
    "verify",
]

log = logging.getLogger(__name__)

_CHUNK = 16 << 20


class MemoryTier:
    """A torch job's folder in memory, locked by its writer (see the module).

    Args:
      options: the checked ``memory`` arguments.
      namespace: the folder's name in the memory root (:func:`tier_name`).
      directory: the checkpoint directory, recorded as the folder's owner.
      opening: this writer's opening of the directory (``core._memory.count_opening``), and
        ``newest_on_disk`` the directory's newest step: when another writer opened the
        directory since this folder's last, the snapshots not newer than that step are
        removed (``check_owner``).

    Attributes:
      path: the job's folder.
      marker: the writer's run marker in it (see ``cocijax.core._history``).
      steps: the steps it holds, oldest first (a save in flight included).
      enabled: False once a state did not fit with ``memory=True`` (the disk only).

    Raises:
      DirectoryLockedError: another manager writes to this memory folder.
      ValueError: the folder belongs to another directory that shares this one's identity.
    """

    def __init__(
        self,
        options: MemoryOptions,
        namespace: str,
        *,
        directory: Path,
        opening: int,
        newest_on_disk: int | None,
    ):
        self.options = options
        self.path = options.root / namespace
        self.marker = self.path / MARKER
        self.enabled = True
        self._fits_checked = False
        self._lock = claim_folder(self.path, directory, opening, newest_on_disk)
        try:
            remove_uncommitted(self.path)  # a killed save's temporary directory, the trash
            _remove_torn(self.path)
            self.steps = scan_steps(self.path)
        except BaseException:
            self._lock.release()
            raise

    @property
    def fits_checked(self) -> bool:
        """Whether :meth:`check_fits` has checked the budget."""
        return self._fits_checked

    def check_fits(self, nbytes: Callable[[], int], *, stacklevel: int = 5) -> bool:
        """Whether two states of ``nbytes()`` bytes fit: checked at the first save (see
        :func:`cocijax.core._memory.check_budget`), the answer kept.

        Args:
          stacklevel: the user's save call, for the warning (default: save -> save_step ->
            _memory_target -> here -> check_budget).
        """
        if not self._fits_checked and self.enabled:
            self._fits_checked = True
            self.enabled = check_budget(self.path, self.options, nbytes(), stacklevel=stacklevel)
        return self.enabled

    def delete(self, step: int) -> None:
        """Deletes a committed step (renamed into the trash first: unlisted at once)."""
        if step in self.steps:
            self.steps.remove(step)
        remove(self.path / str(step))

    def close(self) -> None:
        """Releases the folder's lock."""
        run_all(self._lock.release)


def open_tier(
    options: MemoryOptions,
    identity: Identity,
    ranks: Ranks,
    *,
    directory: Path,
    opening: int,
    newest_on_disk: int | None,
) -> MemoryTier:
    """Every rank opens its own memory tier (:func:`tier_name`); with several ranks, they agree
    on its steps (:func:`agree_steps`). One rank's error is raised on every rank.

    Args:
      options, directory, opening, newest_on_disk: as for :class:`MemoryTier`.
      identity: the directory's identity (its namespace names the folders).
      ranks: the job's ranks.

    Raises:
      DirectoryLockedError, ValueError: as :class:`MemoryTier` (on some rank).
    """
    tiers: list[MemoryTier] = []
    name = tier_name(identity.namespace, ranks.rank, ranks.world)

    def open_own() -> None:
        tier = MemoryTier(
            options, name, directory=directory, opening=opening, newest_on_disk=newest_on_disk
        )
        tiers.append(tier)

    try:
        ranks.agree(open_own, group=ranks.control)
        if ranks.world > 1:
            agree_steps(tiers[0], ranks)
    except BaseException:
        run_all(*(tier.close for tier in tiers))  # this rank's opened, another's failed
        raise
    return tiers[0]


def tier_name(namespace: str, rank: int, world: int) -> str:
    """The name of a rank's memory folder: the directory's namespace (``Identity.namespace``),
    and with several ranks the rank's own (see the module)."""
    return namespace if world == 1 else f"{namespace}-rank{rank}"


def agree_steps(tier: MemoryTier, ranks: Ranks) -> None:
    """Several ranks, at opening: keeps the memory steps that every rank holds, saved by a job of
    this many ranks; deletes this rank's others (logged): no rank could restore them with the
    rest (a rebooted host's rank lost its copies, a job of another size wrote them)."""
    mine = [s for s in tier.steps if _saved_by(tier.path, s, ranks)]
    held = ranks.gather(mine)
    common = set(mine).intersection(*held)
    for step in [s for s in tier.steps if s not in common]:
        lacking = [r for r, steps in enumerate(held) if step not in steps]
        log.warning(
            "%s: dropping memory step %d: rank(s) %s do not hold it (a lost host's memory, or a "
            "save cut between the ranks' commits); it restores from the disk if saved there",
            tier.path, step, lacking,
        )  # fmt: skip
        tier.delete(step)


def _saved_by(path: Path, step: int, ranks: Ranks) -> bool:
    """Whether the memory step was saved by this rank of a job of this size."""
    try:
        meta = read_metadata(path, step)
    except ValueError:
        return False
    return (meta.get("world_size"), meta.get("rank")) == (ranks.world, ranks.rank)


def mark_ranks(tier: MemoryTier, ranks: Ranks, token: str) -> list[str | None]:
    """Several ranks, at opening: the run tokens the ranks other than 0 found in their memory
    markers (``RunHistory``'s ``peer_memory_tokens``); each of them marks its tier with
    ``token``, the run's, before rank 0 marks the directory. One rank: ``[]``."""
    if ranks.world == 1:
        return []  # rank 0's RunHistory reads and writes its own marker
    found = read_memory_token(tier.marker)
    if not ranks.leader:  # rank 0's RunHistory reads and writes its own marker
        write_memory_marker(tier.marker, token)
    return ranks.gather(found)[1:]


def _remove_torn(path: Path) -> None:
    """Removes step directories without their ``cocijax.json`` (cut by hand, or by a tmpfs
    that lost files): a memory copy is a cache of the job's state, never its only record of
    something a user wrote there."""
    for entry in path.iterdir():
        if entry.name.isdigit() and entry.is_dir() and not (entry / METADATA_NAME).is_file():
            log.warning("%s: removing %s (no %s: torn)", path, entry.name, METADATA_NAME)
            remove(entry)


def checksums(step_dir: Path) -> dict[str, str]:
    """The CRC-32 of each file DCP wrote into ``step_dir`` (``cocijax.json`` aside)."""
    return {
        entry.name: _crc32(entry)
        for entry in sorted(step_dir.iterdir())
        if entry.is_file() and entry.name != METADATA_NAME
    }


def verify(step_dir: Path, expected: dict[str, str]) -> None:
    """Checks the files of ``step_dir`` against their recorded checksums.

    Raises:
      ValueError: a file is missing or does not match (names it).
    """
    for name, crc in expected.items():
        path = step_dir / name
        if not path.is_file():
            raise ValueError(f"{path} is missing")
        if _crc32(path) != crc:
            raise ValueError(f"{path} does not match its checksum (damaged)")


def copy_step(step_dir: Path, directory: Path, step: int, session: str) -> Path:
    """Copies the DCP files of a committed step into a new temporary directory of
    ``directory``, durably; the caller commits it (``_directory.commit``).

    Returns:
      The temporary directory.
    """
    tmp = directory / f"{TMP_PREFIX}{step}-{session}"
    tmp.mkdir()
    for entry in step_dir.iterdir():
        if entry.is_file() and entry.name != METADATA_NAME:
            shutil.copyfile(entry, tmp / entry.name)
            fsync_file(tmp / entry.name)
    fsync_dir(tmp)
    return tmp


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"
