"""Closing a manager while libfiu fails calls: ``test_io_errors.py`` runs it under ``fiu-run -x``.

Three scenarios, each in its own directory and in this one process (a lock kept by a failed
close would make the next manager of the process fail to open). Each prints one JSON line: the
errors raised (type, message with notes) and what a new manager opened afterwards saw.

* ``failed-save``: every ``fsync`` fails while step 2 saves and the manager closes.
* ``marker-unlink-fails``: every ``unlink`` fails while the manager closes (trash, marker).
* ``crash-then-failed-save``: the previous run crashed (its running marker is there); this run
  opens, its only save fails (``fsync``), and it closes: the crash must still be counted once,
  by the next run and by the one after it, once a save has recorded it.
"""

from __future__ import annotations

import errno
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from _fiu_worker import Fiu, exit_after, open_manager

import cocijax as cj
from cocijax.core._history import MARKER
from cocijax.core._lock import DirectoryLock


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((64, 64), step, np.float32), "step": np.int64(step)}


def text(e: BaseException) -> str:
    return "\n".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", ())])


def faulted(fiu: Fiu, points: tuple[str, ...], *calls: Any) -> list[str]:
    """Runs ``calls`` with ``points`` failing every time with EIO; returns the errors raised.

    The errno is fixed: left to libfiu, it is drawn from each call's possible errors, and an
    ``unlink`` failing with ENOENT says the marker is already gone, which is no failure.
    """
    errors = []
    for point in points:
        fiu.fail(point, errno.EIO)
    try:
        for call in calls:
            try:
                call()
            except Exception as e:
                errors.append(text(e))
    finally:
        fiu.disable(points)
    return errors


def after(base: Path) -> dict[str, Any]:
    """What the next run sees: the lock must be free, its steps intact; it then saves."""
    out: dict[str, Any] = {"marker_left": (base / "ckpt" / MARKER).exists()}
    lock = DirectoryLock(base / "ckpt")
    try:
        lock.acquire()
        lock.release()
        out["lock_free"] = True
    except cj.manager.DirectoryLockedError:
        out["lock_free"] = False
        return out
    mngr = open_manager(base)
    out["failures"] = mngr.measurements.failures
    out["steps"] = mngr.all_steps()
    out["restores"] = all(np.array_equal(mngr.restore(s)["w"], state(s)["w"]) for s in out["steps"])
    step = (mngr.latest_step() or 0) + 10
    mngr.save(step, state(step), loss=1.0, force=True)
    mngr.close()
    out["saved"] = step
    out["marker_after_clean_close"] = (base / "ckpt" / MARKER).exists()
    again = open_manager(base)
    out["failures_after_clean_close"] = again.measurements.failures
    again.close()
    return out


def main() -> int:
    top = Path(sys.argv[1])
    fiu = Fiu()
    fsync = ("posix/io/sync/fsync", "posix/io/sync/fdatasync")
    unlink = ("posix/io/dir/unlink",)
    for name in ("failed-save", "marker-unlink-fails", "crash-then-failed-save"):
        base = top / name
        base.mkdir()
        record: dict[str, Any] = {"scenario": name}
        try:
            if name == "crash-then-failed-save":
                first = open_manager(base)
                first.save(1, state(1), loss=1.0, force=True)
                first.close()
                # What a killed run leaves: its marker (written by an open, never removed).
                (base / "ckpt" / MARKER).write_text(json.dumps({"pid": 1, "opened_unix_s": 0}))
            mngr = open_manager(base)
            record["failures_at_open"] = mngr.measurements.failures
            if name != "crash-then-failed-save":
                mngr.save(1, state(1), loss=1.0, force=True)
                mngr.wait_until_finished()
            if name == "marker-unlink-fails":
                record["errors"] = faulted(fiu, unlink, mngr.close)
            else:
                save = lambda m=mngr: m.save(2, state(2), loss=1.0, force=True)
                record["errors"] = faulted(fiu, fsync, save, mngr.wait_until_finished, mngr.close)
            record.update(after(base))
        except Exception as e:
            record["crashed"] = "".join(traceback.format_exception(e))[-3000:]
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    exit_after(main)
