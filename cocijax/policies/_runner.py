"""``Runner``: a policy in a training loop, at the cost of an integer comparison per step.

Calling ``policy.update`` at every step costs a dispatch and, to branch on its answer, a device
sync. A policy cannot save before ``next_check(state)`` (see :mod:`cocijax.policies._base`), so
the runner only records the inputs of those steps; at a check step it feeds them, with the
current one, to :func:`update_many` in one dispatch, and answers with a plain ``bool``. The
decisions are those of one ``update`` call per step. Losses may be unfinished ``jax.Array``s:
they are read at the check, when their steps are done.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, final

import jax
import numpy as np

from cocijax.policies._base import Policy
from cocijax.policies._plan import Batch, next_check, update_many

# Steps fed per dispatch (padded): one compilation whatever the number of skipped steps.
BATCH = 64
# The float inputs of a step, in the order of a recorded row's columns.
_FLOAT_INPUTS = tuple(name for name in Batch._fields if name not in ("step", "valid"))


@final
class Runner:
    """Feeds a policy step by step; returns plain bools; dispatches only at check steps.

    Args:
      policy: a :class:`~cocijax.policies.Policy`.
      broadcast: applied to the ``(steps, 8)`` float32 array of recorded inputs (the float
        inputs of ``Policy.update``, loss first) before they reach the policy, e.g. a broadcast
        from process 0 so that every process of a job takes the same decisions; ``None`` uses
        them as they are.
      same_steps: called at every check, before ``broadcast``, with the steps recorded since
        the previous check (an int64 array, in order): a check that every process of a job
        was given the same steps, which raises if not; ``None`` checks nothing.

    Example:
      >>> import numpy as np, cocijax as cj
      >>> runner = cj.policies.Runner(cj.policies.young(mtbf_s=3600.0))
      >>> saves = [s for s in range(1, 1001)
      ...          if runner.update(s, loss=1.0 / s, step_time_s=1.0, checkpoint_cost_s=10.0)]
      >>> saves[:3]
      [268, 536, 804]
    """

    def __init__(
        self,
        policy: Policy,
        *,
        broadcast: Callable[[np.ndarray], np.ndarray] | None = None,
        same_steps: Callable[[np.ndarray], None] | None = None,
    ):
        init, update = getattr(policy, "init", None), getattr(policy, "update", None)
        if not (callable(init) and callable(update)):
            raise TypeError(
                "policy: expected a cocijax.policies.Policy (an (init, update) pair, e.g. "
                f"cj.policies.coci()), got {type(policy).__name__}."
            )
        if getattr(policy, "levels", 1) not in (1, 2):
            raise ValueError(f"policy.levels: expected 1 or 2, got {policy.levels!r}.")
        self.policy = policy
        self._broadcast = broadcast
        self._same_steps = same_steps
        self._update_many = update_many(policy)
        # The policy runs on the host CPU: on an accelerator its tiny update would queue behind
        # the training step, and reading its decision would wait for the device.
        self._device = jax.local_devices(backend="cpu")[0]
        self._compiling: Future | None = None  # a compilation running in a thread
        self._pending: list[tuple[Any, ...]] = []  # (step, loss, *the float inputs)
        # ``policy.init()`` runs when the state is first needed, not here: run eagerly it
        # compiles each of its operations (COCI's: 0.46 s in a fresh process), and a restarted
        # job replaces it with its saved state at once. Until then every step is checked.
        self._state: Any = None
        self._next_check = 0

    @property
    def state(self) -> Any:
        """The policy state after every step given so far (feeds the recorded ones first)."""
        self.flush()
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._pending = []
        self._set_state(value)

    def _set_state(self, value: Any) -> None:
        # Read before the transfer: a restored state is NumPy, and reading it costs nothing.
        self._next_check = int(next_check(value))
        self._state = jax.device_put(value, self._device)

    def _initialised(self) -> Any:
        if self._state is None:
            self._set_state(self.policy.init())
        return self._state

    @property
    def next_check(self) -> int:
        """The first step at which :meth:`update` may return True."""
        self._initialised()
        return self._next_check

    def compile_count(self) -> int:
        """How many times the batched update has been compiled (1 after :meth:`compile`)."""
        self._wait_compiled()
        return self._update_many._cache_size()

    def compile(self, *, background: bool = False) -> None:
        """Compiles the batched update now, so that no training step pays for it.

        Args:
          background: compile in a thread and return at once; the first check step (or
            anything that reads :attr:`state`) waits for it and re-raises its error. A
            restarted job restores and compiles its own training step meanwhile: COCI's
            update takes seconds to compile, which would otherwise add to every recovery.
        """
        self._wait_compiled()
        if not background:
            jax.block_until_ready(self._update_many(self._initialised(), _batch([], 0)))
            return
        future: Future = Future()
        state = self._state  # setting `state` meanwhile does not wait: this one is compiled

        def run() -> None:
            try:
                # Placed as _set_state places it: the same arguments, the same compilation.
                compiled_with = state
                if compiled_with is None:
                    compiled_with = jax.device_put(self.policy.init(), self._device)
                jax.block_until_ready(self._update_many(compiled_with, _batch([], 0)))
            except BaseException as e:  # handed to the thread that waits for it
                future.set_exception(e)
            else:
                future.set_result(None)

        self._compiling = future
        # Not a daemon: an interpreter that exits meanwhile waits for XLA rather than
        # finalising under it.
        threading.Thread(target=run, name="cocijax-policy-compile").start()

    def _wait_compiled(self) -> None:
        future, self._compiling = self._compiling, None
        if future is not None:
            future.result()

    def update(
        self, step: int, *, loss: Any, step_time_s: float, checkpoint_cost_s: float, **more: float
    ) -> bool:
        """Reports one completed step; True when the policy says to checkpoint after it.

        Arguments are those of ``Policy.update`` (``more``: ``mtbf_s``, ``recovery_s`` and the
        two-level inputs); ``loss`` may be a number or a one-element array (read only at the
        next check). True for a save of either level; a caller that acts on levels calls
        :meth:`decide`.
        """
        inputs = dict(step_time_s=step_time_s, checkpoint_cost_s=checkpoint_cost_s, **more)
        return self.decide(step, loss=loss, **inputs) > 0

    def decide(self, step: int, *, loss: Any, **inputs: float) -> int:
        """As :meth:`update`, but returns the level: 0 no save, 1 or 2 (see ``Policy.levels``).

        A one-level policy's saves are level 2: every one of them is persisted.
        """
        row = [inputs.pop(name, math.nan) for name in _FLOAT_INPUTS[1:]]
        if inputs:
            raise TypeError(f"Runner.decide: unexpected inputs {sorted(inputs)}.")
        self._pending.append((int(step), loss, *row))
        if step < self._next_check:
            return 0
        return self.flush()

    def flush(self) -> int:
        """Feeds the recorded steps to the policy; returns the level decided at the last one."""
        self._wait_compiled()
        self._initialised()
        if not self._pending:
            return 0
        steps = [row[0] for row in self._pending]
        if self._same_steps is not None:
            # Before the broadcast, whose shape is the number of steps: processes at different
            # steps would pair mismatched collectives (an abort in gloo) or wait for ever.
            self._same_steps(np.asarray(steps, np.int64))
        values = np.asarray(
            [(_read(loss), *rest) for _, loss, *rest in self._pending], np.float32
        ).reshape(len(steps), len(_FLOAT_INPUTS))
        self._pending = []
        if self._broadcast is not None:
            values = np.asarray(self._broadcast(values), np.float32)
        level = 0
        for start in range(0, len(steps), BATCH):
            end = start + BATCH
            rows = list(zip(steps[start:end], values[start:end], strict=True))
            level, self._state = self._update_many(self._state, _batch(rows, len(rows)))
        self._next_check = int(next_check(self._state))
        return int(level)


def _read(loss: Any) -> float:
    if isinstance(loss, jax.Array) and not loss.is_fully_addressable:
        loss = loss.addressable_data(0)  # a globally sharded scalar: this process's copy
    return float(np.asarray(loss).reshape(-1)[0]) if np.size(loss) else math.nan


def _batch(rows: list[tuple[int, np.ndarray]], valid: int) -> Batch:
    """A :class:`Batch` of ``BATCH`` rows, the first ``valid`` of them real."""
    values = np.full((BATCH, len(_FLOAT_INPUTS)), np.nan, np.float32)
    steps = np.zeros(BATCH, np.int32)
    for i, (step, row) in enumerate(rows):
        steps[i], values[i] = step, row
    columns = {name: values[:, i] for i, name in enumerate(_FLOAT_INPUTS)}
    return Batch(step=steps, valid=np.arange(BATCH) < valid, **columns)
