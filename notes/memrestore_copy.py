"""Time until a persisted save with ``memory=`` is on the disk, 256 MiB (one leaf), one process.

``python notes/memrestore_copy.py N``: N saves (the first dropped) of a 256 MiB float32 state
with ``memory=`` (a tmpfs folder) and a one-level policy (every save persisted); per save, the
seconds from the call to ``save`` until ``wait_until_finished`` returns (the disk copy
committed), and the blocking part alone; prints one JSON line. Run it under the trees compared
(``PYTHONPATH=<tree>``), alternating, and take medians.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp

import cocijax as cj


def main() -> None:
    n = int(sys.argv[1])
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="memrestore-copy-"))
    mem = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="memrestore-copy-"))
    state = {"w": jnp.ones((64 << 20,), jnp.float32)}  # 256 MiB
    out: dict[str, list[float]] = {"on_disk_s": [], "blocking_s": []}
    try:
        with cj.CheckpointManager(tmp, policy=cj.policies.fixed(1), memory=mem) as mngr:
            for step in range(1, n + 1):
                t0 = time.perf_counter()
                mngr.save(step, state, loss=1.0)
                t1 = time.perf_counter()
                mngr.wait_until_finished()
                t2 = time.perf_counter()
                if step > 1:
                    out["blocking_s"].append(t1 - t0)
                    out["on_disk_s"].append(t2 - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
