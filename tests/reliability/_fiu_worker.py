"""Injected I/O errors: seeded libfiu trials in one process (``test_io_errors.py`` runs it).

Run as ``fiu-run -x python _fiu_worker.py CONFIG_JSON``: ``fiu-run -x`` preloads libfiu's POSIX
wrappers, and this process switches the failure points on and off itself through libfiu's C
API (``fiu_enable_random``/``fiu_disable``), so that faults hit saves only, not Python's imports
or the checks. One manager (two external roots, ``max_to_keep=3``) saves into one directory for
all trials of the process. A trial:

1. seeds libfiu's generator and enables the file failure points of ``posix/io/*``
   (:data:`POINTS`: ``open``, ``read``/``write`` and their ``p``/``v`` variants,
   ``truncate``, ``fsync``, ``fdatasync``, ``rename``, ``unlink``, directory reads), each with
   the trial's probability and libfiu's own errno for the call (EIO, ENOSPC, EINTR, ...);
2. saves two or three steps and waits (every fourth trial also closes the manager, which
   a new one replaces once faults are off), recording every exception and where it came from;
3. switches faults off and checks: every exception's message names a path under the test's
   directory; every listed step verifies and restores bit-exact; every step listed before the
   trial is still listed (or was dropped by retention, behind ``max_to_keep`` newer ones);
4. saves one more step without faults: it must succeed and commit, no stripe directory may be
   left that no step references, and at most ``max_to_keep`` steps may be listed.

Each trial is one JSON line on stdout; a trial that finds a problem also carries the steps
listed before it, the warnings and errors logged during it, and what the directory holds.

What a seed fixes: each trial's probability, number of saves and whether it closes, and the seed
of libfiu's generator. Not which call fails: the saves' threads (Orbax's, TensorStore's, the
writers') draw from libfiu's one generator in the order the scheduler picks, so a rerun with the
same seed fails other calls. The invariants hold for every interleaving; a problem is diagnosed
from what its record carries, not by a replay.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import random
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from reliability_helpers import orphaned_stripes, two_root_manager

# posix/io/* without: its network points (they break asyncio's self-pipe, not our files); the
# */reduce points (short reads and writes: libfiu 1.1 divides by the length asked for, so a
# zero-length write under them kills the process with SIGFPE, seen in this test); and close,
# which libfiu fails *without closing*, so a flock stays held, while Linux always releases the
# descriptor, whatever close(2) returns.
POINTS = (
    "posix/io/oc/open",
    *(
        f"posix/io/rw/{f}"
        for f in ("read", "pread", "readv", "preadv", "write", "pwrite", "writev", "pwritev")
    ),
    *(f"posix/io/rw/{f}" for f in ("truncate", "ftruncate")),
    *(f"posix/io/sync/{f}" for f in ("fsync", "fdatasync")),
    *(f"posix/io/dir/{f}" for f in ("rename", "unlink", "opendir", "fdopendir", "readdir")),
)
MAX_TO_KEEP = 3
HANDLER_OPTIONS = {"small_bytes": 4096, "chunk_bytes": 16 * 1024, "piece_bytes": 64 * 1024}


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((64, 128)).astype(np.float32),
        "m": rng.standard_normal((64, 128)).astype(np.float32),
        "b": rng.standard_normal((100,)).astype(np.float32),
        "step": np.int64(step),
    }


def open_manager(base: Path) -> Any:
    """The manager of every trial: two external roots under ``base``, ``max_to_keep=3``."""
    return two_root_manager(base, max_to_keep=MAX_TO_KEEP, handler_options=HANDLER_OPTIONS)


class Fiu:
    """libfiu's control API, in the library ``fiu-run -x`` preloaded into this process."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libfiu.so.0")
        self.lib.fiu_enable_random.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_uint,
            ctypes.c_float,
        ]
        self.lib.fiu_enable.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_uint,
        ]
        self.lib.fiu_disable.argtypes = [ctypes.c_char_p]
        self.lib.fiu_set_prng_seed.argtypes = [ctypes.c_uint]

    def enable(self, probability: float, seed: int, points: tuple[str, ...] = POINTS) -> None:
        self.lib.fiu_set_prng_seed(seed)
        for name in points:
            if self.lib.fiu_enable_random(name.encode(), 1, None, 0, probability) != 0:
                raise RuntimeError(f"fiu_enable_random({name!r}) failed")

    def fail(self, point: str, errno: int) -> None:
        """Makes every call of ``point`` fail with ``errno`` (libfiu's failinfo is the errno)."""
        if self.lib.fiu_enable(point.encode(), 1, ctypes.c_void_p(errno), 0) != 0:
            raise RuntimeError(f"fiu_enable({point!r}) failed")

    def disable(self, points: tuple[str, ...] = POINTS) -> None:
        for name in points:
            self.lib.fiu_disable(name.encode())


class _Log(logging.Handler):
    """Keeps the warnings and errors logged during a trial (Orbax's and cocijax's), for a report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}"[:400])


def _same(restored: Any, want: dict[str, Any]) -> bool:
    return set(restored) == set(want) and all(
        np.asarray(restored[k]).dtype == np.asarray(v).dtype
        and np.asarray(restored[k]).tobytes() == np.asarray(v).tobytes()
        for k, v in want.items()
    )


def _abstract() -> Any:
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state(0))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    from cocijax import storage

    base = Path(cfg["base"])
    fiu = Fiu()
    log = _Log()
    logging.getLogger().addHandler(log)
    mngr = open_manager(base)
    # A trial that hangs prints every thread's stack and ends the process (the test fails).
    faulthandler.enable()
    step = 1
    mngr.save(step, state(step), loss=1.0, force=True)  # warm-up: every import done
    mngr.wait_until_finished()
    for trial in range(cfg["trials"]):
        seed = cfg["seed"] * 100_003 + trial
        rng = random.Random(seed)
        probability = rng.choice(cfg["probabilities"])
        closes = trial % 4 == 3
        faulthandler.dump_traceback_later(cfg.get("trial_timeout_s", 120), exit=True)
        before = mngr.all_steps()
        log.lines.clear()
        errors: list[dict[str, str]] = []
        fiu.enable(probability, seed)
        try:
            for _ in range(rng.randint(2, 3)):
                step += 1
                try:
                    mngr.save(step, state(step), loss=1.0, force=True)
                    log.lines.append(f"save({step}) returned")
                except Exception as e:
                    errors.append(_error("save", e))
                    log.lines.append(f"save({step}) raised {type(e).__name__}")
            try:
                mngr.wait_until_finished()
            except Exception as e:
                errors.append(_error("wait_until_finished", e))
            if closes:
                try:
                    mngr.close()
                except Exception as e:
                    errors.append(_error("close", e))
        finally:
            fiu.disable()
        problems: list[str] = []
        if closes:
            mngr = open_manager(base)
        else:
            try:  # a failure reported already is not reported again
                mngr.wait_until_finished()
            except Exception as e:
                errors.append(_error("wait_until_finished (faults off)", e))
        for err in errors:
            if str(base) not in err["message"]:
                problems.append(f"{err['where']} raised without naming a path: {err}")
        listed = mngr.all_steps()
        for s in listed:
            found = storage.verify(mngr.item_directory(s))
            if found:
                said = "; ".join(f"{p.leaf_path} {p.file}: {p.what}" for p in found[:3])
                problems.append(f"listed step {s} does not verify: {said}")
            elif not _same(mngr.restore(s, target=_abstract()), state(s)):
                problems.append(f"listed step {s} restored a different tree")
        for s in before:
            if s not in listed and sum(x > s for x in listed) < MAX_TO_KEEP:
                problems.append(f"step {s}, listed before the faults, is gone: {listed}")
        step += 1
        try:
            mngr.save(step, state(step), loss=1.0, force=True)
            mngr.wait_until_finished()
        except Exception as e:
            problems.append(f"the save after the faults failed: {_error('save', e)}")
        after = mngr.all_steps()
        if step not in after:
            problems.append(f"the save after the faults did not commit: {after}")
        if len(after) > MAX_TO_KEEP:
            problems.append(f"{len(after)} steps listed after a clean save: {after}")
        if orphans := orphaned_stripes(mngr):
            problems.append(f"orphaned stripe directories: {orphans}")
        print(
            json.dumps(
                {
                    "trial": trial,
                    "seed": seed,
                    "probability": probability,
                    "errors": errors,
                    "problems": problems,
                    "listed": after,
                    # What happened, for a trial that found a problem: the steps listed
                    # before it, the trial's log, what the directory holds.
                    **(
                        {
                            "before": before,
                            "log": log.lines[-40:],
                            "on_disk": sorted(str(p.relative_to(base)) for p in _tops(base)),
                        }
                        if problems
                        else {}
                    ),
                }
            ),
            flush=True,
        )
    faulthandler.cancel_dump_traceback_later()
    mngr.close()
    return 0


def _tops(base: Path) -> list[Path]:
    """The checkpoint directory's entries and what its trash holds."""
    ckpt = base / "ckpt"
    trash = [p for p in (ckpt / ".cocijax-deleted").glob("*")]
    return [*ckpt.iterdir(), *trash]


def _error(where: str, e: BaseException) -> dict[str, str]:
    return {
        "where": where,
        "type": type(e).__name__,
        "message": str(e),
        "trace": "".join(traceback.format_exception(e))[-1500:],
    }


def exit_after(main: Callable[[], int]) -> NoReturn:
    """Runs ``main`` and ends the process with its status, without the interpreter's exit.

    A save that failed inside Orbax's synchronous part leaves Orbax's commit threads waiting
    for signals until its timeout (300 s), which would hold the interpreter's exit.
    """
    status = main()
    sys.stdout.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_after(main)
