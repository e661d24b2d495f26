"""Best-N retention: keep the best steps by a metric, and never the newest ones away.

Orbax's ``CheckpointManagerOptions(best_fn=...)`` ranks every step, the newest included, so a
job whose newest step scores worse than the ones kept loses it at once, and a restarted job
resumes from an older step than the one it reached (google/orbax#526). :class:`BestN` keeps
the ``max_to_keep`` best steps by ``best_fn`` *and* the ``keep_latest`` newest steps whatever
their metrics (a job resumes from its newest step); a step saved without metrics is not ranked
and is kept only while it is one of the newest. It is pure bookkeeping over ``{step:
metrics}``: the JAX manager and the PyTorch manager both use it, each deleting in its own way.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any, final

import numpy as np

__all__ = ["BestN", "MetricsCheck", "Retention", "check_metrics"]

Metrics = Mapping[str, Any]


def check_metrics(metrics: Any) -> dict[str, int | float | bool] | None:
    """The ``metrics`` of a ``save`` call as plain JSON scalars; ``None`` stays ``None``.

    Args:
      metrics: a mapping from names to scalars: Python or NumPy numbers, or one-element
        jax/NumPy arrays or torch tensors (read here: call this only on a step that saves).

    Returns:
      A new dict of Python ``bool``/``int``/``float``, or ``None``.

    Raises:
      TypeError: ``metrics`` is not a mapping, a key is not a string, or a value is not a
        scalar number (the message names the key).

    Example:
      >>> import numpy as np
      >>> check_metrics({"eval_acc": np.float32(0.5), "epoch": 3})
      {'eval_acc': 0.5, 'epoch': 3}
    """
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics: expected a dict of names to numbers, got {type(metrics).__name__}."
        )
    out: dict[str, int | float | bool] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metrics: keys must be strings, got {key!r}.")
        out[key] = _scalar(key, value)
    return out


def _scalar(key: str, value: Any) -> int | float | bool:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is not None and math.prod(shape) == 1 and callable(getattr(value, "item", None)):
        item = value.item()  # a one-element jax/NumPy array or torch tensor
        if isinstance(item, bool | numbers.Real):
            return _scalar(key, item)
    raise TypeError(
        f"metrics[{key!r}]: expected a scalar number (Python, NumPy or a one-element array), "
        f"got {type(value).__name__}{'' if shape is None else f' of shape {tuple(shape)}'}."
    )


@final
@dataclasses.dataclass(frozen=True)
class BestN:
    """Which steps to keep: the best ``max_to_keep`` by ``best_fn``, plus the newest ones.

    Attributes:
      best_fn: maps a step's metrics (a dict) to a number to rank it by.
      best_mode: ``"max"`` (larger is better) or ``"min"``.
      max_to_keep: how many ranked steps to keep; ``None`` keeps them all.
      keep_latest: the newest steps kept whatever their metrics (0: none, Orbax's behaviour).
      keep_period: also keep every step that is a multiple of this (Orbax's ``keep_period``).

    On disk there are then at most ``max_to_keep + keep_latest`` steps (and the periodic
    ones). A step without metrics, or whose ``best_fn`` value is NaN, is not ranked: it is kept
    while it is one of the ``keep_latest`` newest steps. Equal values keep the newer step.

    Example:
      >>> best = BestN(lambda m: m["acc"], best_mode="max", max_to_keep=2, keep_latest=1)
      >>> best.to_delete({1: {"acc": 0.9}, 2: {"acc": 0.5}, 3: {"acc": 0.7}, 4: {"acc": 0.1}})
      [2]
      >>> best.to_delete({1: {"acc": 0.9}, 2: None, 3: {"acc": 0.7}, 4: None})
      [2]
    """

    best_fn: Callable[[Metrics], Any]
    best_mode: str = "max"
    max_to_keep: int | None = None
    keep_latest: int = 1
    keep_period: int | None = None

    def __post_init__(self):
        if not callable(self.best_fn):
            raise TypeError(
                f"best_fn: expected a function of a step's metrics dict, got "
                f"{type(self.best_fn).__name__}."
            )
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode: expected 'max' or 'min', got {self.best_mode!r}.")
        for name, low in (("max_to_keep", 1), ("keep_latest", 0), ("keep_period", 1)):
            value = getattr(self, name)
            if value is None and name != "keep_latest":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}.")

    def score(self, metrics: Metrics | None, *, step: int) -> float | None:
        """``best_fn(metrics)`` as a float; ``None`` when there are no metrics or it is NaN.

        Raises:
          ValueError: ``best_fn`` failed on these metrics or did not return a real number (the
            message names the step and the metrics).
        """
        if metrics is None:
            return None
        try:
            value = float(self.best_fn(metrics))
        except Exception as e:
            raise ValueError(
                f"best_fn failed on the metrics of step {step} ({dict(metrics)!r}): "
                f"{type(e).__name__}: {e}; pass the metrics best_fn reads with every save "
                "that has them."
            ) from e
        return None if math.isnan(value) else value

    def to_delete(self, metrics: Mapping[int, Metrics | None]) -> list[int]:
        """The steps to delete, oldest first, given every kept step's metrics (or ``None``).

        Raises:
          ValueError: as :meth:`score`.
        """
        steps = sorted(metrics)
        keep = set(steps[len(steps) - self.keep_latest :]) if self.keep_latest else set()
        if self.keep_period:
            keep.update(s for s in steps if s % self.keep_period == 0)
        scores = {s: self.score(metrics[s], step=s) for s in steps}
        ranked = [s for s in steps if scores[s] is not None]
        sign = -1.0 if self.best_mode == "max" else 1.0
        ranked.sort(key=lambda s: (sign * scores[s], -s))  # best first; ties: newer first
        keep.update(ranked if self.max_to_keep is None else ranked[: self.max_to_keep])
        return [s for s in steps if s not in keep]


@final
class MetricsCheck:
    """The ``metrics`` of a step that saves, checked the same way by every manager.

    Converts them with :func:`check_metrics`. With a :class:`BestN`, also runs its ``best_fn``
    on them, so that a ``best_fn`` that cannot read them fails before anything is written, and
    says once per manager (a ``RuntimeWarning``) that a step saved without metrics is not
    ranked.

    Args:
      best: the manager's best-N retention, or ``None`` (metrics are then only recorded).

    Example:
      >>> check = MetricsCheck(BestN(lambda m: m["acc"], max_to_keep=2))
      >>> check({"acc": 0.5}, step=1, stacklevel=2)
      {'acc': 0.5}
      >>> check({"loss": 0.5}, step=2, stacklevel=2)
      Traceback (most recent call last):
      ...
      ValueError: best_fn failed on the metrics of step 2 ({'loss': 0.5}): KeyError: 'acc'; ...
    """

    def __init__(self, best: BestN | None):
        self.best = best
        self._unranked_said = False

    def __call__(self, metrics: Any, *, step: int, stacklevel: int) -> dict[str, Any] | None:
        """``metrics`` as JSON scalars (or ``None``).

        Args:
          metrics: the ``metrics`` argument of ``save``.
          step: the step being saved (named in errors and the warning).
          stacklevel: of the warning, counted from this call (so that it names the user's
            ``save`` call).

        Raises:
          TypeError: as :func:`check_metrics`.
          ValueError: as :meth:`BestN.score`.
        """
        metrics = check_metrics(metrics)
        if self.best is None:
            return metrics
        if metrics is not None:
            self.best.score(metrics, step=step)
        elif not self._unranked_said:
            self._unranked_said = True
            warnings.warn(
                f"save: step {step} has no metrics, so best_fn cannot rank it; it is kept "
                f"only while it is one of the newest keep_latest={self.best.keep_latest} "
                "steps (said once per manager; pass metrics= with the saves to rank them).",
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )
        return metrics


@final
class Retention:
    """Which committed steps a manager drops, the same way for every manager.

    Best-N by ``metrics`` (:class:`BestN`) when a ``best_fn`` is given, else the newest
    ``max_to_keep`` steps (``None``: all). A step's metrics are read once from disk, through the
    manager's ``read_metrics`` (every process reads the same files: the same decision
    everywhere). Steps in ``keep`` are never dropped: the preemption save (the job resumes from
    it, even with ``keep_latest=0``) and the steps a drain still reads.

    Args:
      best: the best-N rule, or None.
      max_to_keep: without ``best``, how many of the newest steps to keep (None: all).

    Example:
      >>> r = Retention(None, max_to_keep=2)
      >>> r.drop([1, 2, 3, 4], read_metrics=lambda step: None, keep={1})
      [2]
    """

    def __init__(self, best: BestN | None, max_to_keep: int | None):
        self.best = best
        self._max_to_keep = max_to_keep
        self._metrics: dict[int, Metrics | None] = {}

    @property
    def active(self) -> bool:
        """Whether anything is ever dropped."""
        return self.best is not None or self._max_to_keep is not None

    def drop(
        self,
        steps: list[int],
        read_metrics: Callable[[int], Metrics | None],
        *,
        keep: set[int] | frozenset[int] = frozenset(),
    ) -> list[int]:
        """The steps of ``steps`` (committed, oldest first) to delete now, oldest first."""
        if self.best is None:
            if self._max_to_keep is None:
                return []
            doomed = steps[: max(len(steps) - self._max_to_keep, 0)]
        else:
            for step in steps:
                if step not in self._metrics:
                    self._metrics[step] = read_metrics(step)
            doomed = self.best.to_delete({s: self._metrics[s] for s in steps})
        doomed = [s for s in doomed if s not in keep]
        for step in doomed:
            self._metrics.pop(step, None)
        return doomed
