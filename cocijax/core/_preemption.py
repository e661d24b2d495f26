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

**Several managers in one process** (a training state and an EMA, say) each take their
preemption save: the handler is installed once per signal for all of them (chained to the
handler that was there before the first), and a signal reaches every open manager.

**Ending the job.** Without cocijax a SIGTERM ends the process (status 143); a manager that only
set a flag would let a loop that does not check it train on until the scheduler's SIGKILL. So by
default (``exit_on_preemption=True``), once every open manager of the process has taken its
preemption save, they are closed cleanly and the signal is delivered to the handler that was
there before cocijax's: the default action ends the process as the signal would have, a Python
handler is called, an ignored signal stays ignored. A loop that checks ``reached_preemption``
and wants control passes ``exit_on_preemption=False`` to its managers.

Nothing here imports JAX or PyTorch: each manager passes its own ``allgather`` and ``service``.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, final

import numpy as np

__all__ = ["Preemption", "PreemptionWatcher", "check_signals"]

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


class _Chain:
    """The handler of one signal for every watcher of the process, and the one it replaced.

    Attributes:
      previous: the handler installed before the first watcher's (``signal.getsignal``'s).
      watchers: the installed watchers of this signal, oldest first.
    """

    def __init__(self, previous: Any):
        self.previous = previous
        self.watchers: list[PreemptionWatcher] = []


# Signals whose default action does not end the process: delivering one closes nothing.
_HARMLESS = frozenset(
    getattr(signal, name)
    for name in ("SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH")
    if hasattr(signal, name)
)
# Signal -> its chain. Touched only in the main thread (installing, uninstalling, handling).
_CHAINS: dict[signal.Signals, _Chain] = {}


def _dispatch(signum: int, frame: Any) -> None:
    """The one Python handler of a watched signal: every installed watcher records it."""
    # Runs in the main thread between two bytecodes: only record (no locks, no logging).
    sig = signal.Signals(signum)
    chain = _CHAINS.get(sig)
    if chain is None or not chain.watchers:  # every watcher is gone: not ours to handle
        _deliver(sig, None if chain is None else chain.previous, frame)
        return
    for watcher in chain.watchers:
        if watcher.signal is None:
            watcher.signal = sig


def _deliver(sig: signal.Signals, previous: Any, frame: Any = None) -> None:
    """Hands a signal to ``previous``: a Python handler is called, the default action taken."""
    if callable(previous):
        previous(int(sig), frame)
    elif previous in (signal.SIG_DFL, None):
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)  # the default action: most signals end the process here
    # signal.SIG_IGN: ignored, as it would have been


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
      exit_on_preemption: once every watcher of the process has given its preemption step and
        its manager reported the save committed (:meth:`end_job`), deliver the signal to the
        handler cocijax replaced (see the module docstring).

    Attributes:
      signal: the first preemption signal this process received, or ``None``.
      reached: the preemption step was given (``due`` returned True once).
      polled: :meth:`due` must be called at every step; otherwise only once ``signal`` is set
        (a single process: one attribute test per step).

    Example:
      >>> import os, signal
      >>> watcher = PreemptionWatcher((signal.SIGUSR1,), owner="demo", exit_on_preemption=False)
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
        exit_on_preemption: bool = True,
    ):
        if not isinstance(exit_on_preemption, bool):
            raise TypeError(f"exit_on_preemption: expected a bool, got {exit_on_preemption!r}.")
        self.signals = check_signals(signals)
        self._owner = owner
        self._service = service if signal.SIGTERM in self.signals else None
        # JAX's preemption service owns SIGTERM: a Python handler would replace its own.
        self._own = tuple(s for s in self.signals if not (service and s == signal.SIGTERM))
        self._allgather = allgather if self._own else None
        # `due` must be called at every step (not only after a signal of this process).
        self.polled = self._service is not None or self._allgather is not None
        self._exit = exit_on_preemption
        self._installed: tuple[signal.Signals, ...] = ()
        self._on_end: Callable[[], object] | None = None
        self._next_exchange = 0  # the first call exchanges (every process makes it)
        self.signal: signal.Signals | None = None
        self.reached = False
        self.done = False  # the manager reported its preemption save committed

    def install(self, on_end: Callable[[], object] | None = None) -> None:
        """Installs the handlers; outside the main thread, warns and installs nothing.

        Args:
          on_end: closes this watcher's manager cleanly before the job ends (see
            :meth:`end_job`).
        """
        self._on_end = on_end
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
        for sig in self._own:
            current = signal.getsignal(sig)
            chain = _CHAINS.get(sig)
            if chain is None or current is not _dispatch:
                # First watcher, or someone replaced ours since: chain to what is there now.
                chain = _CHAINS[sig] = _CHAINS.get(sig) or _Chain(current)
                if current is not _dispatch:
                    chain.previous = current
                signal.signal(sig, _dispatch)
            chain.watchers.append(self)
        self._installed = self._own

    def uninstall(self) -> None:
        """Stops watching; the last watcher of a signal puts its previous handler back.

        Outside the main thread the handler stays installed: with no watcher left it hands
        every signal to the previous handler.
        """
        main = threading.current_thread() is threading.main_thread()
        for sig in self._installed:
            chain = _CHAINS.get(sig)
            if chain is None or self not in chain.watchers:
                continue
            chain.watchers.remove(self)
            if not chain.watchers and main:
                if signal.getsignal(sig) is _dispatch:
                    previous = chain.previous
                    signal.signal(sig, signal.SIG_DFL if previous is None else previous)
                del _CHAINS[sig]
        self._installed = ()

    def end_job(self) -> None:
        """Called once this watcher's preemption save has committed: ends the job if due.

        With ``exit_on_preemption``, once every watcher of the signal in the process is done
        (each took its save), the signal (SIGTERM, in a process of a job whose other process was
        the one notified) goes where it would have gone without cocijax: to the
        default action (every manager is closed first, so that the next run finds clean
        markers and no lock), or to the Python handler that was there (called; the managers
        stay open), or nowhere if it was ignored. Otherwise nothing happens.
        """
        self.done = True
        sig = self.signal
        if sig is None and self.reached and self._installed:
            # Another process of the job got the signal: the job is preempted all the same, and
            # this process ends with it (as the one notified does), not at its next collective.
            sig = signal.SIGTERM if signal.SIGTERM in self._installed else self._installed[0]
        if not self._exit or sig is None or sig not in self._installed:
            return
        chain = _CHAINS[sig]
        if not all(w.done and w._exit for w in chain.watchers):
            return  # another manager of this process has not taken its preemption save yet
        previous = chain.previous
        if not callable(previous) and previous != signal.SIG_IGN and sig not in _HARMLESS:
            for watcher in list(chain.watchers):
                if watcher._on_end is not None:
                    watcher._on_end()  # closes the manager (uninstalls its watcher)
        _deliver(sig, previous)

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


@final
class Preemption:
    """A manager's preemption save: whether a step is it, and what follows it.

    Both managers ask :meth:`due` at every ``save`` (one attribute test, unless the processes
    must poll together), save the step whatever the policy says when it is due, then call
    :meth:`taken`.

    Args:
      watcher: the manager's :class:`PreemptionWatcher` (installed by the manager).
      owner: names the manager in the log (its directory).

    Attributes:
      step: the preemption step, once due: the job resumes from it, so retention keeps it.
      reached: its save has committed (the manager's ``reached_preemption``).
    """

    def __init__(self, watcher: PreemptionWatcher, *, owner: str):
        self.watcher = watcher
        self._owner = owner
        self.step: int | None = None
        self.reached = False

    def due(self, step: int, step_time_s: float) -> bool:
        """Whether ``step`` is the preemption save step (True at one step only)."""
        watcher = self.watcher
        due = (watcher.polled or watcher.signal is not None) and watcher.due(step, step_time_s)
        if due:
            self.step = step
        return due

    def taken(self, step: int, wait: Callable[[], None]) -> None:
        """The preemption save of ``step`` has started: waits for its commit (``wait``), then
        ends the job as the signal would have, by default (see :meth:`PreemptionWatcher.end_job`).
        """
        wait()
        self.reached = True
        logging.getLogger(__name__).info(
            "%s: preemption signal: step %d saved and committed", self._owner, step
        )
        self.watcher.end_job()  # by default the process ends here, as it would have
