"""A writer and its readers in separate processes (``test_concurrent_readers.py`` runs them).

``python _readers.py writer CONFIG_JSON``: a manager with two external roots and
``max_to_keep=1`` saves a new step (every leaf set by the step) as fast as it can for
``duration_s`` seconds, so that every save deletes the previous step and collects its stripes;
it writes ``ready`` after its first commit and ``done`` (the steps it saved) at the end.

``python _readers.py reader CONFIG_JSON``: once ``ready`` exists, a read-only manager restores
in a loop until ``done`` appears, alternating

* ``restore()``, the newest step: must return the complete tree of ``restored_step`` (every
  leaf equal to what the writer saved at that step: a mixed or partial tree fails);
* ``restore(step)`` of the step it listed just before: that tree, or ``StepDeletedError``
  when the writer deleted the step meanwhile;
* ``cocijax verify DIR`` (the command's ``main``, in this process): exit status 0.

It prints one JSON line: the counts of each outcome and every problem (an unexpected error, a
wrong tree, a non-zero exit status).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

HANDLER_OPTIONS = {"small_bytes": 4096, "chunk_bytes": 32 * 1024, "piece_bytes": 64 * 1024}


ROWS = 128


def state(step: int, rows: int | None = None) -> dict[str, Any]:
    """Leaves large enough for several pieces per root, plus small packed ones; all by ``step``."""
    rows = rows or ROWS
    rng = np.random.default_rng(step)
    return {
        "params": {
            "kernel": rng.standard_normal((rows, 256)).astype(np.float32),
            "bias": np.full((256,), step, np.float32),
        },
        "opt": {"mu": rng.standard_normal((rows, 256)).astype(np.float32)},
        "step": np.int64(step),
    }


def same(tree: Any, step: int) -> bool:
    """Whether every leaf of ``tree`` is, bit for bit, what the writer saved at ``step``."""
    import jax

    got, want = jax.tree.leaves(tree), jax.tree.leaves(state(step))
    return len(got) == len(want) and all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(got, want, strict=True)
    )


def writer(cfg: dict[str, Any]) -> None:
    import cocijax as cj

    base = Path(cfg["base"])
    with cj.CheckpointManager(
        base / "ckpt",
        roots=[base / "root0", base / "root1"],
        policy=cj.policies.fixed(1),
        max_to_keep=1,
        handler_options=HANDLER_OPTIONS,
    ) as mngr:
        mngr.save(1, state(1), loss=1.0, force=True)
        mngr.wait_until_finished()
        (base / "ready").write_text("1")
        step, end = 1, time.monotonic() + cfg["duration_s"]
        while time.monotonic() < end:
            step += 1
            mngr.save(step, state(step), loss=1.0, force=True)
        mngr.wait_until_finished()
    (base / "done").write_text(json.dumps({"steps": step}))


class _Retries(logging.Handler):
    """Counts the manager's log records of a newest-step restore retried."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying with the newest" in record.getMessage():
            self.count += 1


def reader(cfg: dict[str, Any]) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    import cocijax as cj
    from cocijax import cli

    base = Path(cfg["base"])
    while not (base / "ready").exists():
        time.sleep(0.01)
    retries = _Retries()
    logging.getLogger("cocijax").addHandler(retries)
    logging.getLogger("cocijax").setLevel(logging.INFO)
    counts = {"newest": 0, "listed": 0, "deleted": 0, "gone": 0, "verify": 0, "opened": 0}
    problems: list[str] = []
    read_only = ocp.CheckpointManagerOptions(read_only=True)
    mngr = cj.CheckpointManager(base / "ckpt", options=read_only)
    seen = set()
    i = 0
    while not (base / "done").exists():
        i += 1
        try:
            tree = mngr.restore()
            if not same(tree, mngr.restored_step):
                problems.append(f"restore() gave a tree that is not step {mngr.restored_step}")
            counts["newest"] += 1
            seen.add(mngr.restored_step)
        except Exception as e:
            problems.append(f"restore(): {type(e).__name__}: {e}"[:2000])
        listed = mngr.latest_step()
        if listed is not None:
            try:
                tree = mngr.restore(listed)
                if mngr.restored_step != listed or not same(tree, listed):
                    problems.append(f"restore({listed}) gave another tree")
                counts["listed"] += 1
            except FileNotFoundError as e:  # deleted before the call, or during it
                kind = "deleted" if isinstance(e, cj.manager.StepDeletedError) else "gone"
                counts[kind] += 1
                if f"step {listed} " not in str(e):
                    problems.append(f"{type(e).__name__} does not name step {listed}: {e}")
            except Exception as e:
                problems.append(
                    f"restore({listed}): {type(e).__name__}: {e} "
                    + "".join(traceback.format_exception(e))[-1500:]
                )
        if i % cfg.get("open_every", 3) == 1:
            # A new reader opening now: Orbax lists the steps, then reads their metrics, and
            # the writer may delete one in between.
            try:
                cj.CheckpointManager(base / "ckpt", options=read_only).close()
                counts["opened"] += 1
            except Exception as e:
                problems.append(
                    f"opening a reader: {type(e).__name__}: {e} "
                    + "".join(traceback.format_exception(e))[-2500:]
                )
        if i % cfg.get("verify_every", 3) == 0:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = cli.main(["verify", str(base / "ckpt")])
            counts["verify"] += 1
            if status != 0:
                problems.append(f"cocijax verify exited {status}: {out.getvalue()[-800:]}")
    mngr.close()
    counts["retried"] = retries.count
    counts["distinct_steps"] = len(seen)
    return {"counts": counts, "problems": problems[:20], "problem_count": len(problems)}


def once(cfg: dict[str, Any]) -> dict[str, Any]:
    """One read of step 1 (``restore()``, ``restore(1)`` or ``verify``), which the test stops
    (SIGSTOP) as soon as it reads the step's stripes, deletes under it, and lets go on."""
    import orbax.checkpoint as ocp

    import cocijax as cj
    from cocijax import cli

    directory = Path(cfg["base"]) / "ckpt"
    mngr = cj.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    out: dict[str, Any] = {"listed": mngr.all_steps()}
    print(json.dumps(out), flush=True)  # the test starts watching this process's files now
    try:
        if cfg["what"] == "verify":
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                out["status"] = cli.main(["verify", str(directory)])
            out["output"] = buffer.getvalue()
        else:
            tree = mngr.restore(None if cfg["what"] == "newest" else 1)
            out["restored_step"] = mngr.restored_step
            out["same"] = same(tree, mngr.restored_step)
    except Exception as e:
        out["error"] = {"type": type(e).__name__, "message": str(e)}
    mngr.close()
    return out


if __name__ == "__main__":
    mode, config = sys.argv[1], json.loads(sys.argv[2])
    ROWS = config.get("rows", ROWS)
    if mode == "writer":
        writer(config)
    else:
        print(json.dumps((reader if mode == "reader" else once)(config)), flush=True)
