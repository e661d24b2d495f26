"""The JSON a checkpoint records of its policy: the policy state and the driver's measurements.

A restarted job continues the same schedule from it: the policy state leaf by leaf (raw bytes,
every float bit exact, keyed by the leaf's path so that a policy whose state gained fields still
loads an older state), the step, the measured step time and save cost and the recent
measurements their robust values rest on (:class:`~cocijax.core._policy_inputs.RecentTimes`),
the saved step's loss and the job's history. :meth:`PolicyDriver.to_json
<cocijax.core._driver.PolicyDriver.to_json>` and ``load_json`` write and adopt it through
:func:`to_json` and :func:`from_json`.
"""

from __future__ import annotations

import base64
from typing import Any, NamedTuple

import jax
import numpy as np

from cocijax.core._policy_inputs import COST_JUMP, RecentTimes, read_loss, saved_times

__all__ = ["FORMAT", "FORMATS", "SavedState", "from_json", "is_policy_state", "to_json"]

# /2 records each leaf's key path, so a policy whose state gained fields still loads older
# states (new fields start at their initial values); /1 (cocijax 0.1) matched by position.
FORMAT = "cocijax.policy_state/2"
FORMATS = ("cocijax.policy_state/1", FORMAT)


class SavedState(NamedTuple):
    """What :func:`from_json` read: everything a driver adopts to continue a schedule."""

    policy_state: Any  # the policy's state, its pytree as ``policy.init()`` makes it
    step: int | None  # the step it was saved at
    step_times: RecentTimes  # the recent step times
    costs: RecentTimes  # the recent save costs (capped at ``COST_JUMP`` times the estimate)
    cost_s: float  # the measured cost of the last save (negative: none measured)
    loss: float  # the saved step's loss
    # A two-level policy's recent level-1 save costs (``costs`` are the level-2 ones).
    level1_costs: RecentTimes = RecentTimes(jump=COST_JUMP)


def is_policy_state(data: Any) -> bool:
    """Whether ``data`` (decoded JSON) says it is a policy state of a format this version reads."""
    return isinstance(data, dict) and data.get("format") in FORMATS


def to_json(snapshot: dict[str, Any], *, cost_s: float | None = None) -> dict[str, Any]:
    """Serialises a :meth:`PolicyDriver.snapshot <cocijax.core._driver.PolicyDriver.snapshot>`.

    Args:
      snapshot: what the driver captured.
      cost_s: the measured cost of the save that records it (taken after the snapshot);
        None when the snapshot holds every cost measured.

    Returns:
      The JSON-serialisable record (reads the snapshot's loss: may wait for the device).
    """
    costs = snapshot["costs"].copy()
    level1 = snapshot.get("level1_costs", RecentTimes()).copy()
    if cost_s is None:
        cost_s = snapshot["cost_s"]
    else:  # as the costs are once this save's is measured
        (level1 if snapshot.get("level") == 1 else costs).add(cost_s, snapshot["cost_reference"])
    return {
        "format": FORMAT,
        "state_type": snapshot["state_type"],
        "policy_state": [
            {"path": jax.tree_util.keystr(path), **_encode(leaf)}
            for path, leaf in snapshot["leaves"]
        ],
        "step": snapshot["step"],
        "step_time_s": snapshot["step_times"].value,
        "cost_s": max(cost_s, 0.0),
        # What the robust inputs rest on, so that a restarted job feeds the same values.
        "recent": {
            "step_time_s": snapshot["step_times"].values,
            "cost_s": costs.values,
            "level1_cost_s": level1.values,
        },
        "loss": read_loss(snapshot["loss"]),
        "history": snapshot["history"],
    }


def from_json(data: Any, policy: Any, *, where: str) -> SavedState:
    """Reads a record written by :func:`to_json` for ``policy``, checking all of it.

    Args:
      data: the decoded JSON.
      policy: the policy that is to continue the schedule (its ``init`` gives the state's
        structure, and the values of fields the record lacks).
      where: the file it came from, for error messages.

    Returns:
      The :class:`SavedState`; nothing is adopted here.

    Raises:
      ValueError: the data was written by something else or by a different policy, or is
        damaged.
    """
    if not is_policy_state(data):
        raise ValueError(f"{where}: not a cocijax policy state (expected format {FORMAT}).")
    # Shapes and dtypes only: running init eagerly compiled every operation in it (COCI's:
    # ~0.45 s in a fresh process); its values are needed only for fields missing on disk.
    initial = jax.eval_shape(policy.init)
    template, treedef = jax.tree_util.tree_flatten_with_path(initial)
    paths = [jax.tree_util.keystr(path) for path, _ in template]
    entries = data.get("policy_state")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{where}: the policy state on disk is not a list of leaves.")
    state_type = type(initial).__name__
    if data.get("state_type", state_type) != state_type:  # /1 did not record it
        raise ValueError(
            f"{where}: the policy state on disk is a {data['state_type']}, this policy's a "
            f"{state_type}: it was saved by another policy"
        )
    by_path = _entries_by_path(entries, paths, where)
    try:
        # Fields added to the policy since the state was saved keep their initial values.
        values = jax.tree.leaves(policy.init()) if set(paths) - by_path.keys() else None
        leaves = [
            _decode(by_path[path], like, f"{where} (leaf {path})") if path in by_path else values[i]
            for i, (path, (_, like)) in enumerate(zip(paths, template, strict=True))
        ]
        step = None if data["step"] is None else int(data["step"])
        step_time, cost, loss = (float(data[k]) for k in ("step_time_s", "cost_s", "loss"))
        recent = data.get("recent") or {}
        step_times = RecentTimes(saved_times(recent.get("step_time_s"), step_time))
        costs = RecentTimes(saved_times(recent.get("cost_s"), cost), jump=COST_JUMP)
        level1 = RecentTimes(saved_times(recent.get("level1_cost_s"), None), jump=COST_JUMP)
    except (KeyError, TypeError, AttributeError, OverflowError, ValueError) as e:
        raise ValueError(f"{where}: the policy state on disk is malformed ({e!r})") from e
    policy_state = jax.tree.unflatten(treedef, leaves)
    return SavedState(policy_state, step, step_times, costs, cost, loss, level1)


def _entries_by_path(entries: list[dict], paths: list[str], where: str) -> dict[str, dict]:
    """The record's leaves by key path: as recorded (/2), or matched by position (/1).

    Raises:
      ValueError: the record has a field the policy's state does not, or (/1) another number
        of leaves: it was saved by another policy.
    """
    if all("path" in entry for entry in entries):
        by_path = {entry["path"]: entry for entry in entries}
        unknown = sorted(by_path.keys() - set(paths))
        if unknown:
            raise ValueError(
                f"{where}: the policy state on disk has fields this policy does not "
                f"({', '.join(unknown[:3])}): it was saved by another policy"
            )
        return by_path
    if len(entries) == len(paths):
        return dict(zip(paths, entries, strict=True))
    raise ValueError(
        f"{where}: the policy state on disk has {len(entries)} leaves, this policy "
        f"{len(paths)}: it was saved by another policy or an older cocijax"
    )


def _encode(leaf: Any) -> dict[str, Any]:
    """One leaf of the policy state as its dtype, shape and raw bytes (base64)."""
    array = np.asarray(leaf)
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        # Raw bytes keep NaN payloads and every float bit exact, unlike a JSON number.
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
    }


def _decode(entry: dict[str, Any], like: jax.ShapeDtypeStruct, where: str) -> np.ndarray:
    """The leaf :func:`_encode` wrote, checked against the policy's ``like``.

    Raises:
      ValueError: its dtype or shape is not ``like``'s.
    """
    dtype = jax.numpy.dtype(entry["dtype"])  # knows bfloat16, unlike np.dtype
    shape = tuple(entry["shape"])
    if dtype != like.dtype or shape != like.shape:
        raise ValueError(
            f"{where}: policy state leaf is {dtype}{list(shape)} on disk but "
            f"{like.dtype}{list(like.shape)} for this policy."
        )
    raw = base64.b64decode(entry["data"])
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
