"""The ``Policy`` type and the bookkeeping every policy shares.

A policy is a pair of pure functions, optax style: ``init() -> state`` and
``update(state, *, step, loss, step_time_s, checkpoint_cost_s, mtbf_s, recovery_s) ->
(save, state)``. ``step`` counts completed training steps (1-based) and ``save`` means
"checkpoint now, after this step". ``mtbf_s`` and ``recovery_s`` are optional: a caller that
measures them (the manager learns both from the job) passes its estimates, NaN meaning unknown;
a value given to the policy's constructor wins over them.

**Decisions at check steps.** Every state carries ``clock.next_check``: ``update`` returns
``save=False`` for every step before it, whatever its inputs. A caller may therefore skip the
policy on those steps and feed them later, in order, in one batch (:func:`update_many`), and take
exactly the decisions of a per-step loop; a skipped step costs it one integer comparison. Each
policy plans its checks from its own rule (a fixed interval knows its next multiple; a time
interval checks again half way to where the measured step time says it ends, so a decision is
late only when the steps suddenly become more than twice as long).

Step times and checkpoint costs are measured online by the caller and may vary from call to
call, so policies smooth them with an exponential moving average (:class:`Clock`) instead of
trusting one sample. A sample that is NaN/inf (or a non-positive step time, or a negative cost)
is treated as missing: the smoothed value is kept. Until the first valid cost arrives, a policy
assumes its ``cost_prior_s``.

Every call to ``update`` stands for one training step of wall time. A ``step`` that does not
exceed the largest one seen so far (a replay after a restore) is accepted: the time still counts
as exposure since the last save, so the policy keeps saving during the replay, but its loss is not
added to the convergence history again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from cocijax._validate import NONNEGATIVE, POSITIVE, UNIT, check

PolicyState = Any  # A pytree (NamedTuple) of jnp arrays.

# Smoothing factors of the moving averages: step times jitter from step to step, checkpoint
# costs are re-sent every step by a caller but change only when a save has been timed.
STEP_TIME_ALPHA = 0.05
COST_ALPHA = 0.05


class InitFn(Protocol):
    def __call__(self) -> PolicyState:
        """Returns the initial state of the policy."""


class UpdateFn(Protocol):
    def __call__(
        self,
        state: PolicyState,
        *,
        step,
        loss,
        step_time_s,
        checkpoint_cost_s,
        mtbf_s=math.nan,
        recovery_s=math.nan,
        persist_cost_s=math.nan,
        machine_mtbf_s=math.nan,
        machine_recovery_s=math.nan,
    ) -> tuple[jnp.ndarray, PolicyState]:
        """Observes one completed step and decides whether to save after it.

        Args:
          state: the policy state.
          step: completed training steps so far (1-based), int.
          loss: the training loss of this step; NaN/inf are ignored.
          step_time_s: measured seconds of this step (smoothed inside).
          checkpoint_cost_s: latest measured stall of one save, in seconds (smoothed inside);
            NaN when not measured yet.
          mtbf_s: the caller's estimate of the mean time between failures in seconds, or NaN;
            used only by policies built without ``mtbf_s``.
          recovery_s: the caller's estimate of the recovery time in seconds, or NaN; used only
            by policies built without ``recovery_s``.
          persist_cost_s: two-level policies only (see :class:`Policy`): the latest measured
            stall of a level-2 save, or NaN; ``checkpoint_cost_s`` is then a level-1 save's.
          machine_mtbf_s: two-level policies only: the caller's estimate of the mean time
            between the failures only a level-2 save recovers from (a machine lost), or NaN;
            ``mtbf_s`` is then that of the failures a level-1 save recovers from (a process).
          machine_recovery_s: two-level policies only: the recovery time from a level-2 save.

        Returns:
          ``(save, new_state)``. For a one-level policy ``save`` is a 0-d bool array; for a
          two-level policy a 0-d int32 level: 0 no save, 1 a level-1 save, 2 a level-2 save.
        """


class Policy(NamedTuple):
    """A checkpoint policy: pure ``init`` and ``update`` functions.

    ``update`` is jit-safe; the built-in policies jit it already, so an eager call is one
    dispatch. A training loop should still not call it at every step: :class:`Runner` skips the
    steps before each check (see the module docstring) and returns plain bools.

    Example:
      >>> import cocijax as cj
      >>> policy = cj.policies.young(mtbf_s=3600.0)
      >>> state = policy.init()
      >>> save, state = policy.update(state, step=1, loss=2.0, step_time_s=1.0,
      ...                             checkpoint_cost_s=10.0)
    """

    init: InitFn
    update: UpdateFn
    # The job's planned number of steps when the policy knows it (``coci(total_steps=...)``):
    # the managers then save that last step, so that a finished job keeps its final state.
    total_steps: int | None = None
    # The MTBF and recovery time the policy was built with, when given: they win over the
    # caller's, so a manager reports these as what the policy used (``mngr.measurements``).
    mtbf_s: float | None = None
    recovery_s: float | None = None
    # Whether its decisions depend on the checkpoint cost (``fixed``'s do not): a driver that
    # knows no cost yet then saves early to measure one (``cocijax.manager.PolicyDriver``).
    uses_cost: bool = True
    # The cost prior it was built with, when given: a manager then gives it none of its own.
    cost_prior_s: float | None = None
    # 1: ``save`` is a bool and every save is persisted. 2: ``save`` is a level, 0 (none), 1 (a
    # save that survives a process failure: the memory tier, or the local disk without one) or
    # 2 (a save that also survives the machine's loss: the disk roots and the durable tier).
    levels: int = 1


def check_policy(policy: Any) -> None:
    """Raises ``TypeError`` naming ``policy`` unless it is an ``(init, update)`` pair."""
    init, update = getattr(policy, "init", None), getattr(policy, "update", None)
    if not (callable(init) and callable(update)):
        raise TypeError(
            f"policy: expected a cocijax.policies.Policy (an (init, update) pair, e.g. "
            f"cj.policies.coci()), got {type(policy).__name__}."
        )


class Seen(NamedTuple):
    """The inputs of one ``update`` call (see :class:`UpdateFn`), as a policy's rule sees them.

    Scalars, traced inside the jitted ``update``; ``mtbf_s`` and ``recovery_s`` are the Python
    NaN when the caller does not give them.
    """

    step: jax.typing.ArrayLike  # shape=(), int: completed training steps (1-based)
    loss: jax.typing.ArrayLike  # shape=(), float: this step's loss (NaN/inf: ignored)
    step_time_s: jax.typing.ArrayLike  # shape=(), float: seconds of this step
    checkpoint_cost_s: jax.typing.ArrayLike  # shape=(), float: latest save stall (NaN: unknown)
    mtbf_s: jax.typing.ArrayLike = math.nan  # shape=(), float: the caller's MTBF (NaN: unknown)
    recovery_s: jax.typing.ArrayLike = math.nan  # shape=(), float: the caller's recovery time
    # Two-level inputs (see UpdateFn); NaN for one-level callers.
    persist_cost_s: jax.typing.ArrayLike = math.nan  # shape=(), float: level-2 save stall
    machine_mtbf_s: jax.typing.ArrayLike = math.nan  # shape=(), float: machine-loss MTBF
    machine_recovery_s: jax.typing.ArrayLike = math.nan  # shape=(), float: level-2 recovery


def make_policy(
    init: InitFn,
    rule: Callable[[PolicyState, Seen], tuple[Any, Any]],
    *,
    total_steps: int | None = None,
    mtbf_s: float | None = None,
    recovery_s: float | None = None,
    uses_cost: bool = True,
    cost_prior_s: float | None = None,
    levels: int = 1,
) -> Policy:
    """A :class:`Policy` from ``init`` and ``rule(state, seen) -> (save, state)``.

    The ``update`` it returns has the keyword signature of :class:`UpdateFn` and is jitted once,
    so that eager calls cost one dispatch; inside another ``jit`` (``plan``'s scan) it is inlined.
    The keyword arguments are recorded on the policy (see :class:`Policy`).
    """

    def update(state, **inputs):  # the signature of UpdateFn; Seen checks the names
        return rule(state, Seen(**inputs))

    return Policy(
        init, jax.jit(update), total_steps, mtbf_s, recovery_s, uses_cost, cost_prior_s, levels
    )


class Clock(NamedTuple):
    """Smoothed step time and cost, and time since the last save."""

    step_time: jnp.ndarray  # shape=(), float32, EMA of step seconds (NaN before a sample)
    cost: jnp.ndarray  # shape=(), float32, EMA of save stall seconds (NaN before a sample)
    elapsed: jnp.ndarray  # shape=(), float32, training seconds since init
    since_save: jnp.ndarray  # shape=(), float32, training seconds since the last save
    steps_since_save: jnp.ndarray  # shape=(), int32, calls since the last save
    last_step: jnp.ndarray  # shape=(), int32, largest step seen (0 before any)
    next_check: jnp.ndarray  # shape=(), int32, no save before this step (see the module doc)


def clock_init() -> Clock:
    return jax.device_put(clock_constants())


def clock_constants() -> Clock:
    """:func:`clock_init`'s values as NumPy scalars, for an ``init`` that places its state once.

    Built with NumPy, not jnp: run eagerly, each jnp constructor compiles an XLA program, and
    traced (``jax.eval_shape(policy.init)``, as a restarted job reads its saved state) each is
    an operation to trace.
    """
    nan, zero, izero = np.float32(np.nan), np.float32(0.0), np.int32(0)
    return Clock(nan, nan, zero, zero, izero, izero, np.int32(1))


def _ema(old, sample, valid, alpha):
    sample = jnp.asarray(sample, jnp.float32)
    new = jnp.where(jnp.isnan(old), sample, old + alpha * (sample - old))
    return jnp.where(valid, new, old)


def clock_tick(clock: Clock, seen: Seen):
    """Advances the clock by one step (before the save decision).

    Returns:
      ``(clock, is_new, dt)``: the new clock, whether ``step`` is new (larger than any seen
      before), and the seconds this step counted for (exact, unlike a difference of the
      float32 ``elapsed`` totals late in a long job).
    """
    st = jnp.asarray(seen.step_time_s, jnp.float32)
    st_ok = jnp.isfinite(st) & (st > 0)
    c = jnp.asarray(seen.checkpoint_cost_s, jnp.float32)
    c_ok = jnp.isfinite(c) & (c >= 0)
    step_time = _ema(clock.step_time, st, st_ok, STEP_TIME_ALPHA)
    cost = _ema(clock.cost, c, c_ok, COST_ALPHA)
    # The real duration of this step when it is valid, else the smoothed one; none before any
    # was measured (an untimed first step, e.g. a compilation, exposes no known work).
    dt = jnp.where(st_ok, st, jnp.where(jnp.isnan(step_time), 0.0, step_time))
    step = jnp.asarray(seen.step, jnp.int32)
    is_new = step > clock.last_step
    return (
        Clock(
            step_time=step_time,
            cost=cost,
            elapsed=clock.elapsed + dt,
            since_save=clock.since_save + dt,
            steps_since_save=clock.steps_since_save + 1,
            last_step=jnp.maximum(clock.last_step, step),
            # A replayed step (a restore, then the same steps again) is checked at once: the
            # plan made for the steps ahead of it no longer applies.
            next_check=jnp.where(is_new, clock.next_check, jnp.minimum(clock.next_check, step)),
        ),
        is_new,
        dt,
    )


def checking(clock: Clock, step) -> jnp.ndarray:
    """Whether ``step`` is a check step, where the policy may decide to save."""
    return jnp.asarray(step, jnp.int32) >= clock.next_check


def clock_saved(clock: Clock, save, step, next_check) -> Clock:
    """Resets the since-save counters where ``save``; sets the next check step.

    ``next_check`` is moved only on check steps (it is at least ``step + 1``): between checks it
    stays where the last check put it. While no step time has been measured (a manager's first
    step, or the first after a restore, is not timed) the next step is checked: a check planned
    from the 1 s step-time prior of :func:`smoothed` came 10 times too late for 10 s steps
    (measured: ``coci``'s first save at step 95 instead of 20 on a ``policy_bench`` curve).
    """
    step = jnp.asarray(step, jnp.int32)
    planned = jnp.maximum(jnp.asarray(next_check, jnp.int32), step + 1)
    planned = jnp.where(jnp.isnan(clock.step_time), step + 1, planned)
    return clock._replace(
        since_save=jnp.where(save, 0.0, clock.since_save),
        steps_since_save=jnp.where(save, 0, clock.steps_since_save),
        next_check=jnp.where(checking(clock, step), planned, clock.next_check),
    )


def halfway(step, steps_left) -> jnp.ndarray:
    """The check step half way to a save expected ``steps_left`` steps after ``step``."""
    half = jnp.floor(jnp.maximum(jnp.asarray(steps_left, jnp.float32), 0.0) / 2.0)
    return jnp.asarray(step, jnp.int32) + jnp.maximum(
        jnp.asarray(jnp.minimum(half, 2**30), jnp.int32), 1
    )


def resolve(given: float | None, estimate, prior, *, zero_ok: bool = False) -> jnp.ndarray:
    """``given`` if set, else the caller's ``estimate`` if valid, else ``prior``.

    Valid means finite and positive (or non-negative with ``zero_ok``, as a recovery time may be).
    """
    if given is not None:
        return jnp.float32(given)
    e = jnp.asarray(estimate, jnp.float32)
    ok = jnp.isfinite(e) & ((e >= 0) if zero_ok else (e > 0))
    return jnp.where(ok, e, jnp.asarray(prior, jnp.float32))


# Failure rate assumed when neither the user nor the caller's measurements give one: a device
# fails about once a day, and a job fails when any of its devices does (the COCI paper's
# data-parallel case), so the job's MTBF shrinks with the device count.
DEVICE_MTBF_S = 24 * 3600.0


def default_prior_mtbf_s() -> float:
    """``DEVICE_MTBF_S / jax.device_count()``: the MTBF assumed before one is learned."""
    import jax

    return DEVICE_MTBF_S / jax.device_count()


def check_mtbf(mtbf_s: float | None, prior_mtbf_s: float | None) -> tuple[float | None, float]:
    """Validates a constructor's ``mtbf_s``/``prior_mtbf_s`` pair; returns them as floats.

    Raises:
      ValueError: naming the argument that is not a positive finite number.
    """
    given = None if mtbf_s is None else check_positive("mtbf_s", mtbf_s)
    prior = (
        default_prior_mtbf_s()
        if prior_mtbf_s is None
        else check_positive("prior_mtbf_s", prior_mtbf_s)
    )
    return given, prior


# The checkpoint cost a policy assumes until one is measured, when its constructor is given
# none. The managers give one instead, from the state's size (``cocijax.core._policy_inputs``).
DEFAULT_COST_PRIOR_S = 10.0


def check_cost_prior(cost_prior_s: float | None) -> float:
    """The cost prior a policy uses: ``cost_prior_s``, or ``DEFAULT_COST_PRIOR_S`` for None.

    Raises:
      ValueError: naming ``cost_prior_s`` when it is not a finite number >= 0.
    """
    if cost_prior_s is None:
        return DEFAULT_COST_PRIOR_S
    return check_nonnegative("cost_prior_s", cost_prior_s)


def smoothed(clock: Clock, cost_prior_s: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(step seconds, cost seconds) with priors where nothing was measured yet."""
    tau = jnp.where(jnp.isnan(clock.step_time), 1.0, clock.step_time)
    cost = jnp.where(jnp.isnan(clock.cost), cost_prior_s, clock.cost)
    return tau, cost


def check_positive(name: str, value: float) -> float:
    """Returns ``float(value)`` or raises ``ValueError`` naming ``name``."""
    return check(name, value, POSITIVE)


def check_unit(name: str, value: float) -> float:
    """Returns ``float(value)`` if it is in [0, 1], else raises ``ValueError`` naming ``name``."""
    return check(name, value, UNIT)


def check_nonnegative(name: str, value: float) -> float:
    """Returns ``float(value)`` if it is finite and >= 0, else raises ``ValueError``."""
    return check(name, value, NONNEGATIVE)
