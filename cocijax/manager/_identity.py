"""Where a checkpoint directory's data lives, and who it belongs to.

A JAX checkpoint directory may stripe its steps over external roots, where several directories
may share one root. Each directory stripes into its own folder on a root (its *namespace*), so
that its garbage collection never removes another directory's stripes. The namespace used to be
a hash of the directory's path as given, which two directories could share (a symlink
re-pointed, two containers mounting different volumes at one mount point) and one directory could
have several of (a symlink, ``x/../run``): one collected the other's data, or neither collected
its own.

Now a directory's identity is written into it once (``.cocijax-id``, a random id, see
:mod:`cocijax.core._identity`), so every spelling of the directory reads the same id and no two
directories share one. Each namespace folder keeps an owner record (``.cocijax-owner``) with the
id and an *epoch* the directory bumps at every opening: a copy of the directory (``cp -r``, a
volume snapshot) that is opened after its original moved on finds an owner record newer than its
own epoch, and takes a new identity instead of collecting stripes the original still needs. A
directory written before identities existed keeps the namespace its steps' manifests name.

Also here: the checks that the directory, its roots and its durable tier do not overlap in a
way that would lose data (a durable tier inside the directory deletes its steps as leftovers).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cocijax import _files, storage
from cocijax.core._identity import Identity, bump_identity, new_id, read_identity

__all__ = ["OWNER_FILE", "check_directory", "check_locations", "open_identity"]

log = logging.getLogger(__name__)

OWNER_FILE = ".cocijax-owner"
_NAMESPACE = re.compile(r"^\.cocijax-([0-9a-f]{16})$")


def open_identity(directory: Path, roots: Sequence[Path | storage.KvPath]) -> Identity:
    """The identity of ``directory`` for a writer opening it: read, adopted or made, then bumped.

    Call on the primary writer only, holding the directory's lock. Without an identity record,
    a directory whose steps name a namespace on their roots (written by an earlier cocijax)
    keeps it; otherwise it gets a new one. A directory whose owner record on some root is newer
    than its own epoch is a copy of a directory that moved on: it gets a new identity (said in
    a warning), so that neither collects the other's stripes.

    Args:
      directory: the checkpoint directory (it exists).
      roots: its external roots (the namespace folders are made below them).

    Returns:
      The identity, its epoch bumped and written durably into the directory and every root;
      without roots, the directory's identity as it is (written only if it has none).
    """
    identity = read_identity(directory)
    if identity is not None and not roots:
        # The epoch orders the directory against its owner records on the roots: without
        # roots there is nothing to order, and the opening writes (and syncs) nothing. Bumped
        # only with the records, it also keeps a copy opened without roots from catching up.
        return identity
    identity = identity or Identity(_legacy_id(directory) or new_id(), 0)
    owners = [(root, _read_owner(root / identity.namespace)) for root in roots]
    newer = [(root, owner) for root, owner in owners if owner and owner["epoch"] > identity.epoch]
    if newer:
        root, owner = newer[0]
        log.warning(
            "%s has the identity of the checkpoint directory last opened as %s (epoch %d, this "
            "one is at %d): a copy of it, or its original. It takes a new identity, so that "
            "neither collects the other's stripes on %s; its steps saved before the copy still "
            "read stripes the other may delete. Copy a directory with external roots together "
            "with its roots.",
            directory,
            owner.get("directory"),
            owner["epoch"],
            identity.epoch,
            root,
        )
        identity = Identity(new_id(), 0)
    # The directory first: a crash before the roots are written leaves their records older,
    # never newer, than the directory's (a newer one would look like a copy).
    identity = bump_identity(directory, identity)
    owner = {
        "id": identity.id,
        "epoch": identity.epoch,
        "directory": str(directory),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    for root in roots:
        _write_owner(root / identity.namespace, owner)
    return identity


def _legacy_id(directory: Path) -> str | None:
    """The namespace an earlier cocijax gave ``directory``, as its newest step's manifest names
    it (a hash of the path as it was spelled then)."""
    steps = sorted(
        (e for e in directory.iterdir() if e.name.isdigit() and e.is_dir()),
        key=lambda e: int(e.name),
        reverse=True,
    )
    for step in steps:
        try:
            manifest = storage.read_manifest(step / "state")
        except (ValueError, OSError):
            continue
        names = [r.rstrip("/").rsplit("/", 1)[-1] for r in manifest.roots if r is not None]
        if names:  # the newest step striped over roots: its folders name the namespace
            match = _NAMESPACE.match(names[0])
            return match.group(1) if match else None
    return None


def _read_owner(folder: Path | storage.KvPath) -> dict[str, Any] | None:
    try:
        data = (folder / OWNER_FILE).read_bytes()
    except FileNotFoundError:
        return None
    if data is None:  # an object store's missing object
        return None
    try:
        owner = json.loads(data)
        int(owner["epoch"])
    except (ValueError, KeyError, TypeError):
        log.warning("%s: not an owner record; rewritten", folder / OWNER_FILE)
        return None
    return owner


def _write_owner(folder: Path | storage.KvPath, owner: dict[str, Any]) -> None:
    data = json.dumps(owner).encode()
    if isinstance(folder, storage.KvPath):
        (folder / OWNER_FILE).write_bytes(data)
        return
    _files.make_dirs(folder)
    _files.replace_bytes(folder / OWNER_FILE, data, fsync=True)
    _files.fsync_dir(folder)


def check_directory(directory: Any) -> Path:
    """A manager's ``directory`` argument as an absolute path, checked before anything is made.

    Raises:
      TypeError: not a path.
      FileNotFoundError: a symbolic link to nothing (``mkdir`` would fail on it).
      NotADirectoryError: it exists and is not a directory.
    """
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"directory: expected a path (str or os.PathLike), got {type(directory).__name__}."
        )
    path = Path(directory).absolute()
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(
            f"directory: {path} is a symbolic link to {os.readlink(path)}, which does not "
            "exist; create that directory, or point the link at the checkpoint directory."
        )
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"directory: {path} exists and is not a directory.")
    return path


def check_locations(
    directory: Path,
    roots: Sequence[Path | storage.KvPath],
    durable: storage.KvPath | None,
    memory: Path | None = None,
) -> None:
    """Refuses a directory, roots, durable tier and memory tier that overlap in a way that
    loses data.

    * The durable tier may not be the directory, lie inside it or contain it: its drains and
      its garbage collection would take the directory's steps for their own leftovers.
    * A root may be the directory itself (its stripes then go into a hidden folder of it),
      but may not lie inside it (the next opening would find a folder cocijax did not write).
    * The durable tier may not be a root, lie inside one or contain one.
    * The memory tier's folder may not be a root or the durable tier, lie inside one or
      contain one: its job folder would be the directory's stripe folder on that root (the
      same namespace), and each would take the other's data for leftovers and remove it.
      (The directory itself is ``cocijax.core._memory.check_memory``'s.)

    Raises:
      ValueError: naming both locations and what to do.
    """
    home = directory.resolve()
    tier = _resolved(durable) if durable is not None else None
    if tier is not None and _overlap(tier, home):
        raise ValueError(
            f"durable={durable}: the durable tier overlaps the checkpoint directory {directory} "
            "(the same folder, or one inside the other). The durable tier keeps its own copy "
            "of each step and deletes what it takes for leftovers: give it a folder of its "
            "own, outside the checkpoint directory (or an object-store URL)."
        )
    for i, root in enumerate(roots):
        where = _resolved(root)
        if isinstance(where, Path) and where != home and home in where.parents:
            raise ValueError(
                f"roots[{i}]={root}: lies inside the checkpoint directory {directory}. Give "
                "a root outside it (or the directory itself, whose stripes then go into a "
                "hidden folder of it)."
            )
        if tier is not None and _overlap(tier, where):
            raise ValueError(
                f"durable={durable}: overlaps roots[{i}]={root}. The durable tier must be "
                "storage of its own, apart from the roots the steps are striped over."
            )
    if memory is None:
        return
    home = memory.resolve()
    for name, where in [(f"roots[{i}]", r) for i, r in enumerate(roots)] + [("durable", durable)]:
        if where is not None and _overlap(home, _resolved(where)):
            raise ValueError(
                f"memory={str(memory)!r}: overlaps {name}={where} (the same folder, or one "
                "inside the other). The memory tier keeps this job's snapshots in a folder "
                "named as the directory's stripe folder on each root, and removes from it "
                "what is not a snapshot: give it a tmpfs folder of its own (e.g. memory=True)."
            )


def _resolved(where: Path | storage.KvPath) -> Path | str:
    if isinstance(where, storage.KvPath):
        return Path(where.key).resolve() if where.is_local else where.url.rstrip("/") + "/"
    return Path(where).resolve()


def _overlap(a: Path | str, b: Path | str) -> bool:
    if isinstance(a, Path) and isinstance(b, Path):
        return a == b or a in b.parents or b in a.parents
    if isinstance(a, str) and isinstance(b, str):
        return a.startswith(b) or b.startswith(a)
    return False
