"""What the processes of a JAX job exchange so that they take the same save decisions.

The policy driver calls these at every policy check: one broadcast of process 0's measured
inputs (every process then feeds its policy the same numbers) and one all-gather of a summary
of the steps each process was given (a user's loop at different steps on different processes
is an error on all of them, not a hang in a later collective). With one process both are
no-ops, and neither imports JAX's multi-host utilities. At opening, the primary process's
short strings (the directory's namespace) reach the others through :func:`from_primary`.
"""

from __future__ import annotations

import zlib

import jax
import numpy as np

from cocijax.core._contract import StepMismatchError


def broadcast_from_process_0(values: np.ndarray) -> np.ndarray:
    """Every process decides on process 0's measurements (the same updates, the same decisions)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def same_steps_on_every_process(steps: np.ndarray) -> None:
    """Raises :class:`StepMismatchError` on every process unless all recorded these ``steps``.

    One all-gather of a fixed size (the count, the first and last step, a checksum of all),
    whatever the steps: processes at different steps still meet in it, and every one of them
    sees every process's steps, so all raise the same error. Steps fit int32
    (:data:`~cocijax.core._contract.MAX_STEP`), which is what JAX gathers without x64.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    checksum = zlib.crc32(np.asarray(steps, "<i8").tobytes()) & 0x7FFFFFFF
    mine = np.asarray([len(steps), steps[0], steps[-1], checksum], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 4)
    if (every == every[0]).all():
        return
    seen = "; ".join(
        f"process {i}: "
        + (f"step {first}" if n == 1 else f"{n} steps, {first} to {last}")
        + (" (not the same ones)" if i and row[:3] == every[0, :3].tolist() else "")
        for i, row in enumerate(every.tolist())
        for n, first, last, _ in [row]
    )
    raise StepMismatchError(
        f"save: the processes of this job passed different steps since the policy's previous "
        f"check ({seen}). Every process must call save with the same steps in the same order "
        f"(one step counter for all; no process skipping a call); nothing of these steps was "
        f"saved."
    )


def from_primary(text: str | None, *, is_source: bool) -> str | None:
    """The primary process's ``text`` (a short ASCII string or None), on every process."""
    from jax.experimental import multihost_utils

    data = np.zeros(64, np.uint8)
    if is_source and text is not None:
        encoded = text.encode("ascii")
        data[0] = len(encoded) + 1
        data[1 : 1 + len(encoded)] = np.frombuffer(encoded, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data, is_source=is_source))
    size = int(data[0])
    return None if size == 0 else bytes(data[1:size]).decode("ascii")
