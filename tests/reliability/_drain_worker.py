"""Child process of test_durable_crash.py: saves steps with a durable tier on S3 until killed.

Usage: python _drain_worker.py CONFIG_JSON, with ``directory``, ``roots``, ``durable``,
``options``, ``steps`` (saved in turn, each drained before the next but the last) and ``size``
(float32 elements of the state). After the last step is committed locally it prints
``committed N`` and waits for its drain, which the test cuts with SIGKILL.
"""

import json
import sys

import numpy as np


def state(step: int, size: int) -> dict:
    """The state saved at ``step``: the test rebuilds it to check a restore bit for bit."""
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((size // 1024, 1024), dtype=np.float32), "step": step}


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
    for step in cfg["steps"]:
        mngr.save(step, state(step, cfg["size"]), loss=1.0)
        mngr.wait_until_finished()
        if step != cfg["steps"][-1]:
            mngr.wait_until_finished(durable=True)
    print(f"committed {cfg['steps'][-1]}", flush=True)
    mngr.wait_until_finished(durable=True)
    print("drained", flush=True)
    mngr.close()


if __name__ == "__main__":
    main()
