"""Stripe directories on the roots: which ones an item references, and which are garbage.

Every save writes under a ``cocijax-stripe-<uuid4>`` directory on each root it uses. Orbax
deletes a step's item directory, never the stripes on other roots: these functions tell which
stripe directories no item references any more (an interrupted save's, a deleted step's), so a
collector (``cj.CheckpointManager``, or a user of the bare handler) can remove them.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from cocijax._files import remove_tree as remove_local_tree
from cocijax.storage import _kvpath
from cocijax.storage._kvpath import KvPath
from cocijax.storage._manifest_io import read_manifest
from cocijax.storage._records import MANIFEST_NAME, STRIPE_PREFIX, Location, Manifest

log = logging.getLogger(__name__)


def referenced_stripe_dirs(item_dir: os.PathLike | str) -> set[pathlib.Path]:
    """Stripe directories on external roots that a committed item uses.

    Data stored inside the item directory itself (``roots=()``) is not listed: it goes away with
    the item. Use with :func:`find_stripe_dirs` to find orphans left by interrupted saves.

    Raises:
      CheckpointFormatError: the item has no readable manifest.
    """
    return _stripe_dirs(read_manifest(item_dir))


def _stripe_dirs(manifest: Manifest) -> set[pathlib.Path | KvPath]:
    dirs = set()
    for p in manifest.pieces:
        root = manifest.roots[p.root]
        if root is not None:
            dirs.add(_kvpath.location(root) / pathlib.PurePosixPath(p.file).parts[0])
    return dirs


def find_stripe_dirs(
    root: Location, *, root_options: Mapping[str, Any] | None = None
) -> list[pathlib.Path | KvPath]:
    """Every stripe directory cocijax wrote directly under ``root``, sorted; [] if none.

    ``root`` may be an object-store prefix (``s3://bucket/prefix``): its keys are listed.
    """
    root = _kvpath.location(root, root_options)
    if isinstance(root, KvPath):
        names = {key.split("/", 1)[0] for key in root.list()}
        return [root / n for n in sorted(names) if n.startswith(STRIPE_PREFIX)]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STRIPE_PREFIX))


def remove_tree(where: Location, *, root_options: Mapping[str, Any] | None = None) -> None:
    """Removes a directory (a stripe directory, say) or every object under a prefix."""
    where = _kvpath.location(where, root_options)
    if isinstance(where, KvPath):
        where.delete_all()
    else:
        remove_local_tree(where)


# A stripe directory's name as a manifest mentions it (in each piece's ``file``): the prefix and a
# name that is unique for every save (a uuid4), so a name alone identifies one save's stripes.
_STRIPE_NAME = re.compile(re.escape(STRIPE_PREFIX).encode() + rb'[^/"\\\s]+')


def stripe_names_in_use(item_dir: os.PathLike | str) -> frozenset[str] | None:
    """The names of the stripe directories an item may reference, for garbage collection.

    Read from the manifest's raw bytes: every stripe name they mention, whether or not the
    manifest can be parsed, checked or is of a version this cocijax reads. So a damaged or
    foreign manifest keeps its item's stripes (the item is set aside or deleted as a whole),
    and no manifest is ever trusted by a timestamp or a cache: a name is a uuid4, never reused.

    * No manifest (a save that never committed; checked twice, so that an ``open`` failing
      with ENOENT is not taken for it): the item references nothing, its stripes are garbage.
    * A manifest that cannot be read (an I/O error): ``None``, "unknown"; a collector must
      then remove nothing now and try again later.

    Args:
      item_dir: an Orbax item directory the striped handler saved into (or began to).

    Returns:
      Stripe directory names (``cocijax-stripe-...``), or None when unknown.
    """
    manifest = pathlib.Path(item_dir) / MANIFEST_NAME
    try:
        data = manifest.read_bytes()
    except FileNotFoundError:
        # Never committed, so its stripes are garbage, but only if the manifest is really not
        # there: an open failing with ENOENT on an existing file (an I/O fault; libfiu injects
        # it) must not delete a committed step's data.
        if os.path.lexists(manifest):
            log.warning("cannot open %s: keeping every stripe for now", manifest)
            return None
        return frozenset()
    except OSError as e:
        log.warning("cannot read %s (%s): keeping every stripe for now", manifest, e)
        return None
    return frozenset(m.decode(errors="replace") for m in _STRIPE_NAME.findall(data))


def unreferenced_stripe_dirs(
    roots: Iterable[Location],
    item_dirs: Iterable[os.PathLike | str],
    *,
    root_options: Mapping[str, Any] | None = None,
) -> list[pathlib.Path | KvPath] | None:
    """Stripe directories on ``roots`` that none of ``item_dirs`` references: garbage.

    A stripe directory is referenced when an item's manifest names it (see
    :func:`stripe_names_in_use`): its name is unique to the save that wrote it, so the same
    directory reached through another spelling of a root is still recognised.

    Args:
      roots: the directories or object-store prefixes saves striped into (a handler's
        ``roots``).
      item_dirs: every item that may reference stripes on them, committed, damaged or not.
      root_options: kvstore options for object-store roots given as URLs.

    Returns:
      The unreferenced stripe directories, sorted; ``None`` when an item's references cannot
      be known now (an I/O error reading its manifest), in which case nothing may be removed.

    Example:
      >>> import tempfile
      >>> root = pathlib.Path(tempfile.mkdtemp())
      >>> (root / (STRIPE_PREFIX + "left-by-a-crash")).mkdir()
      >>> [p.name for p in unreferenced_stripe_dirs([root], [])]
      ['cocijax-stripe-left-by-a-crash']
    """
    referenced: set[str] = set()
    for item_dir in item_dirs:
        names = stripe_names_in_use(item_dir)
        if names is None:
            return None
        referenced |= names
    return [
        d
        for root in roots
        for d in find_stripe_dirs(root, root_options=root_options)
        if d.name not in referenced
    ]
