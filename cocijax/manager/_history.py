"""What a checkpoint directory knows about its job's failures: MTBF and recovery time, learned.

A policy needs the job's mean time between failures and its recovery time; users rarely know
either. The directory can tell:

* **Failures.** A writer marks the directory as running when it opens (``.cocijax-running``)
  and clean when it closes. Opening a directory whose marker is still there means the previous
  run did not close: one failure (a crash, a kill, a preemption without a clean exit). A marker
  that cannot be read counts as one failure too, with a warning. Such a failure lives on disk
  only in the marker until a checkpoint records it, so a run that closes before any of its
  saves has committed leaves the marker in place: the next run counts the same failure (once)
  instead of forgetting it.
* **Uptime.** Each checkpoint records the job's training time so far (previous runs' plus this
  run's, measured with a monotonic clock, so a wall clock going backwards never subtracts);
  a crashed run's time after its last save is not known and is not counted (which errs towards
  a shorter MTBF, i.e. towards more saves).
* **MTBF.** The posterior mean of a Gamma-Poisson model: failures are Poisson with rate
  ``lam`` over the uptime ``T``, the prior is a Gamma with the weight of one failure in
  ``prior_mtbf_s`` seconds, so ``E[lam] = (1 + failures) / (prior_mtbf_s + T)`` and the MTBF
  used is its inverse. With no history it is the prior; every failure and every hour of
  uptime moves it towards the job's own rate.
* **Recovery.** From the process start (or the manager's opening, if the start is unknown) to
  the first training step after a restore: imports, compilation, restore. Recorded with each
  checkpoint; the last measured value is used.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, final

MARKER = ".cocijax-running"


def process_age_s() -> float | None:
    """Seconds since this process started, or None where the platform does not tell."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # psutil missing, or no permission to read the process table
        return None


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

    Attributes:
      failures: failures of the job so far (previous runs that did not close cleanly).
      recovery_s: the last measured recovery time in seconds (NaN before the first).
    """

    def __init__(
        self,
        directory: os.PathLike | str,
        *,
        clock: Callable[[], float] = time.monotonic,
        writer: bool = True,
        opened_at_age_s: float | None = None,
    ):
        self._marker = Path(directory) / MARKER
        self._clock = clock
        self._writer = writer
        self._opened = clock()
        self._session_start = self._opened - (opened_at_age_s or 0.0)
        self._saved_uptime_s = 0.0  # uptime of previous runs, from the newest checkpoint
        self._unclean = False
        self._unrecorded = False  # the marker's failure is in no committed checkpoint yet
        self.failures = 0
        self.recovery_s = math.nan
        self._recovering = False
        if writer:
            self._unclean = self._unrecorded = self._read_marker()
            self._write_marker()

    def _read_marker(self) -> bool:
        """Whether the previous run left its marker (did not close cleanly)."""
        try:
            text = self._marker.read_bytes().decode()
        except UnicodeDecodeError:
            text = ""  # corrupt: reported below
        except FileNotFoundError:
            return False
        except OSError as e:
            warnings.warn(
                f"{self._marker}: cannot read the running marker ({e}); counted as one failure.",
                RuntimeWarning,
                stacklevel=3,
            )
            return True
        try:
            json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.warn(
                f"{self._marker}: the running marker is corrupt; counted as one failure.",
                RuntimeWarning,
                stacklevel=3,
            )
        return True

    def _write_marker(self) -> None:
        tmp = self._marker.with_name(MARKER + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "opened_unix_s": time.time()}))
        os.replace(tmp, self._marker)

    def adopt(self, saved: dict[str, Any] | None) -> None:
        """Takes the history saved with the newest checkpoint (``None``: a fresh directory).

        An unclean previous run adds one failure to the saved count, once.
        """
        saved = saved or {}
        self._saved_uptime_s = _non_negative(saved.get("uptime_s"), 0.0)
        self.failures = int(_non_negative(saved.get("failures"), 0.0)) + int(self._unclean)
        self.recovery_s = _non_negative(saved.get("recovery_s"), math.nan)

    def restored(self) -> None:
        """The state was restored: the next training step ends the recovery."""
        self._recovering = True

    def step_done(self) -> None:
        """A training step ended: closes a recovery in progress (cheap when there is none)."""
        if self._recovering:
            self._recovering = False
            self.recovery_s = max(0.0, self._clock() - self._session_start)

    @property
    def uptime_s(self) -> float:
        """Training time of the job so far: saved runs' plus this run's."""
        return self._saved_uptime_s + max(0.0, self._clock() - self._opened)

    def mtbf_s(self, prior_mtbf_s: float) -> float:
        """Posterior-mean MTBF estimate (see the module docstring)."""
        return (prior_mtbf_s + self.uptime_s) / (1.0 + self.failures)

    def to_json(self) -> dict[str, Any]:
        """What a checkpoint records (``adopt`` reads it back)."""
        return {
            "uptime_s": self.uptime_s,
            "failures": self.failures,
            "recovery_s": None if math.isnan(self.recovery_s) else self.recovery_s,
        }

    def recorded(self) -> None:
        """A checkpoint saved by this run has committed: the failures it carries are on record."""
        self._unrecorded = False

    def close(self) -> None:
        """Marks the directory clean: this run did not fail.

        The marker stays when the previous run's failure is not recorded yet (no save of this
        run committed): the next run counts that failure, once.

        Raises:
          OSError: the marker cannot be removed (names it); the next run will count one failure.
        """
        if self._writer:
            self._writer = False
            if not self._unrecorded:
                self._marker.unlink(missing_ok=True)


def _non_negative(value: Any, default: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond floats
        return default
    return v if math.isfinite(v) and v >= 0 else default
