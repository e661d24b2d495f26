"""Steps an Orbax ``CheckpointManager`` wrote: a way in for a job that switches to cocijax.

A directory written by ``ocp.CheckpointManager`` holds step directories whose Orbax metadata
(``<step>/_CHECKPOINT_METADATA``) names each item's handler. :class:`cocijax.CheckpointManager`
opens such a directory: it lists those steps beside its own, restores one through Orbax's own
handlers (the training state from the item named ``state``, else ``default``, else the one
pytree item of the step; any other item through ``extra=``, as for cocijax steps), and saves new
steps in its own format next to them. It never writes or deletes an Orbax step unless asked to
count them in retention (``orbax_retention=True``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

__all__ = ["OrbaxStep", "find_orbax_step", "restore_orbax_step"]

log = logging.getLogger(__name__)

METADATA_FILE = "_CHECKPOINT_METADATA"
# Handlers whose items hold a pytree of arrays: the training state can be one of these.
_PYTREE_HANDLERS = {
    "StandardCheckpointHandler": "standard",
    "PyTreeCheckpointHandler": "pytree",
}
# Item names a training state goes by in an Orbax directory, in order of preference.
_STATE_NAMES = ("state", "default")
# The typestr of cocijax's own state handler: a step that has it is cocijax's, damaged or not.
_COCIJAX_STATE = "cocijax.storage.StripedCheckpointHandler"


@dataclasses.dataclass(frozen=True)
class OrbaxStep:
    """A step written by Orbax's ``CheckpointManager``.

    Attributes:
      path: the step directory.
      handlers: item name -> the handler class Orbax recorded (its last dotted name).
    """

    path: Path
    handlers: Mapping[str, str]

    @property
    def state_item(self) -> str | None:
        """The item that holds the training state, or None when no item can be it."""
        trees = [name for name, kind in self.handlers.items() if kind in _PYTREE_HANDLERS]
        for name in _STATE_NAMES:
            if name in trees:
                return name
        return trees[0] if len(trees) == 1 else None


def find_orbax_step(step_dir: Path) -> OrbaxStep | None:
    """The Orbax step in ``step_dir``, or None when it is not one (a cocijax step, say).

    A step is Orbax's when its Orbax metadata lists item handlers and none of them is cocijax's
    state handler (a cocijax step whose manifest was damaged is not an Orbax step).
    """
    try:
        data = json.loads((step_dir / METADATA_FILE).read_bytes())
        handlers = data["item_handlers"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(handlers, dict) or not handlers:
        return None
    if any(str(h) == _COCIJAX_STATE or str(h).startswith("cocijax.") for h in handlers.values()):
        return None
    names = {str(k): str(v).rsplit(".", 1)[-1] for k, v in handlers.items()}
    if not all((step_dir / name).is_dir() for name in names):
        return None
    return OrbaxStep(step_dir, names)


def restore_orbax_step(
    step: OrbaxStep, target: Any, extra: Mapping[str, Any], *, partial: bool
) -> dict[str, Any]:
    """Restores an Orbax step's training state (and ``extra`` items) through Orbax's handlers.

    Args:
      step: the step.
      target: the manager's restore target (an abstract tree, arrays, or None: as saved).
      extra: further items to restore, by name, with their Orbax restore args.
      partial: a partial restore was asked for (not supported for an Orbax step).

    Returns:
      ``{"state": tree, **extra items}``.

    Raises:
      ValueError: ``partial``, no item of the step can be the training state, or an
        ``extra`` name the step lacks (names the step's items).
    """
    name = step.state_item
    if name is None:
        raise ValueError(
            f"restore: {step.path} was written by Orbax with items {dict(step.handlers)}, none "
            f"of which is the training state (an item named {' or '.join(_STATE_NAMES)}, or "
            "the step's only StandardSave/PyTreeSave item)."
        )
    if partial:
        raise ValueError(
            f"restore: partial=True is not supported for {step.path}, written by Orbax: "
            "restore the whole state (or save a cocijax step first)."
        )
    missing = sorted(set(extra) - set(step.handlers))
    if missing:
        raise KeyError(
            f"restore: {step.path}, written by Orbax, has no item {missing[0]!r} (it has "
            f"{sorted(step.handlers)})."
        )
    if _PYTREE_HANDLERS[step.handlers[name]] == "standard":
        state_args = ocp.args.StandardRestore(target)
    elif target is None:
        state_args = ocp.args.PyTreeRestore()
    else:
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        state_args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
    log.info(
        "restoring %s, written by Orbax's CheckpointManager: the state from its item %r "
        "through Orbax's %s",
        step.path,
        name,
        step.handlers[name],
    )
    args = ocp.args.Composite(**{name: state_args, **extra})
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(step.path, args=args)
    return {"state": restored[name], **{k: restored[k] for k in extra}}
