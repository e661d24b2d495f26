"""The Orbax item that stores a policy's state next to each checkpoint.

The JSON is produced in the commit future, after the manager has timed the save that writes it:
the checkpoint of step ``s`` then records the cost of its own save, exactly what an uninterrupted
job would feed the policy at step ``s + 1``. The commit future waits for that measurement through
a ``threading.Event``; the manager sets it right after the blocking part of ``save`` (also when
``save`` fails, so that no future waits forever).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from cocijax._digest import DIGEST_KEY, check_digest, with_digest

__all__ = ["PolicyStateHandler", "PolicyStateRestore", "PolicyStateSave"]

FILENAME = "policy_state.json"
# Seconds a commit future waits for the manager's measurement; only reached if the training
# thread died between starting a save and timing it.
_READY_TIMEOUT_S = 600.0


class PolicyStateHandler(ocp.AsyncCheckpointHandler):
    """Writes one small JSON document (``policy_state.json``) on the primary process.

    Args:
      primary_host: the process that writes (Orbax's ``MultiprocessingOptions.primary_host``).
    """

    def __init__(self, *, primary_host: int | None = 0):
        self._primary_host = primary_host

    async def _write(self, directory: epath.Path, args: PolicyStateSave) -> None:
        await asyncio.to_thread(self._write_now, directory, args)

    def _write_now(self, directory: epath.Path, args: PolicyStateSave) -> None:
        if not args.ready.wait(_READY_TIMEOUT_S):
            raise TimeoutError(f"{directory}: the policy state was never completed by the manager.")
        if not ocp.multihost.is_primary_host(self._primary_host):
            return
        # With a digest of its own, so that a damaged file is refused, not half believed.
        text = json.dumps(with_digest(args.build()))
        path = os.path.join(os.fspath(directory), FILENAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    async def async_save(
        self, directory: epath.Path, args: PolicyStateSave
    ) -> list[ocp.future.Future]:
        """Returns one commit future that writes the JSON once the manager has measured."""
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                self._write(directory, args), name="cocijax_policy_state"
            )
        ]

    def save(self, directory: epath.Path, args: PolicyStateSave) -> None:
        """Writes the JSON now (a synchronous save: the manager has measured already)."""
        self._write_now(directory, args)

    def restore(
        self, directory: epath.Path, args: PolicyStateRestore | None = None
    ) -> dict[str, Any]:
        """Returns the decoded JSON.

        Raises:
          FileNotFoundError: the file is missing.
          ValueError: the file is not a JSON object, or does not match its digest (the
            message names it).
        """
        del args
        path = epath.Path(directory) / FILENAME
        if not path.exists():
            raise FileNotFoundError(f"{path}: policy state file is missing.")
        try:
            data = json.loads(path.read_text())
        except (ValueError, RecursionError) as e:  # not JSON, too deep, a 4300-digit integer
            raise ValueError(f"{path}: policy state is not valid JSON ({e}).") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: policy state is not a JSON object.")
        if not check_digest(data):
            raise ValueError(f"{path}: policy state does not match its digest (damaged).")
        data.pop(DIGEST_KEY, None)
        return data

    @classmethod
    def typestr(cls) -> str:
        # Stable on-disk identity, independent of the module path.
        return "cocijax.PolicyStateHandler"


@ocp.args.register_with_handler(PolicyStateHandler, for_save=True)
@dataclasses.dataclass
class PolicyStateSave(ocp.args.CheckpointArgs):
    """Save args of :class:`PolicyStateHandler`.

    Attributes:
      build: returns the JSON-serialisable document; called in the commit future.
      ready: set by the manager once ``build`` may be called.
    """

    build: Callable[[], dict[str, Any]]
    ready: threading.Event


@ocp.args.register_with_handler(PolicyStateHandler, for_restore=True)
@dataclasses.dataclass
class PolicyStateRestore(ocp.args.CheckpointArgs):
    """Restore args of :class:`PolicyStateHandler` (no options)."""
