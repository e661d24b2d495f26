"""Shared by the manager and SaveDecisionPolicy tests: a scripted clock, a recording policy."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import cocijax as cj


class FakeClock:
    """Returns ``t`` and then adds ``tick``: every clock reading costs ``tick`` seconds."""

    def __init__(self, tick: float = 0.0):
        self.t = 100.0
        self.tick = tick

    def __call__(self) -> float:
        t = self.t
        self.t += self.tick
        return t

    def advance(self, dt: float) -> None:
        self.t += dt


class Seen(NamedTuple):
    loss: jax.Array  # shape=(), float32, last loss fed
    step_time: jax.Array  # shape=(), float32, last step time fed
    cost: jax.Array  # shape=(), float32, last checkpoint cost fed
    calls: jax.Array  # shape=(), int32


def recording(every: int, *, uses_cost: bool = True) -> cj.policies.Policy:
    """Saves every ``every`` steps and records the inputs of its last call in its state.

    ``uses_cost=False`` says its decisions do not use the cost: no early save measures one.
    """

    def init():
        nan = jnp.float32(jnp.nan)
        return Seen(nan, nan, nan, jnp.int32(0))

    def update(state, *, step, loss, step_time_s, checkpoint_cost_s):
        new = Seen(
            jnp.float32(loss),
            jnp.float32(step_time_s),
            jnp.float32(checkpoint_cost_s),
            state.calls + 1,
        )
        return step % every == 0, new

    return cj.policies.Policy(init, update, uses_cost=uses_cost)
