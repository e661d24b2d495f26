"""One JAX process of the memory-tier tests with several processes; run as
``python _mpmemory_worker.py CONFIG_JSON``.

Every process has a local directory (``cfg["dirs"][process]``) and a memory folder
(``cfg["memory"][process]``, standing for its host's tmpfs) of its own, and shares the durable
tier ``cfg["durable"]`` (``CheckpointManager(host_local=True, memory=...)``). The policy is a
two-level one: level 1 (memory only) at odd steps, level 2 (memory, then the disk and the
durable tier) at even ones.

``cfg["mode"]``:

* ``"save"``: saves steps 1 to ``cfg["steps"]`` of a sharded weight, a replicated bias and
  their Adam state, waits for the durable tier, writes ``<out>/save_<i>.json`` (its memory,
  local and durable steps) and process 0 the gathered state of each step to
  ``<out>/reference_<step>.npz``; then ends without closing the manager (``os._exit``: the
  run marker stays, a failure of the job).
* ``"restore"``: opens the manager again (the test may have emptied a process's memory folder:
  a rebooted host), restores the newest step and compares every addressable shard with the
  reference; saves the next two steps; writes ``<out>/restore_<i>.json`` (the step, its tier,
  the steps listed, the failures the history counts, the mismatches, the steps listed after
  the two saves).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _hosts_worker import _flat
from _mp_worker import _init_distributed, _mesh, _state


def _two_level():
    import jax
    import jax.numpy as jnp

    import cocijax as cj

    def update(state, *, step, **_):
        return jnp.where(step % 2 == 0, 2, 1), {"n": state["n"] + 1}

    return cj.policies.Policy(lambda: {"n": jnp.zeros((), jnp.int32)}, jax.jit(update), levels=2)


def _manager(cfg: dict[str, Any]):
    import cocijax as cj

    me = cfg["process_id"]
    return cj.CheckpointManager(
        cfg["dirs"][me],
        memory=cfg["memory"][me],
        durable=cfg["durable"],
        host_local=True,
        policy=_two_level(),
        store_timeout_s=30.0,
        exit_on_preemption=False,
    )


def save(cfg: dict[str, Any]) -> None:
    import numpy as np
    from jax.experimental import multihost_utils

    me, out = cfg["process_id"], Path(cfg["out"])
    state, step_fn = _state(_mesh())
    params, opt_state = state["params"], state["opt_state"]
    mngr = _manager(cfg)
    saved = []
    for step in range(1, cfg["steps"] + 1):
        params, opt_state = step_fn(params, opt_state)
        current = {"params": params, "opt_state": opt_state}
        if mngr.save(step, current, loss=1.0 / step):
            saved.append(step)
            gathered = multihost_utils.process_allgather(current, tiled=True)
            if me == 0:
                flat = {k: np.asarray(v) for k, v in _flat(gathered).items()}
                np.savez(out / f"reference_{step}.npz", **flat)
    mngr.wait_until_finished(durable=True)  # collective
    record = {
        "saved": saved,
        "memory": mngr.memory_steps(),
        "local": mngr._local_steps(),
        "durable": mngr._durable.refresh(),
    }
    (out / f"save_{me}.json").write_text(json.dumps(record))
    # Process 0 serves JAX's key-value store: it ends last. No close: the run marker stays.
    while me == 0 and not all((out / f"save_{i}.json").exists() for i in range(len(cfg["dirs"]))):
        time.sleep(0.05)
    os._exit(0)


def restore(cfg: dict[str, Any]) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    me, out = cfg["process_id"], Path(cfg["out"])
    mesh = _mesh()
    like, _ = _state(mesh)

    def abstract(leaf):
        spec = P("x", None) if leaf.ndim == 2 else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    with _manager(cfg) as mngr:
        record = {"steps": mngr.all_steps(), "memory": mngr.memory_steps()}
        restored = mngr.restore(target=jax.tree.map(abstract, like))
        measured = mngr.measurements
        record.update(
            step=mngr.restored_step,
            tier=mngr.restored_tier,
            failures=measured.failures,
            machine_failures=measured.machine_failures,
        )
        # The job goes on from the step restored: the next two saves land on every tier.
        _, step_fn = _state(mesh)
        params, opt_state = restored["params"], restored["opt_state"]
        for step in range(record["step"] + 1, record["step"] + 3):
            params, opt_state = step_fn(params, opt_state)
            mngr.save(step, {"params": params, "opt_state": opt_state}, loss=1.0 / step)
        mngr.wait_until_finished()
        record["after"] = {"memory": mngr.memory_steps(), "local": mngr._local_steps()}
    ref = dict(np.load(out / f"reference_{record['step']}.npz"))
    mismatches, shards = [], 0
    for key, leaf in _flat(restored).items():
        for shard in leaf.addressable_shards:
            shards += 1
            if not np.array_equal(np.asarray(shard.data), ref[key][shard.index]):
                mismatches.append(f"{key} shard {shard.index} differs")
    record.update(mismatches=mismatches, shards=shards)
    (out / f"restore_{me}.json").write_text(json.dumps(record))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _init_distributed(cfg)
    {"save": save, "restore": restore}[cfg["mode"]](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
