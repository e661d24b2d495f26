"""One JAX process of the multi-process fault tests; run as ``python _mp_faults.py CONFIG_JSON``.

Two processes join on 127.0.0.1 (``_mp_worker._init_distributed``) and save a small state with
``fixed(4)`` (a save every 4 steps). ``cfg["mode"]``:

* ``"wrong_step"``: process 1 skips step 4, a save step (a user's bug: its own step counter).
  Each process records the error its ``save`` raised and the steps committed, in
  ``<out>/wrong_step_<i>.json``.
* ``"peer_dies"``: both commit step 4, start saving step 8, and process 1 dies at once
  (``os._exit``). Process 0 saves on (the error its next check raises is recorded), then
  closes with ``timeout_s=cfg["close_timeout_s"]``; it records the close's error and how long
  close took in ``<out>/peer_dies_0.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _mp_worker import _init_distributed


def _error(e: BaseException) -> dict[str, str]:
    return {"type": type(e).__name__, "message": str(e)}


def wrong_step(cfg: dict[str, Any]) -> None:
    import numpy as np

    import cocijax as cj

    me = cfg["process_id"]
    state = {"w": np.arange(8.0)}
    record: dict[str, Any] = {"error": None}
    with cj.CheckpointManager(cfg["directory"], policy=cj.policies.fixed(4)) as mngr:
        for step in range(1, 13):
            if me == 1 and step == 4:
                continue
            try:
                mngr.save(step, state, loss=1.0)
            except Exception as e:
                record.update(error=_error(e), step=step)
                break
        mngr.wait_until_finished()
        record["committed"] = mngr.all_steps()
    (Path(cfg["out"]) / f"wrong_step_{me}.json").write_text(json.dumps(record))


def peer_dies(cfg: dict[str, Any]) -> None:
    import numpy as np

    import cocijax as cj

    me = cfg["process_id"]
    state = {"w": np.arange(8.0)}
    record: dict[str, Any] = {"save_error": None, "close_error": None}
    mngr = cj.CheckpointManager(cfg["directory"], policy=cj.policies.fixed(4))
    for step in range(1, 9):
        mngr.save(step, state, loss=1.0)
        if step == 4:
            mngr.wait_until_finished()
            record["committed"] = mngr.all_steps()
    if me == 1:
        os._exit(3)  # dies with the save of step 8 running
    time.sleep(1.0)  # the peer is gone by now
    for step in range(9, 13):
        try:
            mngr.save(step, state, loss=1.0)
        except Exception as e:
            record["save_error"] = _error(e)
            break
    start = time.monotonic()
    try:
        mngr.close(timeout_s=cfg["close_timeout_s"])
    except Exception as e:
        record["close_error"] = _error(e)
    record["close_s"] = time.monotonic() - start
    (Path(cfg["out"]) / f"peer_dies_{me}.json").write_text(json.dumps(record))
    # JAX's own exit (jax.distributed.shutdown, at interpreter exit) waits for the dead process
    # in its shutdown barrier until the heartbeat timeout: not what this test is about.
    os._exit(0)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _init_distributed(cfg)
    {"wrong_step": wrong_step, "peer_dies": peer_dies}[cfg["mode"]](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
