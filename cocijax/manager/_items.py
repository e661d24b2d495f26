"""The items of a step besides the state: what a ``save`` or ``restore`` call may pass.

A step directory holds the manager's own items (``state``, ``policy``, ``metrics``) and the
caller's ``extra`` items, any Orbax args whose handler Orbax's registry knows; each item is a
directory of its own inside the step. ``custom_metadata`` goes into Orbax's step metadata.
"""

from __future__ import annotations

import json
from typing import Any

import orbax.checkpoint as ocp

from cocijax.core._contract import check_extra_names
from cocijax.manager._directory import RESERVED_ITEMS, TMP_MARK

__all__ = ["check_custom_metadata", "check_extra"]


def check_extra(extra: Any, *, restoring: bool) -> dict[str, ocp.args.CheckpointArgs]:
    """Checks the ``extra`` items of a ``save`` or ``restore`` call, before anything is written.

    Args:
      extra: ``None`` or a mapping from item names to Orbax ``CheckpointArgs`` whose type
        Orbax's global handler registry knows (``ocp.args.JsonSave``, ``StandardSave``,
        ``PyTreeSave``, ``grain.checkpoint.CheckpointSave``, ...).
      restoring: the args are restore args (``JsonRestore``, ...), not save args.

    Returns:
      The items as a new dict (empty for ``None``).

    Raises:
      TypeError: ``extra`` is not a mapping, a name is not a string, or an item's args type is
        not registered with a handler or goes the wrong way (the message names the key).
      ValueError: a name is reserved (``state``, ``policy``, ``metrics``) or cannot be a
        directory name.
    """
    verb = "restore" if restoring else "save"
    example = f"Orbax CheckpointArgs (e.g. {{'config': ocp.args.Json{verb.title()}(...)}})"
    extra = check_extra_names(extra, reserved=RESERVED_ITEMS, expected=example)
    items = {}
    for name, args in extra.items():
        if not name or name.startswith(".") or "/" in name or TMP_MARK in name:
            raise ValueError(
                f"extra[{name!r}]: an item name becomes a directory inside the step: it must "
                "be non-empty, without '/' and not start with '.'."
            )
        try:
            handler = ocp.args.get_registered_handler_cls(args)
        except (TypeError, ValueError):
            raise TypeError(
                f"extra[{name!r}]: {type(args).__name__} is not an Orbax CheckpointArgs type "
                f"that Orbax's handler registry knows; pass e.g. ocp.args.Json{verb.title()}, "
                f"ocp.args.Standard{verb.title()} or grain.checkpoint.Checkpoint"
                f"{verb.title()}, or register your type with ocp.args.register_with_handler."
            ) from None
        try:
            wanted, other = ocp.args.get_registered_args_cls(handler)
        except ValueError:  # a handler registered for one direction only: nothing to compare
            wanted = other = type(args)
        if restoring:
            wanted, other = other, wanted
        if isinstance(args, other) and not isinstance(args, wanted):
            raise TypeError(
                f"extra[{name!r}]: {type(args).__name__} is an args type for "
                f"{'saving' if restoring else 'restoring'}; {verb} takes "
                f"{wanted.__name__} for this handler."
            )
        items[name] = args
    return items


def check_custom_metadata(custom_metadata: Any) -> dict[str, Any] | None:
    """``custom_metadata`` as Orbax keeps it: a dict with string keys that JSON can write."""
    if custom_metadata is None:
        return None
    if not isinstance(custom_metadata, dict) or not all(
        isinstance(k, str) for k in custom_metadata
    ):
        raise TypeError(
            f"custom_metadata: expected a dict with string keys, got {custom_metadata!r:.80}."
        )
    try:
        json.dumps(custom_metadata)
    except (TypeError, ValueError) as e:
        raise TypeError(f"custom_metadata: must be JSON-serialisable ({e}).") from e
    return custom_metadata
