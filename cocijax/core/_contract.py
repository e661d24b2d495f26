"""What every cocijax checkpoint manager does, and the errors it raises.

:class:`ManagerProtocol` is the contract that :class:`cocijax.CheckpointManager` (JAX, Orbax)
and :class:`cocijax.torch.CheckpointManager` (PyTorch, DCP) both implement: call ``save`` after
every training step and a policy decides. Both raise the same errors for the same misuse:

* ``save`` or ``restore`` on a closed manager: :class:`ManagerClosedError` (listing the steps
  still answers; closing again does nothing);
* a directory another manager writes to: :class:`DirectoryLockedError`;
* a step that is not an integer: ``TypeError``; below 1, or not after the latest saved step or
  the previous call's step: ``ValueError`` (:func:`check_step` and :func:`check_step_order`
  word both);
* a loss that is not a scalar: ``TypeError`` (not a number) or ``ValueError`` (several
  elements);
* a step that is not a committed checkpoint, in ``restore``: ``FileNotFoundError`` listing the
  committed steps;
* a directory holding something the manager did not write: ``ValueError`` naming the entry;
* an ``extra`` item the manager cannot save (JAX: an args type Orbax does not know; PyTorch: an
  object without ``state_dict``): ``TypeError`` naming the key; a reserved item name:
  ``ValueError``.

Both keep the best steps by ``metrics`` with :class:`cocijax.core._retention.BestN` (the
newest ``keep_latest`` steps are never dropped) and turn preemption signals into one save with
:class:`cocijax.core._preemption.PreemptionWatcher`. Both answer ``policy_state`` and
``measurements`` from their driver (``cocijax.core._driver.PolicyDriver``) with the same
attributes, :data:`POLICY_STATE` and :data:`MEASUREMENTS` (see :class:`FromDriver`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import (
    Any,
    Generic,
    NamedTuple,
    Protocol,
    TypeVar,
    final,
    overload,
    runtime_checkable,
)

__all__ = [
    "MAX_STEP",
    "MEASUREMENTS",
    "POLICY_STATE",
    "DirectoryLockedError",
    "FromDriver",
    "ManagerClosedError",
    "ManagerProtocol",
    "Measurements",
    "StepDeletedError",
    "StepMismatchError",
    "check_extra_names",
    "check_step",
    "check_step_order",
]


class DirectoryLockedError(RuntimeError):
    """Another manager (in this or another process) writes to the directory."""


class StepDeletedError(FileNotFoundError):
    """A step was deleted (by the writer's retention or ``delete``) while it was being read.

    Raised by a reader's ``restore(step)`` of that very step; ``restore()`` of the newest step
    retries with the newest one instead. A ``FileNotFoundError``, like asking for a step that
    is not there.
    """


class ManagerClosedError(ValueError, RuntimeError):
    """The manager was closed; open a new one.

    Both a ``ValueError`` (what the JAX manager raised, like a closed file) and a
    ``RuntimeError`` (what the PyTorch manager raised), so that code written for either keeps
    catching it.
    """


class StepMismatchError(ValueError):
    """The processes of a job called ``save`` with different steps (a bug in the caller).

    Every process must pass the same step numbers in the same order: the processes save
    together, and a save that only some of them take waits for the others without end. The
    managers compare the steps of every process at each policy check and before each save, and
    raise this on every process, naming each process's steps, before anything of those steps
    is written.
    """


class Measurements(NamedTuple):
    """What the policy was told at the last ``save`` call, and what the job has learned.

    With several processes (or ranks) they are this process's own; the policy was given
    process 0's (rank 0's).

    Attributes:
      step_time_s: the step time it was given: the median of the last three measured (each
        the interval since the previous call, minus a save's blocking time); NaN until two
        were measured (one could be a pause).
      loss: the loss it was given (the JAX manager's is the previous step's, read one call
        late; the PyTorch manager's is the step's own); NaN if unknown.
      cost_estimate_s: the checkpoint cost it was given: the median of the last three saves'
        blocking times (each counted at most 10 times the estimate before it); before the
        first, the prior from the state's size (NaN before the first ``save`` call).
      last_save_s: the blocking time of the most recent save (NaN before the first).
      mtbf_s: the MTBF the policy used: its own when it was built with one
        (``coci(mtbf_s=...)``), else the one learned from the job's history.
      recovery_s: the recovery time the policy used: its own when it was built with one, else
        the one measured (NaN before the first restore: ``coci`` then assumes its
        ``prior_recovery_s``, at most a quarter of the MTBF).
      failures: failures of the job so far, as the directory recorded them.
      drain_s: how long the last drain to the durable tier took, from the local commit to the
        durable manifest (NaN without a durable tier or before the first drain).
      persist_cost_estimate_s: the cost estimate of a persisted (level-2) save. A two-level
        policy is given it as ``persist_cost_s``, and ``cost_estimate_s``, ``mtbf_s`` and
        ``recovery_s`` are then its level-1 save's and the process failures' (see
        ``Policy.levels``); a one-level policy's saves are all level 2.
      machine_mtbf_s: the MTBF of machine failures (the memory tier lost): what a two-level
        policy used, else the one learned (the prior's share until one is counted).
      machine_recovery_s: the recovery time after a machine failure (NaN before the first).
      machine_failures: how many of ``failures`` lost the machine's memory (a memory tier's
        marker gone, see ``cocijax.core._history``); the others were process failures.
    """

    step_time_s: float
    loss: float
    cost_estimate_s: float
    last_save_s: float
    mtbf_s: float = math.nan
    recovery_s: float = math.nan
    failures: int = 0
    drain_s: float = math.nan
    persist_cost_estimate_s: float = math.nan
    machine_mtbf_s: float = math.nan
    machine_recovery_s: float = math.nan
    machine_failures: int = 0


MAX_STEP = 2**31 - 1
"""The largest step a manager saves: policies count steps in int32 (jit-friendly everywhere)."""


def check_step(step: Any) -> int:
    """A training step as given to a manager's ``save``: an ``int`` (or NumPy integer) >= 1.

    Raises:
      TypeError: ``step`` is not an integer (a float, a string, a bool, None).
      ValueError: ``step`` is below 1 or above :data:`MAX_STEP`.
    """
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"step: expected an int, got {type(step).__name__} {step!r}.")
    step = step.__index__()
    if step < 1:
        raise ValueError(f"step: must be >= 1 (completed training steps), got {step}.")
    if step > MAX_STEP:
        raise ValueError(
            f"step: must be at most {MAX_STEP} (2**31 - 1: a policy counts steps in int32), "
            f"got {step}."
        )
    return step


def check_extra_names(extra: Any, *, reserved: Sequence[str], expected: str) -> Mapping:
    """The ``extra`` argument of a manager's ``save``/``restore``, its names checked.

    One rule for both managers: a mapping with string keys, none of them a name the manager
    gives its own items. What each value must be is the manager's own check.

    Args:
      extra: ``None`` or the mapping given.
      reserved: the names of the manager's own items.
      expected: what the values should be, for the error message.

    Returns:
      ``extra`` (an empty dict for ``None``).

    Raises:
      TypeError: ``extra`` is not a mapping, or a name is not a string.
      ValueError: a name is reserved.
    """
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"extra: expected a dict of item names to {expected}, got {type(extra).__name__}."
        )
    for name in extra:
        if not isinstance(name, str):
            raise TypeError(f"extra: item names must be strings, got {name!r}.")
        if name in reserved:
            raise ValueError(
                f"extra[{name!r}]: the name is reserved for the manager's own items "
                f"({', '.join(reserved)}); choose another."
            )
    return extra


def check_step_order(step: int, latest_saved: int | None, previous: int | None, where) -> None:
    """Raises ``ValueError`` unless ``step`` follows both the latest saved and previous step."""
    if latest_saved is not None and step <= latest_saved:
        raise ValueError(
            f"step: {step} is not after the latest saved step {latest_saved} in {where}; "
            "resume from latest_step() + 1, or delete() the newer steps first."
        )
    if previous is not None and step <= previous:
        raise ValueError(
            f"step: {step} is not after the previous call's step {previous}; "
            "call save once per training step with increasing steps."
        )


@runtime_checkable
class ManagerProtocol(Protocol):
    """A checkpoint manager driven by a :mod:`cocijax.policies` policy.

    Call :meth:`save` after every training step with the step's loss; the manager measures the
    step time and the cost of its saves itself, asks the policy, and saves when it says so. The
    policy state is saved with every checkpoint, so a restarted job continues its schedule.

    Example:
      >>> import tempfile, cocijax as cj
      >>> with cj.CheckpointManager(tempfile.mkdtemp()) as mngr:
      ...     isinstance(mngr, ManagerProtocol)
      True
    """

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        ...

    @property
    def policy_state(self) -> Any:
        """The policy state after the latest ``save`` call (a pytree of arrays)."""
        ...

    @property
    def measurements(self) -> Measurements:
        """The inputs of the policy's last decision."""
        ...

    @property
    def reached_preemption(self) -> bool:
        """A preemption signal arrived and its step was saved and committed: stop training."""
        ...

    def save(
        self,
        step: int,
        state: Any,
        *,
        loss: Any,
        force: bool = False,
        extra: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> bool:
        """Feeds one completed training step to the policy; saves when it says so (or ``force``).

        After a preemption signal the next call saves whatever the policy says, waits for the
        commit and sets :attr:`reached_preemption`. ``extra`` (further items of the step) and
        ``metrics`` (scalars ranked by ``best_fn``) are only looked at on a step that saves.

        Returns:
          True when this step is being saved.
        """
        ...

    def restore(
        self, step: int | None = None, target: Any = None, *, extra: dict[str, Any] | None = None
    ) -> Any:
        """Restores ``step`` (default: the latest) and continues the policy schedule from it.

        Returns:
          The state; ``(state, extra)`` when ``extra`` (the items to restore) is given.
        """
        ...

    def all_steps(self) -> list[int]:
        """Saved steps, oldest first."""
        ...

    def latest_step(self) -> int | None:
        """The newest saved step, or None."""
        ...

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is committed; re-raises its error."""
        ...

    def close(self) -> None:
        """Waits for the save in flight and releases the directory; idempotent."""
        ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


T = TypeVar("T")


@final
class FromDriver(Generic[T]):
    """A manager's read-only attribute, answered by the manager's :class:`PolicyDriver`.

    Every manager holds its driver as ``_driver`` and answers the same questions from it; each
    declares the answer as a class attribute (``policy_state = POLICY_STATE``) instead of a
    property of its own that forwards to the driver, so that the answer and its documentation
    are written once. It reads as a property does: ``manager.policy_state`` is the answer,
    ``type(manager).policy_state`` this object (its ``__doc__`` the documentation), and
    assigning raises ``AttributeError``.

    Args:
      read: the answer, from the driver.
      doc: the attribute's documentation.
    """

    # ``read`` takes the driver as Any: naming PolicyDriver here would make this module and
    # _driver (which takes Measurements from here) import each other.
    def __init__(self, read: Callable[[Any], T], doc: str):
        self._read = read
        self.__doc__ = doc
        self._name = "attribute"

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, manager: None, owner: type | None = None) -> FromDriver[T]: ...

    @overload
    def __get__(self, manager: object, owner: type | None = None) -> T: ...

    def __get__(self, manager: object, owner: type | None = None) -> FromDriver[T] | T:
        if manager is None:
            return self
        return self._read(manager._driver)  # type: ignore[attr-defined]

    def __set__(self, manager: object, value: Any) -> None:
        # A data descriptor, as a property is: the answer cannot be shadowed by assignment.
        raise AttributeError(f"{self._name} is read-only: the policy driver answers it.")


POLICY_STATE: FromDriver[Any] = FromDriver(
    lambda driver: driver.state,
    """The policy state after the latest ``save`` call (a pytree of arrays).

    Reading it first feeds the policy the steps it skipped (see
    :class:`cocijax.policies.Runner`), with the inputs broadcast from process 0 (rank 0): with
    several processes, read it on every one.""",
)

MEASUREMENTS: FromDriver[Measurements] = FromDriver(
    lambda driver: driver.measurements(),
    """The inputs of the policy's last decision, and what the job has learned so far
    (see :class:`Measurements`).""",
)
