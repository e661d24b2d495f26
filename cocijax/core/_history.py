"""What a checkpoint directory knows about its job's failures: MTBF and recovery time, learned.

A policy needs the job's mean time between failures and its recovery time; users rarely know
either. The directory can tell:

* **Failures.** A writer marks the directory as running when it opens (``.cocijax-running``)
  and clean when it closes. Opening a directory whose marker says "running" means the previous
  run did not close: one failure (a crash, a kill, a preemption without a clean exit). A run
  that leaves its ``with`` block by an exception (a peer rank died, ``KeyboardInterrupt``)
  did not end cleanly either: its close keeps the marker (:meth:`RunHistory.failed`). A marker
  that cannot be read counts as one failure too, with a warning. Such failures live on disk
  only in the marker until a checkpoint records them, so the marker holds the job's failure
  count: each open of an unclean marker adds one to it (four kills in a crash loop, before any
  save, are four failures), a committed save records the count, and a run that closes cleanly
  before any of its saves has committed leaves the count in a marker that says "closed", so
  that the next run counts those failures, once, and no new one.
* **Uptime.** Each checkpoint records the job's training time so far (previous runs' plus this
  run's, measured with a monotonic clock, so a wall clock going backwards never subtracts);
  a crashed run's time after its last save is not known and is not counted (which errs towards
  a shorter MTBF, i.e. towards more saves).
* **MTBF.** The posterior mean of a Gamma-Poisson model: failures are Poisson with rate
  ``lam`` over the uptime ``T``, the prior is a Gamma with the weight of one failure in
  ``prior_mtbf_s`` seconds, so ``E[lam] = (1 + failures) / (prior_mtbf_s + T)`` and the MTBF
  used is its inverse, kept within ``[MIN_MTBF_S, MAX_MTBF_S]``. With no history it is the
  prior; every failure and every hour of uptime moves it towards the job's own rate.
* **Failure classes.** With a memory tier (a folder on tmpfs) a writer also marks the tier (its
  own marker, holding a token the directory's marker repeats). A failed run whose memory marker
  survived was a *process failure* (the process died, the machine's memory did not: a memory
  snapshot recovers it); one whose memory marker is gone while the directory's says the run had
  one was a *machine failure* (a reboot, a lost host: only the disk or durable tier recovers
  it); with several processes marking tiers of their own (the PyTorch manager's ranks), any
  one's marker gone makes it a machine failure. Each class's rate is learned as above with its
  own prior, the prior's rate split :data:`MACHINE_SHARE` to machines (see
  :meth:`RunHistory.class_mtbf_s`); without a memory tier every failure is a process failure.
  Each class's recovery time is that of the runs that followed a failure of the class.
* **Recovery.** From the process start (or the manager's opening, if the start is unknown) to
  the first training step after a restore: imports, compilation, restore. Recorded with each
  checkpoint; the last measured value is used.

A history read back from a checkpoint is checked before it is believed (:func:`check_saved`):
a count that is not an integer, a time that is negative or not finite, or values beyond what
any job can have refuse the whole history, never half of it.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, final

import psutil

MARKER = ".cocijax-running"
# Bounds of a saved history, beyond which it is refused as damaged: a million restarts, and
# 10^9 s (32 years) of training or of one recovery, are more than any job has.
MAX_FAILURES = 10**6
MAX_SECONDS = 1e9
# The learned MTBF is kept within these. Below a second no schedule helps (a step and a save
# take longer) and the policies compute in float32, where a value that rounds to 0 is taken for
# "unknown": a history of 1e300 failures made coci fall back on its 24 h prior and save nothing.
# The ceiling keeps a finite value finite in float32 too.
MIN_MTBF_S = 1.0
MAX_MTBF_S = 1e12
# The share of failures that lose the machine (its memory), in the prior of the two classes:
# most interruptions of large jobs leave the host's memory intact (Llama 3 405B: 78% of 419
# were hardware, mostly GPUs and their memory; the host survived them).
MACHINE_SHARE = 0.2
# The failure classes (see the module docstring).
PROCESS, MACHINE = "process", "machine"


def process_age_s() -> float | None:
    """Seconds since this process started, or None where the platform does not tell."""
    try:
        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # no permission to read the process table
        return None


def failed_exit(error: BaseException | None, *, preempted: bool) -> bool:
    """Whether a manager's ``with`` block left by ``error`` ends the run by a failure.

    Every exception is one (a peer rank that died, a bug, ``KeyboardInterrupt``), except
    ``SystemExit`` with status 0 or None and ``GeneratorExit`` (the program chose to end), and
    any exit after a preemption save (the job saved and leaves, as it was asked to).
    """
    if error is None or preempted or isinstance(error, GeneratorExit):
        return False
    return not (isinstance(error, SystemExit) and error.code in (None, 0))


def check_saved(saved: Any) -> tuple[dict[str, float] | None, str]:
    """A history as a checkpoint recorded it (:meth:`RunHistory.to_json`), checked.

    Args:
      saved: the decoded ``history`` entry of a policy item, or None.

    Returns:
      ``(history, "")`` with ``uptime_s``, ``failures``, ``machine_failures`` and the
      recovery times ``recovery_s`` (the last, any class), ``process_recovery_s`` and
      ``machine_recovery_s`` (NaN: none measured), a missing field taking its value of a
      fresh job; or ``(None, reason)`` when
      the history is not one a job can have.
    """
    if saved is None:
        saved = {}
    if not isinstance(saved, dict):
        return None, f"the history is a {type(saved).__name__}, not an object"
    failures = saved.get("failures", 0)
    if type(failures) is not int or not 0 <= failures <= MAX_FAILURES:
        return None, f"failures={failures!r} is not an integer in [0, {MAX_FAILURES}]"
    machine = saved.get("machine_failures", 0)
    if type(machine) is not int or not 0 <= machine <= failures:
        return None, f"machine_failures={machine!r} is not an integer in [0, failures={failures}]"
    out: dict[str, Any] = {"failures": failures, "machine_failures": machine}
    for name, default in (
        ("uptime_s", 0.0),
        ("recovery_s", None),
        ("process_recovery_s", None),
        ("machine_recovery_s", None),
    ):
        value = saved.get(name, default)
        if value is None and name != "uptime_s":
            out[name] = math.nan
            continue
        if type(value) not in (int, float) or not 0.0 <= value <= MAX_SECONDS:
            return None, f"{name}={value!r} is not a number of seconds in [0, {MAX_SECONDS:g}]"
        out[name] = float(value)
    return out, ""


@final
class RunHistory:
    """Failures, uptime and recovery of the job writing a checkpoint directory.

    Args:
      directory: the checkpoint directory.
      clock: monotonic clock in seconds (injectable for tests).
      writer: whether this process marks the directory (the primary writer); readers and other
        processes of a job only read what is saved with the checkpoints.
      opened_at_age_s: the process's age when the manager opened, if known (see
        :func:`process_age_s`): recovery is measured from the process start then.
      memory_marker: the writer's marker in its memory tier (a file on tmpfs), or None without
        one: whether it survived a failed run tells a process failure from a machine failure.
      token: this run's token in the memory markers (default: a new one). Processes of a job
        that keep memory tiers of their own write the writer's token into theirs
        (:func:`write_memory_marker`).
      peer_memory_tokens: the tokens the job's other processes found in their memory markers
        at opening (:func:`read_memory_token`): one that is not the failed run's (a host whose
        memory was lost) makes the failure a machine failure too.

    Attributes:
      failures: failures of the job so far (runs that did not close cleanly).
      machine_failures: those of them that lost the machine's memory (see the module docstring).
      failure_class: the class of the failure this run recovers from (``"process"`` or
        ``"machine"``), or None after a clean close (or for a reader).
      recovery_s: the last measured recovery time in seconds, any class (NaN before the first).
    """

    def __init__(
        self,
        directory: os.PathLike | str,
        *,
        clock: Callable[[], float] = time.monotonic,
        writer: bool = True,
        opened_at_age_s: float | None = None,
        memory_marker: os.PathLike | str | None = None,
        token: str | None = None,
        peer_memory_tokens: Sequence[str | None] = (),
    ):
        self._marker = Path(directory) / MARKER
        self._memory_marker = None if memory_marker is None else Path(memory_marker)
        self._token = token or os.urandom(8).hex()  # this run's, in both markers
        self._peer_tokens = list(peer_memory_tokens)
        self._clock = clock
        self._writer = writer
        self._opened = clock()
        self._session_start = self._opened - (opened_at_age_s or 0.0)
        self._saved_uptime_s = 0.0  # uptime of previous runs, from the newest checkpoint
        # The marker's counts of the job's failures (those of runs that no checkpoint recorded
        # included), and the class of the previous run's failure (None: it closed cleanly).
        self._marked, self._marked_machine, self.failure_class = 0, 0, None
        self._recorded = self._recorded_machine = 0  # failures the newest checkpoint records
        self._failed = False  # this run left by an exception: its close keeps the marker
        self.failures = self.machine_failures = 0
        self.recovery_s = math.nan
        self._class_recovery_s = {PROCESS: math.nan, MACHINE: math.nan}
        self._recovering = False
        if writer:
            self._marked, self._marked_machine, self.failure_class = self._read_marker()
            self.failures, self.machine_failures = self._counted()
            self._write_marker()

    def _counted(self) -> tuple[int, int]:
        """The job's failures of both kinds: those on record plus this run's cause."""
        machine = max(self._marked_machine, self._recorded_machine)
        machine += self.failure_class == MACHINE
        total = max(self._marked, self._recorded) + (self.failure_class is not None)
        return min(total, MAX_FAILURES), min(machine, total, MAX_FAILURES)

    def _read_marker(self) -> tuple[int, int, str | None]:
        """The previous run's marker: ``(failures, machine failures, class of its failure)``."""
        try:
            text = self._marker.read_bytes().decode()
        except UnicodeDecodeError:
            text = ""  # corrupt: reported below
        except FileNotFoundError:
            return 0, 0, None  # it closed cleanly with every failure recorded
        except OSError as e:
            warnings.warn(
                f"{self._marker}: cannot read the running marker ({e}); counted as one failure.",
                RuntimeWarning,
                stacklevel=3,
            )
            return 0, 0, PROCESS
        try:
            mark = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            mark = None
        counted, _ = check_saved(mark) if isinstance(mark, dict) else (None, "")
        if counted is None:
            warnings.warn(
                f"{self._marker}: the running marker is corrupt; counted as one failure.",
                RuntimeWarning,
                stacklevel=3,
            )
            return 0, 0, PROCESS
        # A marker written before markers held a count reads as 0, and "running".
        failed = mark.get("closed") is not True
        token = mark.get("memory_token")
        found = [self._memory_token(), *self._peer_tokens]
        lost = failed and isinstance(token, str) and any(t != token for t in found)
        return (
            counted["failures"],
            counted["machine_failures"],
            ((MACHINE if lost else PROCESS) if failed else None),
        )

    def _memory_token(self) -> str | None:
        """The token in the memory tier's marker (None: gone, or no memory tier now)."""
        return None if self._memory_marker is None else read_memory_token(self._memory_marker)

    def _write_marker(self, *, closed: bool = False) -> None:
        mark = {
            "pid": os.getpid(),
            "opened_unix_s": time.time(),
            "failures": self.failures,
            "machine_failures": self.machine_failures,
        }
        if self._memory_marker is not None:
            # The memory tier's marker first: the directory's names it only once it exists.
            write_memory_marker(self._memory_marker, self._token)
            mark["memory_token"] = self._token
        _write_json(self._marker, {**mark, "closed": closed})

    def adopt(self, saved: Any) -> str:
        """Takes the history saved with the newest checkpoint (``None``: a fresh directory).

        The job's failures are the more of the checkpoint's and the marker's count, plus one
        when the previous run failed (of each class). A history that :func:`check_saved`
        refuses counts as none (the marker's count stays).

        Returns:
          ``""``, or why the saved history was refused.
        """
        checked, reason = check_saved(saved)
        if checked is None:
            checked, _ = check_saved(None)
        self._saved_uptime_s = checked["uptime_s"]
        self._recorded, self._recorded_machine = checked["failures"], checked["machine_failures"]
        self.recovery_s = checked["recovery_s"]
        self._class_recovery_s = {
            PROCESS: checked["process_recovery_s"],
            MACHINE: checked["machine_recovery_s"],
        }
        counts = self._counted()
        changed = counts != (self.failures, self.machine_failures)
        self.failures, self.machine_failures = counts
        if self._writer and changed:
            self._write_marker()  # a crash from now on counts from this
        return reason

    def restored(self) -> None:
        """The state was restored: the next training step ends the recovery."""
        self._recovering = True

    def step_done(self) -> None:
        """A training step ended: closes a recovery in progress (cheap when there is none)."""
        if self._recovering:
            self._recovering = False
            self.recovery_s = max(0.0, self._clock() - self._session_start)
            self._class_recovery_s[self.failure_class or PROCESS] = self.recovery_s

    def class_recovery_s(self, failure_class: str) -> float:
        """The last recovery time measured after a failure of ``failure_class`` (NaN: none)."""
        return self._class_recovery_s[failure_class]

    @property
    def uptime_s(self) -> float:
        """Training time of the job so far: saved runs' plus this run's."""
        return self._saved_uptime_s + max(0.0, self._clock() - self._opened)

    def mtbf_s(self, prior_mtbf_s: float) -> float:
        """Posterior-mean MTBF estimate, within its bounds (see the module docstring)."""
        return _mtbf(prior_mtbf_s, self.uptime_s, self.failures)

    def class_mtbf_s(self, failure_class: str, prior_mtbf_s: float) -> float:
        """The MTBF of one failure class: its own count, and its share of the prior's rate
        (:data:`MACHINE_SHARE` for machines, the rest for processes)."""
        machine = failure_class == MACHINE
        share = MACHINE_SHARE if machine else 1.0 - MACHINE_SHARE
        count = self.machine_failures if machine else self.failures - self.machine_failures
        return _mtbf(prior_mtbf_s / share, self.uptime_s, count)

    def to_json(self) -> dict[str, Any]:
        """What a checkpoint records (``adopt`` reads it back)."""
        times = {
            "recovery_s": self.recovery_s,
            "process_recovery_s": self._class_recovery_s[PROCESS],
            "machine_recovery_s": self._class_recovery_s[MACHINE],
        }
        return {
            "uptime_s": min(self.uptime_s, MAX_SECONDS),
            "failures": self.failures,
            "machine_failures": self.machine_failures,
            **{k: None if math.isnan(v) else v for k, v in times.items()},
        }

    def recorded(self) -> None:
        """A checkpoint saved by this run has committed: the failures it carries are on record."""
        self._recorded, self._recorded_machine = self.failures, self.machine_failures

    def failed(self) -> None:
        """This run ends by an exception: :meth:`close` keeps the marker, the next run counts it."""
        self._failed = True

    def close(self) -> None:
        """Marks the directory clean, unless this run :meth:`failed`.

        The marker is removed when a committed checkpoint records every failure; otherwise it
        stays, saying "closed" with the count, so that the next run counts those failures once.

        Raises:
          OSError: the marker cannot be removed or rewritten (names it); the next run will
            count one failure more.
        """
        if self._writer:
            self._writer = False
            if self._failed:
                return
            if self._recorded >= self.failures:
                self._marker.unlink(missing_ok=True)
            else:
                self._write_marker(closed=True)


def _mtbf(prior_mtbf_s: float, uptime_s: float, failures: int) -> float:
    mtbf = (prior_mtbf_s + uptime_s) / (1.0 + failures)
    return min(max(mtbf, MIN_MTBF_S), MAX_MTBF_S)


def read_memory_token(path: os.PathLike | str) -> str | None:
    """The run token in the memory marker ``path`` (None: gone, unreadable, or not a marker)."""
    try:
        token = json.loads(Path(path).read_bytes()).get("token")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return token if isinstance(token, str) else None


def write_memory_marker(path: os.PathLike | str, token: str) -> None:
    """Writes a memory marker holding ``token`` (see :class:`RunHistory`'s ``token``)."""
    _write_json(Path(path), {"token": token, "pid": os.getpid()})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
