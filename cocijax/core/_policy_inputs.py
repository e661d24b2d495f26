"""What a :class:`~cocijax.core._driver.PolicyDriver` feeds its policy, and how it is measured.

The robust value of a measured time (:class:`RecentTimes`: the median of the last
:data:`RECENT` measurements, a save's cost capped at :data:`COST_JUMP` times the estimate before
it), the save cost assumed before one is measured (:func:`prior_cost_s`, from the state's size,
:func:`tree_nbytes`), and the loss, staged to host when given (:func:`stage_loss`) and read
when the policy needs it (:func:`read_loss`). Why these rules: the driver's module docstring.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

__all__ = [
    "COST_JUMP",
    "PRIOR_FIXED_S",
    "PRIOR_WRITE_RATE_BPS",
    "RECENT",
    "RecentTimes",
    "prior_cost_s",
    "read_loss",
    "saved_times",
    "stage_loss",
    "tree_nbytes",
]

# The policy is fed the median of this many recent measurements of a time (see the driver).
RECENT = 3
# A save's measured cost counts at most this many times the estimate before it (before any,
# the prior but at least 10 s): a pause inside the early save cannot make the policy stop
# saving, and a cost that really grew 100 times is followed within four saves.
COST_JUMP = 10.0
# The cost prior: a fixed part and the state written at a conservative rate. 100 MiB/s is a
# slow network file system or one disk; every save measured on the 2-core development machine
# blocked for less (its first save 400 MiB/s, a save waiting for the one before it 128 MiB/s
# under load), and the blocking part of an asynchronous save on an accelerator is a copy to
# host memory, faster still. The fixed part covers a small state's first save (28 ms to 160 ms
# measured there). A prior above the truth errs towards saves that seem dear: the early save
# measures the real cost within two steps anyway.
PRIOR_WRITE_RATE_BPS = 100 * 2**20
PRIOR_FIXED_S = 0.2


def prior_cost_s(nbytes: float) -> float:
    """The save cost assumed before one is measured, for a state of ``nbytes`` bytes.

    ``PRIOR_FIXED_S`` plus the state written at ``PRIOR_WRITE_RATE_BPS`` (see there).
    """
    return PRIOR_FIXED_S + max(float(nbytes), 0.0) / PRIOR_WRITE_RATE_BPS


def tree_nbytes(tree: Any) -> int:
    """Bytes of the arrays in a pytree (its global size: shards of other processes count)."""
    return sum(int(getattr(leaf, "nbytes", 0) or 0) for leaf in jax.tree.leaves(tree))


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


class RecentTimes:
    """The last :data:`RECENT` measurements of one time, and their robust value.

    Args:
      values: measurements already taken (a restored checkpoint's), oldest first.
      jump: a new measurement counts at most this many times the value before it.

    Attributes:
      value: the median of the measurements (the lower middle of two), or NaN without any;
        kept up to date by :meth:`add`, since a manager reads it at every step.
    """

    __slots__ = ("jump", "value", "values")

    def __init__(self, values: list[float] | tuple[float, ...] = (), *, jump: float = math.inf):
        self.values = list(values)[-RECENT:]
        self.jump = jump
        self._update()

    def _update(self) -> None:
        ordered = sorted(self.values)
        self.value = ordered[(len(ordered) - 1) // 2] if ordered else math.nan

    def copy(self) -> RecentTimes:
        return RecentTimes(self.values, jump=self.jump)

    def add(self, sample: float, reference: float = math.nan) -> None:
        """Records a measurement; a negative or NaN one (a clock that jumped back) is none.

        Args:
          sample: the measured seconds.
          reference: what a first measurement is capped against (``jump`` times it), if finite.
        """
        if not sample >= 0.0:
            return
        if self.values:
            reference = self.value
        if reference < math.inf:  # False for NaN too
            sample = min(sample, self.jump * reference)
        self.values.append(float(sample))
        if len(self.values) > RECENT:
            del self.values[0]
        self._update()


def saved_times(saved: Any, fallback: Any) -> list[float]:
    """Measurements saved with a checkpoint, or ``[fallback]``; never a value a job cannot have."""
    ok = lambda v: type(v) in (int, float) and 0.0 <= v < math.inf
    if isinstance(saved, list) and 0 < len(saved) <= RECENT and all(map(ok, saved)):
        return [float(v) for v in saved]
    return [float(fallback)] if ok(fallback) else []
