"""Child process of test_durable_crash.py: saves steps with a durable tier on S3 until killed.

Usage: python _drain_worker.py CONFIG_JSON, with ``directory``, ``roots``, ``durable``,
``options``, ``steps`` (saved in turn, each drained before the next but the last) and ``size``
(float32 elements of the state). The drain of the last step stops once its first piece file is
uploaded (before its manifest, the commit): the worker prints ``uploaded a piece of N`` and waits
there for the test's SIGKILL.
"""

import json
import sys
import threading

import numpy as np


def state(step: int, size: int) -> dict:
    """The state saved at ``step``: the test rebuilds it to check a restore bit for bit."""
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((size // 1024, 1024), dtype=np.float32), "step": step}


def hold_after_first_piece(step: int) -> None:
    """Makes the next drain stop for good after its first piece file is written.

    The drain copies the state with ``cocijax.storage.copy_item``, whose ``progress`` callback
    runs after each piece file is written, on the copy's event loop: blocking it there stops the
    copy (so the manifest, written after the copy, never is) at a known point.
    """
    from cocijax import storage

    copy_item = storage.copy_item
    once = threading.Lock()

    def copy_then_hold(source, dest, *, progress=None, **kwargs):
        def written():
            if progress is not None:
                progress()
            if once.acquire(blocking=False):
                print(f"uploaded a piece of {step}", flush=True)
            threading.Event().wait()  # until SIGKILL

        return copy_item(source, dest, progress=written, **kwargs)

    storage.copy_item = copy_then_hold


def main() -> None:
    import cocijax as cj

    cfg = json.loads(sys.argv[1])
    mngr = cj.CheckpointManager(
        cfg["directory"],
        roots=cfg["roots"],
        policy=cj.policies.fixed(1),
        durable=cfg["durable"],
        durable_options=cfg["options"],
    )
    *drained, last = cfg["steps"]
    for step in drained:
        mngr.save(step, state(step, cfg["size"]), loss=1.0)
        mngr.wait_until_finished(durable=True)
    hold_after_first_piece(last)
    mngr.save(last, state(last, cfg["size"]), loss=1.0)
    mngr.wait_until_finished(durable=True)
    print("drained", flush=True)  # the hold did not happen: the test fails
    mngr.close()


if __name__ == "__main__":
    main()
