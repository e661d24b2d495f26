"""Preemption: a signal becomes one save, taken at the same step by every process of a job.

A preemptible machine gets a notice (SIGTERM on most schedulers) some seconds before it goes.
:class:`PreemptionWatcher` installs a handler for the chosen signals when a manager opens (in
the main thread: Python runs signal handlers nowhere else) and puts the previous handlers back
when it closes. The handler only records the signal; the manager asks :meth:`PreemptionWatcher.due`
once per training step and, when it says so, saves that step whatever its policy says and waits
for the commit. How the processes of a job agree on that step:

* **One process**: the first step after the signal.
* **JAX's preemption service** (``jax.distributed`` is initialised and
  ``jax_enable_preemption_service`` is on, JAX's default): JAX catches SIGTERM itself and its
  coordination service picks a step every process reaches; ``service`` (Orbax's
  ``multihost.reached_preemption``) is asked at every step, as JAX requires. The watcher then
  leaves SIGTERM to JAX (a Python handler would replace JAX's).
* **Otherwise**, every process contributes its flag to a small all-gather at agreed steps: the
  first step, then about once per second of process 0's measured step time (at most every
  1000 steps). Every process takes the save at the first such step after any of them got the
  signal. Between those steps a call costs an integer comparison.

Nothing here imports JAX or PyTorch: each manager passes its own ``allgather`` and ``service``.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, final

import numpy as np

__all__ = ["PreemptionWatcher", "check_signals"]

# Training seconds (process 0's step time) between two flag exchanges across processes; far
# below the 30 s or more of notice that schedulers give.
EXCHANGE_EVERY_S = 1.0
MAX_EXCHANGE_STEPS = 1000


def check_signals(signals: Any) -> tuple[signal.Signals, ...]:
    """``preemption_signals`` as a tuple of ``signal.Signals``; ``()`` turns preemption off.

    Raises:
      TypeError: not a sequence of signals.
      ValueError: a number that is no signal, or one that cannot be caught (SIGKILL, SIGSTOP).
    """
    if isinstance(signals, int | str) or not isinstance(signals, Iterable):
        raise TypeError(
            f"preemption_signals: expected a tuple of signals such as (signal.SIGTERM,), "
            f"got {signals!r}."
        )
    out: list[signal.Signals] = []
    for sig in signals:
        if isinstance(sig, bool) or not isinstance(sig, int):
            raise TypeError(f"preemption_signals: {sig!r} is not a signal number.")
        try:
            sig = signal.Signals(sig)
        except ValueError as e:
            raise ValueError(f"preemption_signals: {sig} is not a signal on this system.") from e
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"preemption_signals: {sig.name} cannot be caught.")
        if sig not in out:
            out.append(sig)
    return tuple(out)


@final
class PreemptionWatcher:
    """Turns preemption signals into one save step that every process agrees on.

    Args:
      signals: the signals that announce a preemption (see :func:`check_signals`).
      owner: names the manager in warnings (e.g. its directory).
      allgather: with several processes, a function that gathers a small float array from
        every process (shape ``(processes, *shape)``), called at the same steps everywhere;
        ``None`` for a single process.
      service: a ``step -> bool`` preemption sync point that catches SIGTERM itself (JAX's
        preemption service through Orbax's ``multihost.reached_preemption``), asked at every
        step; ``None`` when there is none.

    Attributes:
      signal: the first preemption signal this process received, or ``None``.
      reached: the preemption step was given (``due`` returned True once).
      polled: :meth:`due` must be called at every step; otherwise only once ``signal`` is set
        (a single process: one attribute test per step).

    Example:
      >>> import os, signal
      >>> watcher = PreemptionWatcher((signal.SIGUSR1,), owner="demo")
      >>> watcher.install()
      >>> watcher.due(1)
      False
      >>> os.kill(os.getpid(), signal.SIGUSR1)
      >>> watcher.due(2), watcher.due(3), watcher.reached
      (True, False, True)
      >>> watcher.uninstall()
    """

    def __init__(
        self,
        signals: Iterable[int],
        *,
        owner: str,
        allgather: Callable[[np.ndarray], np.ndarray] | None = None,
        service: Callable[[int], bool] | None = None,
    ):
        self.signals = check_signals(signals)
        self._owner = owner
        self._service = service if signal.SIGTERM in self.signals else None
        # JAX's preemption service owns SIGTERM: a Python handler would replace its own.
        self._own = tuple(s for s in self.signals if not (service and s == signal.SIGTERM))
        self._allgather = allgather if self._own else None
        # `due` must be called at every step (not only after a signal of this process).
        self.polled = self._service is not None or self._allgather is not None
        self._previous: dict[signal.Signals, Any] = {}
        self._active = False
        self._next_exchange = 0  # the first call exchanges (every process makes it)
        self.signal: signal.Signals | None = None
        self.reached = False

    def install(self) -> None:
        """Installs the handlers; outside the main thread, warns and installs nothing."""
        if not self._own:
            return
        if threading.current_thread() is not threading.main_thread():
            names = ", ".join(s.name for s in self._own)
            warnings.warn(
                f"{self._owner}: a handler for {names} can only be installed in the main "
                f"thread, and this manager was opened in thread "
                f"{threading.current_thread().name!r}: a preemption signal will not be "
                "turned into a save. Open the manager in the main thread, or pass "
                "preemption_signals=() to turn this off.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self._active = True
        for sig in self._own:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Puts the previous handlers back (where ours is still the installed one)."""
        self._active = False
        if threading.current_thread() is not threading.main_thread():
            return  # our handler stays, inactive: it passes signals to the previous handler
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes: only record (no locks, no logging).
        if self._active:
            if self.signal is None:
                self.signal = signal.Signals(signum)
            return
        previous = self._previous.get(signal.Signals(signum))  # closed: not ours to handle
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def due(self, step: int, step_time_s: float = math.nan) -> bool:
        """Whether ``step`` is the preemption save step; True at one step only.

        Call it at every training step, with the same steps on every process.

        Args:
          step: the completed training step.
          step_time_s: this process's measured step time (process 0's sets how often the
            processes exchange their flags); NaN if unknown.
        """
        if self.reached:
            return False
        fire = self._service is not None and self._service(step)
        if self._allgather is None:
            fire = fire or self.signal is not None
        elif step >= self._next_exchange:
            fire = self._exchange(step, step_time_s) or fire
        self.reached = fire
        return fire

    def _exchange(self, step: int, step_time_s: float) -> bool:
        every = 1  # step time not known yet (the first steps): exchange again at the next step
        if math.isfinite(step_time_s) and step_time_s > 0:
            every = min(MAX_EXCHANGE_STEPS, max(1, round(EXCHANGE_EVERY_S / step_time_s)))
        mine = np.asarray([0.0 if self.signal is None else 1.0, every], np.float64)
        gathered = np.asarray(self._allgather(mine)).reshape(-1, 2)
        self._next_exchange = step + int(gathered[0, 1])  # process 0's interval, everywhere
        return bool(gathered[:, 0].any())
