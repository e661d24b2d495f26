"""The one driver of a policy in a training job, shared by every manager.

:class:`cocijax.CheckpointManager`, :class:`cocijax.torch.CheckpointManager` and
:class:`cocijax.SaveDecisionPolicy` all call :meth:`PolicyDriver.decide` once per training step
and let it measure: the step time is the time between consecutive calls, minus the time a save
blocked (the managers time their own saves with :meth:`PolicyDriver.saving`;
``SaveDecisionPolicy``, which Orbax calls before it saves, splits the interval that follows a save
into the step time it has and the save's cost). The first interval after opening or restoring is
not timed: it includes compilation. The driver feeds a :class:`cocijax.policies.Runner` (no
dispatch and no device sync on a step before the policy's next check), passes the job's learned
MTBF and recovery time (:mod:`cocijax.manager._history`), and serialises everything a restarted
job needs to continue the same schedule.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, final

import jax
import numpy as np

from cocijax._validate import POSITIVE, check
from cocijax.manager._contract import Measurements
from cocijax.manager._history import RunHistory
from cocijax.policies import Runner, coci, default_prior_mtbf_s

__all__ = ["PolicyDriver", "check_policy", "manager_driver", "read_loss", "stage_loss"]

# /2 records each leaf's key path, so a policy whose state gained fields still loads older
# states (new fields start at their initial values); /1 (cocijax 0.1) matched by position.
_FORMAT = "cocijax.policy_state/2"
_FORMATS = ("cocijax.policy_state/1", _FORMAT)


def check_policy(policy: Any) -> None:
    """Raises ``TypeError`` naming ``policy`` unless it is an ``(init, update)`` pair."""
    init, update = getattr(policy, "init", None), getattr(policy, "update", None)
    if not (callable(init) and callable(update)):
        raise TypeError(
            f"policy: expected a cocijax.policies.Policy (an (init, update) pair, e.g. "
            f"cj.policies.coci()), got {type(policy).__name__}."
        )


def manager_driver(
    policy: Any, prior_mtbf_s: float | None, *, clock: Callable[[], float]
) -> Callable[..., PolicyDriver]:
    """How a manager makes its driver, from its ``policy`` and ``prior_mtbf_s`` arguments.

    Both managers take the same two arguments with the same defaults, and drive the policy the
    same way: the job's learned MTBF starts from the prior, and a policy that knows the job's
    length saves its final step. The arguments are checked now, before the manager touches its
    directory; the driver is made once the directory's history is open.

    Args:
      policy: a :mod:`cocijax.policies` policy, or ``None`` for ``coci()``.
      prior_mtbf_s: the MTBF the learned estimate starts from, or ``None`` for
        :func:`cocijax.policies.default_prior_mtbf_s`.
      clock: the manager's monotonic clock in seconds.

    Returns:
      :class:`PolicyDriver` with those set: the manager passes ``history=`` and its own
      options.

    Raises:
      TypeError: ``policy`` is not a policy.
      ValueError: ``prior_mtbf_s`` is not a positive number.
    """
    policy = coci() if policy is None else policy
    check_policy(policy)
    prior = default_prior_mtbf_s() if prior_mtbf_s is None else prior_mtbf_s
    prior = check("prior_mtbf_s", prior, POSITIVE)
    return functools.partial(
        PolicyDriver, policy, clock=clock, prior_mtbf_s=prior, save_final_step=True
    )


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


def _encode(leaf: Any) -> dict[str, Any]:
    array = np.asarray(leaf)
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        # Raw bytes keep NaN payloads and every float bit exact, unlike a JSON number.
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
    }


def _decode(entry: dict[str, Any], like: jax.ShapeDtypeStruct, where: str) -> np.ndarray:
    dtype = jax.numpy.dtype(entry["dtype"])  # knows bfloat16, unlike np.dtype
    shape = tuple(entry["shape"])
    if dtype != like.dtype or shape != like.shape:
        raise ValueError(
            f"{where}: policy state leaf is {dtype}{list(shape)} on disk but "
            f"{like.dtype}{list(like.shape)} for this policy."
        )
    raw = base64.b64decode(entry["data"])
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _broadcast_from_process_0(values: np.ndarray) -> np.ndarray:
    """Every process decides on process 0's measurements (the same updates, the same decisions)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


@final
class PolicyDriver:
    """Runs one policy in a training job: measured inputs, learned failure rate, restartable.

    Args:
      policy: a :mod:`cocijax.policies` policy.
      clock: monotonic clock in seconds; injectable for deterministic tests.
      history: the job's failure history (learned MTBF and recovery time), or None.
      prior_mtbf_s: the MTBF the history's estimate starts from (see ``RunHistory.mtbf_s``).
      cost_from_intervals: the caller cannot time its saves: the interval after a "save"
        decision is split into the step time known so far and the save's cost.
      save_final_step: with a policy that knows the job's length (``policy.total_steps``),
        decide "save" at that step whatever the policy says, so that a finished job keeps its
        final state.
      broadcast: makes the measured inputs of every process equal before the policy sees them
        (see :class:`cocijax.policies.Runner`); default: JAX's broadcast from process 0. The
        PyTorch manager passes its process group's.
      compile_now: start compiling the policy's update in the background at once (see
        :meth:`cocijax.policies.Runner.compile`); a read-only manager, which never decides,
        passes False.
      drain_s: how long the last drain to a durable tier took (the JAX manager's tier), for
        :meth:`measurements`; ``None`` without a durable tier.

    Attributes:
      step: the last step given to :meth:`decide`, or None.
      step_time_s: the latest measured step time in seconds (NaN before the first); saved with
        the checkpoint so that a restarted job has one at once.
      cost_s: the last measured checkpoint cost in seconds (NaN before the first save).
      loss: the loss the policy sees with the next step when the caller has no newer one (the
        last saved step's, after a restore).
    """

    def __init__(
        self,
        policy: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
        history: RunHistory | None = None,
        prior_mtbf_s: float = math.nan,
        cost_from_intervals: bool = False,
        save_final_step: bool = False,
        broadcast: Callable[[np.ndarray], np.ndarray] = _broadcast_from_process_0,
        compile_now: bool = True,
        drain_s: Callable[[], float] | None = None,
    ):
        check_policy(policy)
        self.policy = policy
        self.runner = Runner(policy, broadcast=broadcast)
        if compile_now:
            # Now, so that no training step is charged for it, and in a thread: a restarted
            # job restores and compiles its training step meanwhile (measured in chaos_bench).
            self.runner.compile(background=True)
        self.history = history
        # A finished job keeps its final state (and a rerun of it has nothing left to train).
        self._final_step = getattr(policy, "total_steps", None) if save_final_step else None
        self._prior_mtbf_s = prior_mtbf_s
        self._clock = clock
        self._cost_from_intervals = cost_from_intervals
        self._drain_s = drain_s
        self._said_fresh = False  # a saved schedule that cannot continue is said once
        self.step: int | None = None
        self.step_time_s = math.nan
        self.cost_s = math.nan
        self.loss: Any = math.nan
        self._mark: float | None = None  # end of the previous call; None: the next is untimed
        self._saved_last = False  # the previous decision was "save" (cost_from_intervals)
        self._last: tuple[Any, float, float] = (math.nan, math.nan, math.nan)

    @property
    def state(self) -> Any:
        """The policy state (feeds the steps the runner recorded first)."""
        return self.runner.state

    @property
    def mtbf_s(self) -> float:
        """The MTBF passed to the policy: the history's estimate, NaN without a history."""
        if self.history is None or not math.isfinite(self._prior_mtbf_s):
            return math.nan
        return self.history.mtbf_s(self._prior_mtbf_s)

    @property
    def recovery_s(self) -> float:
        """The recovery time passed to the policy (NaN until one is measured)."""
        return math.nan if self.history is None else self.history.recovery_s

    def measurements(self) -> Measurements:
        """The inputs of the last :meth:`decide` call (reads its loss) and what the job learned."""
        loss, step_time, cost = self._last
        return Measurements(
            step_time_s=step_time,
            loss=read_loss(loss),
            cost_estimate_s=cost,
            last_save_s=self.cost_s,
            mtbf_s=self.mtbf_s,
            recovery_s=self.recovery_s,
            failures=0 if self.history is None else self.history.failures,
            drain_s=math.nan if self._drain_s is None else self._drain_s(),
        )

    def restart_timing(self) -> None:
        """The next interval is not timed (after opening, or a restore: compilation, loading)."""
        self._mark = None
        self._saved_last = False

    def decide(self, step: int, *, loss: Any) -> bool:
        """Measures the step that just ended, feeds it to the policy and returns its decision.

        Args:
          step: the completed training step (1-based).
          loss: its loss: a number or a staged one-element array (see :func:`stage_loss`),
            read only at the policy's next check.

        Returns:
          True when the policy says to checkpoint after this step, or it is the final step
          (``save_final_step``).
        """
        now = self._clock()
        if self._mark is not None:
            interval = max(now - self._mark, 0.0)
            if self._cost_from_intervals and self._saved_last:
                if math.isnan(self.step_time_s):
                    self.step_time_s = interval  # all there is: better than unknown
                else:
                    self.cost_s = max(interval - self.step_time_s, 0.0)
            else:
                self.step_time_s = interval
        if self.history is not None:
            self.history.step_done()
        self.step = step
        self._last = (loss, self.step_time_s, self.cost_s)
        decision = self.runner.update(
            step,
            loss=loss,
            step_time_s=self.step_time_s,
            checkpoint_cost_s=self.cost_s,
            mtbf_s=self.mtbf_s,
            recovery_s=self.recovery_s,
        )
        decision = decision or step == self._final_step
        self._saved_last = decision
        self._mark = self._clock()
        return decision

    @contextlib.contextmanager
    def saving(self) -> Iterator[dict[str, float]]:
        """Times a save's blocking part as the checkpoint cost; the next step excludes it.

        Yields a dict whose ``"cost_s"`` is filled in when the block exits (also on an error).
        """
        start = self._clock()
        measured: dict[str, float] = {"start": start}
        try:
            yield measured
        finally:
            end = self._clock()
            measured["cost_s"] = self.cost_s = end - start
            self._mark = end

    def snapshot(self, loss: Any) -> dict[str, Any]:
        """Captures what the checkpoint of the current step records (no device sync).

        Args:
          loss: the current step's loss as given by the user (read later, off the train loop).
        """
        return {
            "leaves": jax.tree_util.tree_flatten_with_path(self.state)[0],  # as of this step
            "state_type": type(self.state).__name__,
            "step": self.step,
            "step_time_s": self.step_time_s,
            "loss": loss,
            "history": None if self.history is None else self.history.to_json(),
        }

    def to_json(self, snapshot: dict[str, Any], *, cost_s: float) -> dict[str, Any]:
        """Serialises a :meth:`snapshot`, with the measured cost of the save that records it."""
        return {
            "format": _FORMAT,
            "state_type": snapshot["state_type"],
            "policy_state": [
                {"path": jax.tree_util.keystr(path), **_encode(leaf)}
                for path, leaf in snapshot["leaves"]
            ],
            "step": snapshot["step"],
            "step_time_s": snapshot["step_time_s"],
            "cost_s": cost_s,
            "loss": read_loss(snapshot["loss"]),
            "history": snapshot["history"],
        }

    def load_json(self, data: dict[str, Any], *, where: str) -> None:
        """Adopts state written by :meth:`to_json`.

        Args:
          data: the decoded JSON.
          where: the file it came from, for error messages.

        Raises:
          ValueError: the data was written by something else or by a different policy.
        """
        if not isinstance(data, dict) or data.get("format") not in _FORMATS:
            raise ValueError(f"{where}: not a cocijax policy state (expected format {_FORMAT}).")
        # Shapes and dtypes only: running init eagerly compiled every operation in it (COCI's:
        # ~0.45 s in a fresh process); its values are needed only for fields missing on disk.
        initial = jax.eval_shape(self.policy.init)
        template, treedef = jax.tree_util.tree_flatten_with_path(initial)
        paths = [jax.tree_util.keystr(path) for path, _ in template]
        entries = data.get("policy_state")
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError(f"{where}: the policy state on disk is not a list of leaves.")
        state_type = type(initial).__name__
        if data.get("state_type", state_type) != state_type:  # /1 did not record it
            raise ValueError(
                f"{where}: the policy state on disk is a {data['state_type']}, this policy's a "
                f"{state_type}: it was saved by another policy"
            )
        if all("path" in entry for entry in entries):
            by_path = {entry["path"]: entry for entry in entries}
            unknown = sorted(by_path.keys() - set(paths))
            if unknown:
                raise ValueError(
                    f"{where}: the policy state on disk has fields this policy does not "
                    f"({', '.join(unknown[:3])}): it was saved by another policy"
                )
        elif len(entries) == len(template):
            by_path = dict(zip(paths, entries, strict=True))
        else:
            raise ValueError(
                f"{where}: the policy state on disk has {len(entries)} leaves, this policy "
                f"{len(template)}: it was saved by another policy or an older cocijax"
            )
        # Everything is decoded before anything is adopted: a damaged file changes nothing.
        try:
            # Fields added to the policy since the state was saved keep their initial values.
            values = jax.tree.leaves(self.policy.init()) if set(paths) - by_path.keys() else None
            leaves = [
                _decode(by_path[path], like, f"{where} (leaf {path})")
                if path in by_path
                else values[i]
                for i, (path, (_, like)) in enumerate(zip(paths, template, strict=True))
            ]
            step = None if data["step"] is None else int(data["step"])
            times = [float(data[name]) for name in ("step_time_s", "cost_s", "loss")]
        except (KeyError, TypeError, AttributeError, OverflowError) as e:
            raise ValueError(f"{where}: the policy state on disk is malformed ({e!r})") from e
        self.runner.state = jax.tree.unflatten(treedef, leaves)
        self.step = step
        self.step_time_s, self.cost_s, self.loss = times

    def adopt(self, data: Any, *, where: str, stacklevel: int) -> bool:
        """Adopts a saved policy state (:meth:`load_json`), or warns once that it cannot.

        A state saved by another policy (or damaged) cannot be continued: the policy keeps the
        schedule it has, and :meth:`start_fresh` says so.

        Args:
          data: the decoded JSON saved with a checkpoint.
          where: the file it came from, for the warning.
          stacklevel: as for ``warnings.warn``, counted from the caller (1: its own line).

        Returns:
          Whether the state was adopted.
        """
        try:
            self.load_json(data, where=where)
        except (KeyError, TypeError, ValueError) as e:
            self.start_fresh(str(e), stacklevel=stacklevel + 1)
            return False
        return True

    def start_fresh(self, reason: str, *, stacklevel: int) -> None:
        """Warns that a saved schedule cannot be continued (once per driver, so per manager).

        Args:
          reason: why, naming the file.
          stacklevel: as for ``warnings.warn``, counted from the caller (1: its own line).
        """
        if self._said_fresh:
            return
        self._said_fresh = True
        warnings.warn(
            f"{reason}; this manager's policy starts its schedule fresh.",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )

    def load_history(self, data: dict[str, Any] | None) -> None:
        """Adopts the job history saved with a checkpoint (any policy's: it is the job's)."""
        if self.history is not None:
            saved = data.get("history") if isinstance(data, dict) else None
            self.history.adopt(saved if isinstance(saved, dict) else None)

    def compile_count(self) -> int:
        """How many times the batched update has been compiled (1 after the first step)."""
        return self.runner.compile_count()
