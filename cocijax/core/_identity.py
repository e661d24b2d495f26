"""A checkpoint directory's identity: a random id written into it once (``.cocijax-id``).

Every spelling of a directory (a symlink, ``x/../run``) reads the same id, and no two
directories share one, so the folders a directory keeps elsewhere are named by it (its
*namespace*): the JAX manager's stripes on external roots (``cocijax.manager._identity``, which
also tells a copy of a directory from its original by the *epoch*), and either manager's folder
in a memory tier (:mod:`cocijax.core._memory`). The epoch counts the writers' openings.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from pathlib import Path

from cocijax import _files

__all__ = ["ID_FILE", "Identity", "bump_identity", "new_id", "read_identity"]

ID_FILE = ".cocijax-id"


@dataclasses.dataclass(frozen=True)
class Identity:
    """A checkpoint directory's identity.

    Attributes:
      id: hex digits, written once into the directory.
      epoch: how many times a writer opened the directory (bumped at each opening).
    """

    id: str
    epoch: int

    @property
    def namespace(self) -> str:
        """The name of the directory's folder on each external root (and in a memory tier)."""
        return f".cocijax-{self.id[:16]}"


def read_identity(directory: Path) -> Identity | None:
    """The identity recorded in ``directory``, or None when it has none.

    Raises:
      ValueError: the file exists but is not an identity record (names it).
    """
    path = directory / ID_FILE
    try:
        data = json.loads(path.read_bytes())
        identity = Identity(str(data["id"]), int(data["epoch"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: not a cocijax identity record ({e!r}); it names the folder of this "
            "directory's stripes on its roots. If the directory has no steps, delete the file."
        ) from None
    if not re.fullmatch(r"[0-9a-f]{16,32}", identity.id) or identity.epoch < 0:
        raise ValueError(f"{path}: not a cocijax identity record (id {identity.id!r}).")
    return identity


def new_id() -> str:
    """A new directory's id."""
    return uuid.uuid4().hex


def bump_identity(directory: Path, identity: Identity | None = None) -> Identity:
    """Writes ``identity`` (default: the directory's own, or a new one), its epoch bumped, into
    ``directory`` durably: a writer's opening. Call holding the directory's lock.

    Returns:
      The identity written.

    Raises:
      ValueError: the directory's record is not an identity record (names it).
    """
    identity = identity or read_identity(directory) or Identity(new_id(), 0)
    identity = dataclasses.replace(identity, epoch=identity.epoch + 1)
    record = {"id": identity.id, "epoch": identity.epoch}
    _files.replace_bytes(directory / ID_FILE, json.dumps(record).encode(), fsync=True)
    _files.fsync_dir(directory)
    return identity
