"""Running a policy over a recorded loss history."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cocijax.policies._base import Policy, Seen
from cocijax.sim._levels import Schedule


def plan(
    losses,
    policy: Policy,
    *,
    step_time_s,
    checkpoint_cost_s,
    mtbf_s=math.nan,
    recovery_s=math.nan,
    persist_cost_s=math.nan,
    machine_mtbf_s=math.nan,
    machine_recovery_s=math.nan,
) -> np.ndarray | Schedule:
    """Runs ``policy`` online over ``losses`` and returns the steps it saves at.

    Step ``i`` (1-based) sees ``losses[i - 1]`` and only the history before it: the policy as
    it would run in training if told each step's loss at once. (:class:`cocijax.CheckpointManager`
    passes each loss and step time one call late so as not to wait for the device, so its
    decisions can differ slightly.) The loop is one ``jax.lax.scan`` over the history.

    Args:
      losses: 1-D array of per-step losses (NaN/inf allowed).
      policy: a :class:`Policy`.
      step_time_s: seconds per step, a scalar or one value per step.
      checkpoint_cost_s: stall seconds per save, a scalar or one value per step.
      mtbf_s: the MTBF a caller has measured, a scalar or one value per step (NaN: unknown);
        used by policies built without ``mtbf_s``.
      recovery_s: likewise for the recovery time.
      persist_cost_s: two-level policies (``policy.levels == 2``): the stall of a level-2
        save, a scalar or one value per step (``checkpoint_cost_s`` is then a level-1 save's).
      machine_mtbf_s: two-level policies: the machine MTBF a caller has measured, likewise.
      machine_recovery_s: two-level policies: the recovery time from a level-2 save, likewise.

    Returns:
      int64 array of the 1-based steps after which the policy saves, increasing; for a
      two-level policy, a :class:`cocijax.sim.Schedule` (those steps and each save's level),
      which :mod:`cocijax.sim` scores.

    Raises:
      ValueError: if ``losses`` is not 1-D or a per-step array has the wrong length.

    Example:
      >>> import numpy as np, cocijax as cj
      >>> cj.plan(np.ones(6), cj.policies.fixed(2), step_time_s=1.0, checkpoint_cost_s=1.0)
      array([2, 4, 6])
    """
    y = np.asarray(losses, dtype=np.float32)
    if y.ndim != 1:
        raise ValueError(f"losses must be 1-D, got shape {y.shape}.")
    n = y.size
    if n == 0:
        return np.zeros(0, np.int64)

    def per_step(name, value):
        a = np.asarray(value, dtype=np.float32)
        if a.ndim == 0:
            return np.full(n, a, np.float32)
        if a.shape != (n,):
            raise ValueError(f"{name} must be a scalar or have shape ({n},), got {a.shape}.")
        return a

    xs = (
        np.arange(1, n + 1, dtype=np.int32),
        y,
        per_step("step_time_s", step_time_s),
        per_step("checkpoint_cost_s", checkpoint_cost_s),
        per_step("mtbf_s", mtbf_s),
        per_step("recovery_s", recovery_s),
        per_step("persist_cost_s", persist_cost_s),
        per_step("machine_mtbf_s", machine_mtbf_s),
        per_step("machine_recovery_s", machine_recovery_s),
    )
    levels = np.asarray(_run(policy, xs))
    steps = np.flatnonzero(levels).astype(np.int64) + 1
    if getattr(policy, "levels", 1) == 2:
        return Schedule(steps, levels[steps - 1].astype(np.int64))
    return steps


def _run(policy: Policy, xs):
    # Policies are NamedTuples of closures: hashable, so they can be static jit arguments and a
    # repeated plan with the same policy object reuses the compiled scan.
    return _scan(policy, *(jnp.asarray(x) for x in xs))


def _caller(policy: Policy) -> Callable[..., Any]:
    """``policy.update`` as a function of every :class:`Seen` input, returning a level.

    Inputs the update does not take are dropped: policies written before ``mtbf_s`` and
    ``recovery_s`` existed (``update(state, *, step, loss, step_time_s, checkpoint_cost_s)``),
    and one-level policies that take no two-level inputs, keep working. The decision comes back
    as a 0-d int32 level (see :class:`~cocijax.policies.UpdateFn`): a one-level policy's
    ``True`` is a level-2 save, since its every save is persisted.
    """
    try:
        params = inspect.signature(policy.update).parameters
    except (TypeError, ValueError):
        params = None
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = set(Seen._fields)
    else:
        takes = set(params) & set(Seen._fields)
    two_level = getattr(policy, "levels", 1) == 2

    def update(state, **inputs):
        save, state = policy.update(state, **{k: v for k, v in inputs.items() if k in takes})
        level = jnp.asarray(save, jnp.int32) if two_level else jnp.where(save, 2, 0)
        return level.astype(jnp.int32), state

    return update


@functools.partial(jax.jit, static_argnums=0)
def _scan(policy, *xs):
    """The level decided at each step, for the inputs ``xs`` (one array per field of Seen)."""
    update = _caller(policy)

    def body(state, x):
        level, state = update(state, **Seen(*x)._asdict())
        return state, level

    _, levels = jax.lax.scan(body, policy.init(), xs)
    return levels


class Batch(NamedTuple):
    """Inputs of several consecutive ``update`` calls, padded to a fixed length.

    Every field has shape ``(length,)``; rows where ``valid`` is false are padding and leave the
    state unchanged.
    """

    step: jnp.ndarray  # int32
    loss: jnp.ndarray  # float32
    step_time_s: jnp.ndarray  # float32
    checkpoint_cost_s: jnp.ndarray  # float32
    mtbf_s: jnp.ndarray  # float32
    recovery_s: jnp.ndarray  # float32
    valid: jnp.ndarray  # bool
    # Two-level inputs (see Seen), NaN for one-level callers.
    persist_cost_s: jnp.ndarray | None = None  # float32
    machine_mtbf_s: jnp.ndarray | None = None  # float32
    machine_recovery_s: jnp.ndarray | None = None  # float32


def update_many(policy: Policy) -> Callable[[Any, Batch], tuple[jnp.ndarray, Any]]:
    """A jitted function feeding a :class:`Batch` of steps to ``policy.update`` in order.

    Exactly the state and decisions of one ``update`` call per valid row; it returns the
    decision of the last valid row, as a 0-d int32 level (0 none, 1 or 2; a one-level policy's
    saves are level 2), and the new state. A caller that skips the policy on the
    steps before ``next_check(state)`` (where ``update`` cannot save) feeds them here together
    with the check step, in one dispatch instead of one per step.

    Example:
      >>> import numpy as np, cocijax as cj
      >>> from cocijax.policies import Batch, update_many
      >>> policy = cj.policies.fixed(3)
      >>> run = update_many(policy)
      >>> f = lambda v, dt=np.float32: np.full(4, v, dt)
      >>> batch = Batch(np.arange(1, 5, dtype=np.int32), f(2.0), f(1.0), f(0.5), f(np.nan),
      ...               f(np.nan), np.array([True, True, True, False]))
      >>> level, state = run(policy.init(), batch)
      >>> int(level), int(next_check(state))
      (2, 6)
    """
    return jax.jit(functools.partial(_update_many, policy))


def _update_many(policy: Policy, state: Any, batch: Batch) -> tuple[jnp.ndarray, Any]:
    update = _caller(policy)

    # Both branches of the cond return the state with the leaf types it came in with.
    like = lambda tree: jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), tree, state)

    def feed(carry, row):
        nan = jnp.full((), jnp.nan, jnp.float32)
        inputs = {k: nan if v is None else v for k, v in row._asdict().items() if k != "valid"}
        level, new_state = update(carry[0], **inputs)
        return like(new_state), level

    def body(carry, row):
        # A padding row is skipped, not computed and discarded: fed NaNs at step 0, a policy
        # may take its most expensive branch (COCI: a dispatch of one step took 20 ms, now 0.5).
        keep = lambda carry, row: (like(carry[0]), carry[1])
        return jax.lax.cond(row.valid, feed, keep, carry, row), None

    (state, level), _ = jax.lax.scan(body, (like(state), jnp.zeros((), jnp.int32)), batch)
    return level, state


def next_check(state: Any) -> jnp.ndarray:
    """The first step at which ``update`` may save (1 for states that do not say).

    Every policy of :mod:`cocijax.policies` keeps it in ``state.clock.next_check``; a policy
    state of your own without it is checked at every step.
    """
    next_step = getattr(getattr(state, "clock", None), "next_check", None)
    # NumPy, not jnp, for the default: a jnp constant built eagerly compiles on first use.
    return np.ones((), np.int32) if next_step is None else next_step
