"""Running a policy over a recorded loss history."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cocijax.policies._base import Policy


def plan(losses, policy: Policy, *, step_time_s, checkpoint_cost_s) -> np.ndarray:
    """Runs ``policy`` online over ``losses`` and returns the steps it saves at.

    Step ``i`` (1-based) sees ``losses[i - 1]`` and only the history before it: the policy as
    it would run in training if told each step's loss at once. (:class:`cocijax.CheckpointManager`
    passes each loss and step time one call late so as not to wait for the device, so its
    decisions can differ slightly.) The loop is a ``jax.lax.scan``, so a 20k-step history
    plans in well under a second after compilation.

    Args:
      losses: 1-D array of per-step losses (NaN/inf allowed).
      policy: a :class:`Policy`.
      step_time_s: seconds per step, a scalar or one value per step.
      checkpoint_cost_s: stall seconds per save, a scalar or one value per step.

    Returns:
      int64 array of the 1-based steps after which the policy saves, increasing.

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
    )
    saves = np.asarray(_run(policy, xs))
    return np.flatnonzero(saves).astype(np.int64) + 1


def _run(policy: Policy, xs):
    # Policies are NamedTuples of closures: hashable, so they can be static jit arguments and a
    # repeated plan with the same policy object reuses the compiled scan.
    return _scan(policy, *(jnp.asarray(x) for x in xs))


@functools.partial(jax.jit, static_argnums=0)
def _scan(policy, steps, losses, step_times, costs):
    def body(state, x):
        step, loss, step_time, cost = x
        save, state = policy.update(
            state, step=step, loss=loss, step_time_s=step_time, checkpoint_cost_s=cost
        )
        return state, jnp.asarray(save, bool)

    _, saves = jax.lax.scan(body, policy.init(), (steps, losses, step_times, costs))
    return saves
