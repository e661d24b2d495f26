"""``SaveDecisionPolicy``: any cocijax policy as an Orbax ``save_decision_policy``.

For users who keep their own ``ocp.CheckpointManager``: Orbax asks ``should_save`` once per
``save`` call, and this adapter feeds the cocijax policy with times it measures itself.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, final

from cocijax.core._driver import PolicyDriver
from cocijax.core._policy_inputs import stage_loss

__all__ = ["SaveDecisionPolicy"]


@final
class SaveDecisionPolicy:
    """Orbax ``SaveDecisionPolicy`` protocol backed by a :mod:`cocijax.policies` policy.

    **Loss.** Read from ``step.metrics[metric]`` when Orbax provides metrics for the step being
    decided. Orbax 0.12's ``CheckpointManager.should_save`` passes ``metrics=None`` for it, so
    report the loss with :meth:`observe` before calling ``save``; without either the policy sees
    NaN (ignored: it falls back on time alone). ``observe`` accepts an unfinished ``jax.Array``;
    it is read at the next decision, so the policy sees each observed loss one step late and the
    training loop is never synchronised by it.

    **Times.** Measured between consecutive ``should_save`` calls (one per training step), by
    the driver every cocijax manager uses. An interval that follows a "save" decision also
    contains the blocking part of that save, plus any wait for the previous async save: its
    excess over the current step-time estimate (the last interval that followed a "no"
    decision) is fed to the policy as the checkpoint cost. Before any step time is known, such
    an interval stands for the step time, so a policy whose first decisions are "save" still
    learns one. Both are taken robustly (the median of the last three; see
    ``cocijax.core._driver``), and while no cost is known the first step timed without a
    save in it (step 2 of a fresh job) is saved, so that the cost is measured at once.

    **Several processes.** Each process measures its own times; before every decision the
    measured values are broadcast from process 0 (``multihost_utils.broadcast_one_to_all``), so
    all processes run the same jitted update on the same inputs and take the same decision.
    Every process must therefore call ``should_save`` for the same steps (Orbax does, as
    ``save`` is called by all processes).

    Calling ``should_save`` again for the step it has just decided returns the same answer
    without feeding the policy twice.

    Args:
      policy: a :mod:`cocijax.policies` policy; default ``cj.policies.coci()``.
      metric: the key of the loss in ``metrics``.
      clock: monotonic clock in seconds; injectable for deterministic tests.

    Example:
      >>> import tempfile, numpy as np, orbax.checkpoint as ocp, cocijax as cj
      >>> sdp = cj.SaveDecisionPolicy(cj.policies.fixed(3))
      >>> options = ocp.CheckpointManagerOptions(save_decision_policy=sdp)
      >>> with ocp.CheckpointManager(tempfile.mkdtemp(), options=options) as mngr:
      ...     for step in range(1, 8):
      ...         state, loss = {"x": np.full(3, step)}, 1.0 / step  # a training step
      ...         sdp.observe(loss)
      ...         _ = mngr.save(step, args=ocp.args.StandardSave(state))
      ...     mngr.wait_until_finished()
      ...     list(mngr.all_steps())
      [3, 6]
    """

    def __init__(
        self,
        policy: Any = None,
        *,
        metric: str = "loss",
        clock: Callable[[], float] = time.monotonic,
    ):
        from cocijax import policies

        if not isinstance(metric, str):
            raise TypeError(f"metric: expected a str key, got {type(metric).__name__}.")
        self._driver = PolicyDriver(
            policies.coci() if policy is None else policy,
            clock=clock,
            cost_from_intervals=True,
            save_final_step=True,
        )
        self._metric = metric
        self._observed: Any = None
        self._observed_prev: Any = None
        self._decision: bool | None = None

    @property
    def state(self) -> Any:
        """The current policy state (a pytree of arrays)."""
        return self._driver.state

    def state_json(self) -> str:
        """The policy state and measurements as JSON text.

        Save it with your checkpoint (e.g. ``ocp.args.JsonSave(json.loads(text))``, or as a
        file) and give it to :meth:`load_state_json` after a restart, so that the schedule
        continues.
        """
        snapshot = self._driver.snapshot(self._observed_prev)
        return json.dumps(self._driver.to_json(snapshot))

    def load_state_json(self, data: str | dict[str, Any]) -> None:
        """Adopts a :meth:`state_json` document (the text, or its parsed dict).

        The next step decided must follow its step.

        Raises:
          ValueError: ``data`` is not JSON, or was written by something else or by a different
            policy.
        """
        if isinstance(data, str | bytes):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ValueError(f"SaveDecisionPolicy.load_state_json: not JSON ({e}).") from e
        self._driver.load_json(data, where="SaveDecisionPolicy.load_state_json")
        self._observed_prev = self._driver.loss  # the saved step's loss, due at the next decision
        self._driver.restart_timing()
        self._decision = None

    def observe(self, loss: Any) -> None:
        """Reports the loss of the step that the next ``should_save`` decides on.

        Raises:
          TypeError, ValueError: ``loss`` is not a scalar number or array.
        """
        self._observed = stage_loss(loss)

    def should_save(
        self,
        step: Any,
        previous_steps: Sequence[Any],
        *,
        context: Any,
    ) -> bool:
        """Returns True when the cocijax policy says to checkpoint after ``step.step``.

        Raises:
          ValueError: ``step.step`` is smaller than the step of the previous call.
        """
        del previous_steps, context  # the policy keeps its own history
        number = int(step.step)
        last = self._driver.step
        if last is not None and number == last and self._decision is not None:
            return self._decision
        if last is not None and number < last:
            raise ValueError(
                f"step: {number} comes before the previously decided step {last}; "
                "should_save expects increasing steps."
            )
        metrics = getattr(step, "metrics", None)
        if metrics and self._metric in metrics:
            loss = stage_loss(metrics[self._metric])
        else:
            # The loss observed for the previous step: that step has finished by now.
            loss = self._observed_prev
        self._observed_prev, self._observed = self._observed, None
        # The driver times the interval since the previous call; one that follows a "save" is
        # split into the step time it knows and the save's cost (see PolicyDriver).
        self._decision = self._driver.decide(number, loss=math.nan if loss is None else loss)
        return self._decision
