"""The checkpoint directory of :class:`cocijax.CheckpointManager`: layout, listing, options.

What a cocijax directory may hold: step directories (``<step>/state`` written by the striped
handler, ``<step>/policy`` the policy state), Orbax's temporary directories, the trash Orbax
renames dropped steps into, the writer's lock file, and (when the directory is also a storage
root) its hidden stripe folder. A step is *committed* when its ``state`` manifest is present
and valid.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from cocijax import storage
from cocijax.manager._durable import DurableRenameTemporaryPath

__all__ = [
    "POLICY_ITEM",
    "STATE_ITEM",
    "STEP_RE",
    "TRASH_DIR",
    "CommittedStepFormat",
    "check_layout",
    "is_committed",
    "merge_options",
]

STATE_ITEM = "state"
POLICY_ITEM = "policy"
TRASH_DIR = ".cocijax-deleted"
STEP_RE = re.compile(r"^\d+$")
TMP_MARK = ".orbax-checkpoint-tmp"


def is_committed(step_dir: Path) -> bool:
    """A step is committed when its ``state`` manifest is present and valid."""
    try:
        storage.read_manifest(step_dir / STATE_ITEM)
    except (ValueError, OSError, KeyError, TypeError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class CommittedStepFormat:
    """Orbax ``NameFormat`` that lists only steps with a valid cocijax manifest.

    Orbax lists every directory named like a step; a step whose manifest is missing or invalid
    (corruption, a foreign tool) must not be listed, restored or counted by ``max_to_keep``.
    """

    inner: Any = dataclasses.field(default_factory=ocp.path.step.standard_name_format)

    def build_name(self, step: int) -> str:
        return self.inner.build_name(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        return (m for m in self.inner.find_all(base_path) if is_committed(Path(m.path)))

    def find_step(self, base_path: Any, step: int) -> Any:
        metadata = self.inner.find_step(base_path, step)
        if not is_committed(Path(metadata.path)):
            raise ValueError(f"{metadata.path}: step {step} has no valid cocijax manifest.")
        return metadata


def check_layout(directory: Path) -> list[Path]:
    """Raises if ``directory`` holds something cocijax did not write; returns uncommitted steps.

    Allowed: step directories holding a ``state`` item, Orbax temporary directories, and hidden
    entries (our lock, trash and, when ``directory`` is also a root, its stripe folder).
    """
    uncommitted = []
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if name.startswith(".") or TMP_MARK in name:
            continue
        if STEP_RE.match(name) and entry.is_dir():
            if not (entry / STATE_ITEM).is_dir():
                raise ValueError(
                    f"directory: {entry} looks like a checkpoint step but has no '{STATE_ITEM}' "
                    "item; it was not written by cocijax. Use an empty or cocijax-only directory."
                )
            if not is_committed(entry):
                uncommitted.append(entry)
            continue
        raise ValueError(
            f"directory: {entry} was not written by cocijax (expected only step directories). "
            "Use an empty or cocijax-only directory."
        )
    return uncommitted


def merge_options(
    options: ocp.CheckpointManagerOptions | None, **shortcuts: Any
) -> ocp.CheckpointManagerOptions:
    options = options or ocp.CheckpointManagerOptions()
    for name, value in shortcuts.items():
        if value is None:
            continue
        current = getattr(options, name)
        if current is not None and current != value:
            raise ValueError(
                f"{name}: given as {value!r} and as {current!r} in options; give it once."
            )
        options = dataclasses.replace(options, **{name: value})
    unsupported = (
        "save_decision_policy",
        "should_save_fn",
        "step_name_format",
        "best_fn",
        "step_prefix",
        "step_format_fixed_length",
        "save_on_steps",
    )
    for name in unsupported:
        if getattr(options, name):  # None or empty (Orbax turns save_on_steps into a set)
            raise ValueError(
                f"options.{name}: not supported by cocijax.CheckpointManager (the policy decides "
                "when to save, and step directories keep Orbax's plain numeric names); leave it "
                "unset."
            )
    return dataclasses.replace(
        options,
        # Orbax's commit fsyncs nothing; a user's own temporary-path class is kept as given.
        temporary_path_class=options.temporary_path_class or DurableRenameTemporaryPath,
        step_name_format=CommittedStepFormat(),
        cleanup_tmp_directories=not options.read_only,
        todelete_subdir=TRASH_DIR,
        create=not options.read_only,
    )
