"""Two-level policies: a level-1 save (cost ``C1``, e.g. to memory) survives a process failure,
a level-2 save (cost ``C2``, e.g. to durable storage) also survives a machine failure.

``coci_two_level`` is a pair of ``coci`` planners, one per level, each seeing the costs and
failures of its level: the level-1 one ``checkpoint_cost_s``, ``mtbf_s``
(process failures, the ones a level-1 save recovers from) and ``recovery_s``; the level-2 one
``persist_cost_s``, ``machine_mtbf_s`` and ``machine_recovery_s``. A step's level is 2 when the
level-2 policy saves, else 1 when the level-1 one does. A level-2 save is a level-1 save too:
the level-1 policy is then told it saved (its work since the last save and its clock reset, and
it plans anew at its next step), so that it does not save again right after.

The classic rule, :func:`young_two_level`, is Young's interval at each level. The other
candidate, the first-order optimal pattern of Benoit et al. (``k`` equal level-1 intervals, then
a level-2 save, ``k = sqrt((C2 - C1) M2 / (C1 M1))``), did as well or worse on the two-level
benchmark: median weighted overhead +0.0% on the shared curves, +0.5 to +0.9% on the others
(BENCHMARKS.md).

References:
  Di, Bouguerra, Bautista-Gomez, Cappello, `Optimization of multi-level checkpoint model
  for large scale HPC applications <https://doi.org/10.1109/IPDPS.2014.122>`_, IPDPS 2014.
  Benoit, Cavelan, Le Fèvre, Robert, Sun, `Towards optimal multi-level checkpointing
  <https://doi.org/10.1109/TC.2016.2643660>`_, IEEE Trans. Computers 2017.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from cocijax.policies import _base
from cocijax.policies._base import Policy
from cocijax.policies._classic import young_interval
from cocijax.policies._coci import DEFAULT_PRIOR_RECOVERY_S, CociState, coci

# The machine MTBF assumed before one is given or measured, as a multiple of the process one's
# prior: losing a machine is rarer than losing a process.
PRIOR_MACHINE_MTBF_FACTOR = 4.0


class LevelsState(NamedTuple):
    """State of :func:`coci_two_level`: the state of each level's ``coci``.

    ``clock`` is the level-1 policy's, with ``next_check`` the sooner of the two levels' (see
    :func:`cocijax.policies.next_check`).
    """

    clock: _base.Clock
    local: CociState  # the level-1 planner's
    persist: CociState  # the level-2 planner's


def coci_two_level(
    mtbf_s: float | None = None,
    recovery_s: float | None = None,
    time_weight: float = 0.25,
    total_steps: int | None = None,
    *,
    machine_mtbf_s: float | None = None,
    machine_recovery_s: float | None = None,
    prior_mtbf_s: float | None = None,
    prior_machine_mtbf_s: float | None = None,
    prior_recovery_s: float = DEFAULT_PRIOR_RECOVERY_S,
    prior_machine_recovery_s: float = DEFAULT_PRIOR_RECOVERY_S,
    cost_prior_s: float | None = None,
    persist_cost_prior_s: float | None = None,
    **options,
) -> Policy:
    """:func:`~cocijax.policies.coci` at two levels (see the module docstring).

    Both levels weigh lost work by the convergence weight ``w`` of :func:`coci` and plan by
    its exact receding-horizon DP, each with its level's costs and failures.

    Args:
      mtbf_s: mean time between process failures (level-1 recoverable), or ``None`` for the
        caller's ``update(..., mtbf_s=...)``, ``prior_mtbf_s`` until then.
      recovery_s: seconds to recover from a process failure (from a level-1 save), or
        ``None`` for the caller's, ``prior_recovery_s`` until then.
      time_weight: as in :func:`coci`.
      total_steps: as in :func:`coci`.
      machine_mtbf_s: mean time between machine failures (only a level-2 save recovers from
        one), or ``None`` for the caller's ``update(..., machine_mtbf_s=...)``,
        ``prior_machine_mtbf_s`` until then.
      machine_recovery_s: seconds to recover from a machine failure, or ``None`` for the
        caller's, ``prior_machine_recovery_s`` until then.
      prior_mtbf_s: as in :func:`coci`.
      prior_machine_mtbf_s: the machine MTBF assumed before one is known; default
        ``PRIOR_MACHINE_MTBF_FACTOR`` (4) times the process one's prior.
      prior_recovery_s, prior_machine_recovery_s: recovery times assumed until known, each
        capped at a quarter of its MTBF as in :func:`coci`.
      cost_prior_s: the level-1 save cost assumed until one is measured, as in :func:`coci`.
      persist_cost_prior_s: the same for a level-2 save (``update(..., persist_cost_s=...)``).
      **options: the other keyword arguments of :func:`coci` (``max_weight``, ``decay``, ...),
        for both levels.

    Returns:
      A :class:`~cocijax.policies.Policy` with ``levels == 2``.

    Raises:
      ValueError: naming an argument that is out of range.

    Example:
      >>> import cocijax as cj
      >>> policy = cj.policies.coci_two_level(2 * 3600.0, 15.0, total_steps=3000,
      ...                                     machine_mtbf_s=12 * 3600.0, machine_recovery_s=120.0)
      >>> policy.levels  # cj.plan(losses, policy, ...) returns a cj.sim.Schedule
      2
    """
    prior_machine = _prior_machine(prior_mtbf_s, prior_machine_mtbf_s)
    local = coci(
        mtbf_s, recovery_s, time_weight, total_steps, prior_mtbf_s=prior_mtbf_s,
        prior_recovery_s=prior_recovery_s, cost_prior_s=cost_prior_s, **options,
    )  # fmt: skip
    persist = coci(
        machine_mtbf_s, machine_recovery_s, time_weight, total_steps, prior_mtbf_s=prior_machine,
        prior_recovery_s=prior_machine_recovery_s, cost_prior_s=persist_cost_prior_s, **options,
    )  # fmt: skip
    return _two_level(local, persist)


class YoungLevelsState(NamedTuple):
    """State of :func:`young_two_level`."""

    clock: _base.Clock  # since a save of either level; smooths the level-1 save cost
    persist: _base.Clock  # since a level-2 save; smooths its cost (``persist_cost_s``)


def young_two_level(
    mtbf_s: float | None = None,
    machine_mtbf_s: float | None = None,
    *,
    prior_mtbf_s: float | None = None,
    prior_machine_mtbf_s: float | None = None,
    cost_prior_s: float | None = None,
    persist_cost_prior_s: float | None = None,
) -> Policy:
    """The classic two-level rule: Young's interval at each level.

    A level-1 save once ``sqrt(2 C1 M1)`` seconds of training passed since the last save of
    either level, a level-2 save once ``sqrt(2 C2 M2)`` passed since the last level-2 save
    (``M1``, ``M2`` the process and machine MTBFs), each rounded to the nearest step and
    recomputed at each check from the smoothed costs, as :func:`~cocijax.policies.young`
    does with its one interval.

    Args:
      mtbf_s: mean time between process failures, or ``None`` for the caller's
        (``update(..., mtbf_s=...)``), ``prior_mtbf_s`` until then.
      machine_mtbf_s: mean time between machine failures, or ``None`` for the caller's
        (``update(..., machine_mtbf_s=...)``), ``prior_machine_mtbf_s`` until then.
      prior_mtbf_s: as in :func:`~cocijax.policies.young`.
      prior_machine_mtbf_s: as in :func:`coci_two_level`.
      cost_prior_s: the level-1 save cost assumed until one is measured.
      persist_cost_prior_s: the level-2 save cost assumed until one is measured
        (``update(..., persist_cost_s=...)``).

    Returns:
      A :class:`~cocijax.policies.Policy` with ``levels == 2``.

    Raises:
      ValueError: if an argument is not positive.

    Example:
      >>> import numpy as np, cocijax as cj
      >>> policy = cj.policies.young_two_level(2 * 3600.0, 12 * 3600.0)
      >>> s = cj.plan(np.ones(2000), policy, step_time_s=5.0, checkpoint_cost_s=0.5,
      ...             persist_cost_s=30.0)
      >>> np.diff(s.steps)[:3].tolist(), np.diff(s.steps[s.levels == 2])[:2].tolist()
      ([17, 17, 17], [322, 322])

    References:
      Young, `A first order approximation to the optimum checkpoint interval
      <https://doi.org/10.1145/361147.361115>`_, CACM 1974, per level as in the two-level
      models of Di et al. and Benoit et al. (module docstring).
    """
    given1, prior1 = _base.check_mtbf(mtbf_s, prior_mtbf_s)
    given2 = (
        None if machine_mtbf_s is None else _base.check_positive("machine_mtbf_s", machine_mtbf_s)
    )
    prior2 = _prior_machine(prior_mtbf_s, prior_machine_mtbf_s)
    prior_c1 = _base.check_cost_prior(cost_prior_s)
    prior_c2 = _base.check_cost_prior(persist_cost_prior_s)

    def init() -> YoungLevelsState:
        return YoungLevelsState(_base.clock_init(), _base.clock_init())

    def rule(state: YoungLevelsState, seen: _base.Seen):
        clock, _, _ = _base.clock_tick(state.clock, seen)
        persist, _, _ = _base.clock_tick(
            state.persist, seen._replace(checkpoint_cost_s=seen.persist_cost_s)
        )
        tau, c1 = _base.smoothed(clock, prior_c1)
        _, c2 = _base.smoothed(persist, prior_c2)
        m1 = _base.resolve(given1, seen.mtbf_s, prior1)
        m2 = _base.resolve(given2, seen.machine_mtbf_s, prior2)
        left1 = young_interval(c1, m1) - 0.5 * tau - clock.since_save
        left2 = young_interval(c2, m2) - 0.5 * tau - persist.since_save
        check = _base.checking(clock, seen.step)
        persisted = check & (left2 <= 0)
        save = persisted | (check & (left1 <= 0))
        # Seconds to the next save of either level, as young() counts them.
        after = jnp.minimum(
            jnp.where(save, left1 + clock.since_save, left1),
            jnp.where(persisted, left2 + persist.since_save, left2),
        )
        next_check = _base.halfway(seen.step, after / tau)
        level = jnp.where(persisted, 2, jnp.where(save, 1, 0)).astype(jnp.int32)
        return level, YoungLevelsState(
            _base.clock_saved(clock, save, seen.step, next_check),
            _base.clock_saved(persist, persisted, seen.step, next_check),
        )

    return _base.make_policy(
        init, rule, mtbf_s=given1, cost_prior_s=None if cost_prior_s is None else prior_c1, levels=2
    )


def _prior_machine(prior_mtbf_s: float | None, prior_machine_mtbf_s: float | None) -> float:
    if prior_machine_mtbf_s is not None:
        return _base.check_positive("prior_machine_mtbf_s", prior_machine_mtbf_s)
    _, prior = _base.check_mtbf(None, prior_mtbf_s)
    return PRIOR_MACHINE_MTBF_FACTOR * prior


def _saved(state: CociState, step) -> CociState:
    """A ``coci`` state told that it saved after ``step`` (a level-2 save): its clock's time
    since the last save and its work since then reset, and it plans anew at the next step
    (from the save, as after a save of its own)."""
    clock = state.clock._replace(
        since_save=jnp.zeros_like(state.clock.since_save),
        steps_since_save=jnp.zeros_like(state.clock.steps_since_save),
        next_check=jnp.minimum(state.clock.next_check, jnp.asarray(step, jnp.int32) + 1),
    )
    return state._replace(
        clock=clock,
        exposure=jnp.zeros_like(state.exposure),
        last_save=clock.last_step,
        plan_step=jnp.zeros_like(state.plan_step),
    )


def _two_level(local: Policy, persist: Policy) -> Policy:
    """The two-level policy of a level-1 and a level-2 ``coci`` (module docstring)."""

    def combined(local_state, persist_state) -> LevelsState:
        clock = local_state.clock._replace(
            next_check=jnp.minimum(local_state.clock.next_check, persist_state.clock.next_check)
        )
        return LevelsState(clock, local_state, persist_state)

    def init() -> LevelsState:
        return combined(local.init(), persist.init())

    def rule(state: LevelsState, seen: _base.Seen):
        common = dict(step=seen.step, loss=seen.loss, step_time_s=seen.step_time_s)
        save2, persist_state = persist.update(
            state.persist, checkpoint_cost_s=seen.persist_cost_s, mtbf_s=seen.machine_mtbf_s,
            recovery_s=seen.machine_recovery_s, **common,
        )  # fmt: skip
        save1, local_state = local.update(
            state.local, checkpoint_cost_s=seen.checkpoint_cost_s, mtbf_s=seen.mtbf_s,
            recovery_s=seen.recovery_s, **common,
        )  # fmt: skip
        told = _saved(local_state, seen.step)
        local_state = jax.tree.map(lambda a, b: jnp.where(save2 & ~save1, a, b), told, local_state)
        level = jnp.where(save2, 2, jnp.where(save1, 1, 0)).astype(jnp.int32)
        return level, combined(local_state, persist_state)

    return _base.make_policy(
        init,
        rule,
        total_steps=local.total_steps,
        mtbf_s=local.mtbf_s,
        recovery_s=local.recovery_s,
        cost_prior_s=local.cost_prior_s,
        levels=2,
    )
