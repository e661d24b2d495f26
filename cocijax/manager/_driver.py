"""Feeds a :class:`cocijax.policies.Policy` with measured inputs and keeps what a restart needs.

Shared by :class:`cocijax.CheckpointManager` and :class:`cocijax.SaveDecisionPolicy`: both measure
times their own way, then call :meth:`PolicyDriver.decide` once per training step. The driver owns
the jitted ``update`` (compiled once: every argument has a fixed dtype and shape), the policy
state, and the measurement state (last step time, last checkpoint cost, last loss) that is saved
with every checkpoint so that a restarted job continues the same schedule.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import jax
import numpy as np

from cocijax.policies import Batch, next_check, update_many

__all__ = ["PolicyDriver", "read_loss", "stage_loss"]

_FORMAT = "cocijax.policy_state/1"


def _check_policy(policy: Any) -> None:
    init, update = getattr(policy, "init", None), getattr(policy, "update", None)
    if not (callable(init) and callable(update)):
        raise TypeError(
            f"policy: expected a cocijax.policies.Policy (an (init, update) pair, e.g. "
            f"cj.policies.coci()), got {type(policy).__name__}."
        )


def stage_loss(loss: Any) -> Any:
    """Checks that ``loss`` is a scalar and starts its copy to host without waiting for it.

    Args:
      loss: a Python number, a NumPy scalar or a jax/NumPy array with one element.

    Returns:
      ``loss`` itself; a ``jax.Array`` has had ``copy_to_host_async`` called on it.

    Raises:
      TypeError: ``loss`` is not a number or an array.
      ValueError: ``loss`` has more than one element.
    """
    if isinstance(loss, bool) or loss is None:
        raise TypeError(f"loss: expected a scalar number or array, got {loss!r}.")
    if isinstance(loss, int | float | np.number):
        return loss
    size = getattr(loss, "size", None)
    if size is None:
        raise TypeError(f"loss: expected a scalar number or array, got {type(loss).__name__}.")
    if size != 1:
        raise ValueError(
            f"loss: expected a scalar (one element), got shape {tuple(loss.shape)}; "
            "pass the mean training loss of the step."
        )
    if isinstance(loss, jax.Array):
        # Starts the device-to-host copy now; `read_loss` one step later then finds it done.
        loss.copy_to_host_async()
    return loss


def read_loss(loss: Any) -> float:
    """Returns ``loss`` (as accepted by :func:`stage_loss`) as a Python float; may block."""
    if loss is None:
        return math.nan
    if isinstance(loss, jax.Array) and not loss.is_fully_addressable:
        # A globally sharded scalar: each process reads its own copy (the manager broadcasts
        # process 0's value before deciding, so the copies need not agree).
        loss = loss.addressable_data(0)
    return float(np.asarray(loss).reshape(()))


def _encode(leaf: Any) -> dict[str, Any]:
    array = np.asarray(leaf)
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        # Raw bytes keep NaN payloads and every float bit exact, unlike a JSON number.
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
    }


def _decode(entry: dict[str, Any], like: Any, where: str) -> np.ndarray:
    like = np.asarray(like)
    dtype = jax.numpy.dtype(entry["dtype"])  # knows bfloat16, unlike np.dtype
    shape = tuple(entry["shape"])
    if dtype != like.dtype or shape != like.shape:
        raise ValueError(
            f"{where}: policy state leaf is {dtype}{list(shape)} on disk but "
            f"{like.dtype}{list(like.shape)} for this policy."
        )
    raw = base64.b64decode(entry["data"])
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


# Steps fed to the policy per dispatch (padded): one compilation for any number of skipped steps.
BATCH = 64


class PolicyDriver:
    """Runs one policy online: batched updates, measured inputs, restartable state.

    A step before the policy's next check (``cj.policies.next_check``) cannot be a save, so
    :meth:`decide` only records its inputs (a comparison and an append: no dispatch, no device
    sync, the loss not even read); at a check step the recorded steps and the current one go to
    the policy together (:func:`cj.policies.update_many`), and its decisions are exactly those
    of one ``update`` per step.

    Attributes:
      state: the policy state (a pytree of arrays); reading it feeds the recorded steps first.
      step: the last step given to :meth:`decide`, or None.
      step_time_s: the latest measured step time in seconds, kept by the caller (NaN before the
        first); saved with the checkpoint so that a restarted job has one at once.
      cost_s: the last measured checkpoint cost in seconds (NaN before the first save).
      loss: the loss value the policy sees at the next step (NaN if unknown).
      mtbf_s: the measured MTBF passed to the policy (NaN: unknown, the policy's prior).
      recovery_s: the measured recovery time passed to the policy (NaN: unknown).
    """

    def __init__(self, policy: Any):
        _check_policy(policy)
        self.policy = policy
        self._update_many = update_many(policy)
        # The policy runs on the host CPU: on an accelerator its tiny update would queue behind
        # the training step, and reading its decision would synchronise every step.
        self._device = jax.local_devices(backend="cpu")[0]
        self._state = jax.device_put(policy.init(), self._device)
        self._next_check = int(next_check(self._state))
        self._pending: list[tuple[int, Any, float, float]] = []  # (step, loss, step time, cost)
        self.step: int | None = None
        self.step_time_s = math.nan
        self.cost_s = math.nan
        self.loss = math.nan
        self.mtbf_s = math.nan
        self.recovery_s = math.nan
        self._last: tuple[Any, float, float] = (math.nan, math.nan, math.nan)
        # Compile now, on a throwaway batch, so that no training step is charged for it.
        jax.block_until_ready(self._update_many(self._state, _batch([(1, math.nan, 1.0, 1.0)], 0)))

    @property
    def state(self) -> Any:
        self._flush()
        return self._state

    @property
    def inputs(self) -> tuple[float, float, float]:
        """``(loss, step_time_s, cost_s)`` of the last :meth:`decide` call (reads the loss)."""
        loss, step_time, cost = self._last
        return read_loss(loss), step_time, cost

    @state.setter
    def state(self, value: Any) -> None:
        self._pending = []
        self._state = jax.device_put(value, self._device)
        self._next_check = int(next_check(self._state))

    def decide(self, step: int, *, loss: Any, step_time_s: float) -> bool:
        """Feeds one step to the policy and returns its decision.

        Before the first measured save the checkpoint cost is NaN, which policies read as "not
        measured yet" and replace with their ``cost_prior_s``. In a multi-process job the
        measured values are broadcast from process 0 before they reach the policy (once per
        check, for all the steps it covers), so every process runs the same updates on the
        same inputs and takes the same decisions; the check steps themselves follow from the
        same state, so all processes agree on them too.

        Args:
          step: the completed training step (1-based).
          loss: its loss: a number or a staged one-element array (see :func:`stage_loss`); it
            is read only at the next check (NaN/inf are passed on; policies ignore them).
          step_time_s: its measured duration in seconds.

        Returns:
          True when the policy says to checkpoint after this step.
        """
        self.step = step
        self._last = (loss, float(step_time_s), float(self.cost_s))
        self._pending.append((step, *self._last))
        if step < self._next_check:
            return False
        return self._flush()

    def _flush(self) -> bool:
        """Feeds the recorded steps to the policy; the decision of the last one."""
        if not self._pending:
            return False
        rows = [(s, read_loss(loss), t, c) for s, loss, t, c in self._pending]
        self._pending = []
        values = np.asarray([r[1:] for r in rows], np.float32)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            values = np.asarray(multihost_utils.broadcast_one_to_all(values))
        rows = [(s, *v) for (s, *_), v in zip(rows, values.tolist(), strict=True)]
        save = False
        for start in range(0, len(rows), BATCH):
            chunk = rows[start : start + BATCH]
            save, self._state = self._update_many(
                self._state, _batch(chunk, len(chunk), self.mtbf_s, self.recovery_s)
            )
        self._next_check = int(next_check(self._state))
        return bool(save)

    def compile_count(self) -> int:
        """How many times the batched update has been compiled (1 after the first step)."""
        return self._update_many._cache_size()

    def snapshot(self, loss: Any) -> dict[str, Any]:
        """Captures what the checkpoint of the current step records (cheap; no device sync).

        Args:
          loss: the current step's loss as given by the user (read later, off the train loop).
        """
        return {
            "leaves": jax.tree.leaves(self.state),  # feeds the recorded steps first
            "step": self.step,
            "step_time_s": self.step_time_s,
            "loss": loss,
        }

    def to_json(self, snapshot: dict[str, Any], *, cost_s: float) -> dict[str, Any]:
        """Serialises a :meth:`snapshot`, with the measured cost of the save that records it."""
        return {
            "format": _FORMAT,
            "policy_state": [_encode(leaf) for leaf in snapshot["leaves"]],
            "step": snapshot["step"],
            "step_time_s": snapshot["step_time_s"],
            "cost_s": cost_s,
            "loss": read_loss(snapshot["loss"]),
        }

    def load_json(self, data: dict[str, Any], *, where: str) -> None:
        """Adopts state written by :meth:`to_json`.

        Args:
          data: the decoded JSON.
          where: the file it came from, for error messages.

        Raises:
          ValueError: the data was written by something else or by a different policy.
        """
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"{where}: not a cocijax policy state (expected format {_FORMAT}).")
        template, treedef = jax.tree.flatten(self.policy.init())
        entries = data["policy_state"]
        if len(entries) != len(template):
            raise ValueError(
                f"{where}: policy state has {len(entries)} leaves on disk but "
                f"{len(template)} for this policy."
            )
        leaves = [
            _decode(entry, like, f"{where} (leaf {i})")
            for i, (entry, like) in enumerate(zip(entries, template, strict=True))
        ]
        self.state = jax.tree.unflatten(treedef, leaves)
        self.step = None if data["step"] is None else int(data["step"])
        self.step_time_s = float(data["step_time_s"])
        self.cost_s = float(data["cost_s"])
        self.loss = float(data["loss"])


def _batch(
    rows: list[tuple[int, float, float, float]], valid: int, mtbf=math.nan, recovery=math.nan
) -> Batch:
    """A :class:`cj.policies.Batch` of ``BATCH`` rows, the first ``valid`` of them real."""
    pad = [(0, math.nan, math.nan, math.nan)] * (BATCH - len(rows))
    steps, losses, times, costs = zip(*(rows + pad), strict=True)
    f32 = lambda v: np.asarray(v, np.float32)
    return Batch(
        step=np.asarray(steps, np.int32),
        loss=f32(losses),
        step_time_s=f32(times),
        checkpoint_cost_s=f32(costs),
        mtbf_s=np.full(BATCH, mtbf, np.float32),
        recovery_s=np.full(BATCH, recovery, np.float32),
        valid=np.arange(BATCH) < valid,
    )
