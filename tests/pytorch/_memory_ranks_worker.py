"""One rank of the jobs of ``test_memory_ranks.py``, launched by ``torchrun``; argument: JSON.

The job trains a ``fully_shard`` model (each rank holds half of its rows) with a two-level
policy of its own (level 2 at every 4th step, level 1 at the others) and a memory tier. Each
step adds 1 to every parameter, so step ``s``'s parameters are the initial ones plus ``s`` ones;
each rank also saves an ``extra`` counter of its own (``1000 * rank + step``). A run restores
the latest step if there is one, records what came back in ``out/<run>-rank<r>.json``, saves
``cfg["steps"]`` more steps, then ends by its ``end``: ``"kill"`` (rank 1 SIGKILLs itself once
the saves have committed; ``torchrun`` then stops rank 0) or ``"close"`` (a clean exit).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import cocijax as cj
import cocijax.torch as cjt


class Counter:
    def __init__(self, value: int = -1):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = int(state["value"])


def two_level() -> cj.policies.Policy:
    def update(state, *, step, **_):
        return jnp.where(step % 4 == 0, 2, 1), state

    return cj.policies.Policy(lambda: {"n": jnp.zeros((), jnp.int32)}, jax.jit(update), levels=2)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)  # the same initial values on every rank
    initial = model.weight.detach().clone()
    fully_shard(model)  # each rank keeps 2 of the 4 rows
    state, counter = {"model": model}, Counter()
    record: dict = {}
    with cjt.CheckpointManager(cfg["directory"], policy=two_level(), memory=cfg["memory"]) as mngr:
        start = mngr.latest_step() or 0
        record["listed"] = [mngr.memory_steps(), mngr.all_steps()]
        if start:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mngr.restore(target=state, extra={"counter": counter})
            record["warnings"] = [str(w.message) for w in caught if "restore" in str(w.message)]
            step = mngr.restored_step
            record["restored"] = [step, mngr.restored_tier]
            full = model.weight.full_tensor()  # collective: every rank's rows
            expected = initial.clone()
            for _ in range(step):  # as the steps added, rounding included
                expected += 1.0
            record["exact"] = bool(torch.equal(full, expected))
            record["counter"] = counter.value
            measured = mngr.measurements  # rank 0's history is the job's
            record["failures"] = [measured.failures, measured.machine_failures]
            start = step
        for step in range(start + 1, start + 1 + cfg["steps"]):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            counter.value = 1000 * rank + step
            mngr.save(step, state, loss=1.0, extra={"counter": counter})
        mngr.wait_until_finished()
        record["after"] = [mngr.memory_steps(), mngr.all_steps()]
        record["memory_folder"] = str(mngr._memory.path)
        out = Path(cfg["out"]) / f"{cfg['run']}-rank{rank}.json"
        out.write_text(json.dumps(record))
        dist.barrier()  # both records written
        if cfg["end"] == "kill" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg["end"] == "kill":
            dist.barrier()  # rank 0 waits here until torchrun stops it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
