"""The durable commit of a host-local step: process 0 merges this run's parts only.

Two drains of each "process" run here in one Python process, each with a local step of its own
(a host-local copy holding one leaf), as two processes of a job drain their shards.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from cocijax import storage
from cocijax.manager._tier_drain import drain_step
from cocijax.manager._tier_options import DurableOptions
from cocijax.manager._tiers import DurableTier
from cocijax.storage._manifest_io import write_manifest

STEP = 12


def _local_step(local: Path, process: int, tree: dict[str, np.ndarray]) -> None:
    """A committed local step holding leaf ``"a"`` (process 0) or ``"c"`` (process 1) only, as a
    host-local copy of a job whose processes each hold one of them."""
    item = local / str(STEP) / "state"
    if item.parent.exists():  # saved again by a later run: a new copy
        shutil.rmtree(item.parent)
    with ocp.Checkpointer(storage.StripedCheckpointHandler()) as ckptr:
        ckptr.save(item, args=storage.StripedSave(tree))
    whole = storage.read_manifest(item)
    mine = [x.path for x in whole.leaves].index("['a']" if process == 0 else "['c']")
    pieces = tuple(dataclasses.replace(p, process=process) for p in whole.pieces if p.leaf == mine)
    write_manifest(item, dataclasses.replace(whole, holder=process, pieces=pieces))


def _tier(durable: Path, local: Path, process: int, run: str) -> DurableTier:
    options = DurableOptions(
        local=local, step_name=str, every=1, max_to_keep=None, writer=True,
        timeout_s=10.0, process=process, processes=2,
    )  # fmt: skip
    tier = DurableTier(durable, options)
    tier.share_run(run)
    return tier


def test_process_0_never_commits_a_step_with_an_earlier_run_s_part(tmp_path: Path) -> None:
    # Found by the dataloss review. Run 1: process 1 drained its part of step 12, and process
    # 0 was killed before the commit; run 2 could not remove that prefix at opening (the dead
    # process 0's lease had not expired on another host). Run 2 resumed from step 10 and saved
    # step 12 again, with other values: process 0's commit took the part of run 1 that it found
    # there, and the durable step 12 restored run 1's values for process 1's leaf, checksums
    # and all.
    durable, local0, local1 = tmp_path / "durable", tmp_path / "p0", tmp_path / "p1"
    old = {"a": np.zeros(4, np.float32), "c": np.full(4, 1.0, np.float32)}
    new = {"a": np.zeros(4, np.float32), "c": np.full(4, 2.0, np.float32)}
    _local_step(local1, 1, old)
    drain_step(_tier(durable, local1, 1, run="run1"), STEP)  # run 1: process 1's part only

    _local_step(local0, 0, new)
    _local_step(local1, 1, new)
    committer, late = _tier(durable, local0, 0, run="run2"), _tier(durable, local1, 1, run="run2")
    committer._lease.acquire(0)  # as its drain thread does before a drain
    drains = [threading.Thread(target=drain_step, args=(committer, STEP))]
    # Process 1 drains after process 0 started (the slower process, or the later offer).
    drains.append(threading.Thread(target=lambda: (time.sleep(1.0), drain_step(late, STEP))))
    for thread in drains:
        thread.start()
    for thread in drains:
        thread.join(timeout=60)
    committer._lease.release()

    with ocp.Checkpointer(storage.StripedCheckpointHandler()) as ckptr:
        restored = ckptr.restore(durable / str(STEP) / "state", args=storage.StripedRestore())
    np.testing.assert_array_equal(restored["c"], new["c"])  # run 2's, not run 1's
    np.testing.assert_array_equal(restored["a"], new["a"])
