"""One JAX process of the multi-process tests; run as ``python _mp_worker.py CONFIG_JSON``.

``cfg["mode"]``:

* ``"save"``: joins ``cfg["num_processes"]`` processes on 127.0.0.1, builds a globally sharded
  array and an optax Adam state over one mesh of every device, then runs a training loop that
  calls ``CheckpointManager.save`` on every step. Each process feeds the manager a *different*
  loss and sleeps a different time per step, so the manager has to agree on its decisions across
  processes. Writes ``<out>/process_<i>.json``: its save decisions, the piece paths it wrote
  while saving, and the index of every shard it owns (replica 0). Process 0 also writes the whole
  state gathered from every process to ``<out>/reference.npz``.
* ``"restore"``: restores the newest step with a target sharded over this run's devices (one
  process or several) and compares every addressable shard with ``reference.npz``; writes
  ``<out>/restore_<n>_<i>.json``.
* ``"preempt"``: trains with a policy that never saves, with JAX's preemption service on or off
  (``cfg["service"]``), touches ``<out>/ready_<i>`` once it is under way, and stops when the
  manager has taken its preemption save (the test sends SIGTERM to one process); writes
  ``<out>/preempt_<i>.json`` with that step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _init_distributed(cfg: dict[str, Any]) -> None:
    import jax

    if cfg["num_processes"] > 1:
        # CPU collectives: without gloo, cross-process computations fail on the CPU backend.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption service (on by default) is set up by initialize().
        jax.config.update("jax_enable_preemption_service", cfg.get("service", True))
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{cfg['port']}",
            num_processes=cfg["num_processes"],
            process_id=cfg["process_id"],
            initialization_timeout=60,
        )


def _mesh() -> Any:
    """One mesh axis over every device of every process (automatic sharding propagation)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()), ("x",))


def _state(mesh: Any):
    """A sharded weight, a replicated bias and their Adam state after two optimizer steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    # 16 rows: divisible by the 1, 2 and 4 devices of every save and restore configuration.
    w_host = np.arange(16 * 6, dtype=np.float32).reshape(16, 6) / 7.0
    b_host = np.linspace(-1.0, 1.0, 6, dtype=np.float32)
    w_sh = NamedSharding(mesh, P("x", None))
    rep = NamedSharding(mesh, P())
    params = {
        "w": jax.make_array_from_callback(w_host.shape, w_sh, lambda i: w_host[i]),
        "b": jax.make_array_from_callback(b_host.shape, rep, lambda i: b_host[i]),
    }
    tx = optax.adam(0.1)
    opt_state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"]) * p["b"]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(2):
        params, opt_state = step(params, opt_state)
    return {"params": params, "opt_state": opt_state}, step


def _log_piece_writes(log: list[str]) -> None:
    """Records the kvstore path of every ``tensorstore.open`` this process makes, and the piece
    directory of every file it writes directly (uncompressed pieces open no store)."""
    import tensorstore as ts

    from cocijax.storage import _direct

    write_file = _direct.write_file

    def logging_write(path: Any, *args: Any, **kwargs: Any):
        log.append(str(path.parent))
        return write_file(path, *args, **kwargs)

    _direct.write_file = logging_write

    original = ts.open

    def logging_open(spec: Any = None, *args: Any, **kwargs: Any):
        try:
            as_json = ts.Spec(spec).to_json() if not isinstance(spec, dict) else spec
            kv = as_json.get("kvstore", {})
            path = kv.get("path", "") if isinstance(kv, dict) else str(kv)
            log.append(path)
        except Exception as e:  # never let logging change what the handler does
            log.append(f"<unparsed spec: {e}>")
        return original(spec, *args, **kwargs)

    ts.open = logging_open


def save(cfg: dict[str, Any]) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import cocijax as cj

    me = cfg["process_id"]
    mesh = _mesh()
    state, step_fn = _state(mesh)
    opened: list[str] = []
    _log_piece_writes(opened)
    decisions: list[bool] = []
    policy = getattr(cj.policies, cfg["policy"])(**cfg["policy_kwargs"])
    with cj.CheckpointManager(
        cfg["directory"], roots=cfg["roots"], policy=policy, max_to_keep=cfg["steps"] + 1
    ) as mngr:
        params, opt_state = state["params"], state["opt_state"]
        for step in range(1, cfg["steps"] + 1):
            params, opt_state = step_fn(params, opt_state)
            # Different losses and step times per process: only a shared decision keeps the
            # processes in lock-step (a lone save would hang its peers in the commit barrier).
            time.sleep(0.01 * (1 + me))
            loss = float(10.0 / step + me * 0.37)
            # The last step is forced so that the newest checkpoint is the final state, which
            # process 0 gathers as the reference below.
            last = step == cfg["steps"]
            saved = mngr.save(
                step, {"params": params, "opt_state": opt_state}, loss=loss, force=last
            )
            decisions.append(bool(saved))
        mngr.wait_until_finished()
        final = {"params": params, "opt_state": opt_state}
        latest = mngr.latest_step()
    owned = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(final)[0]:
        owned[jax.tree_util.keystr(path)] = [
            [
                [s.start or 0, s.stop if s.stop is not None else dim]
                for s, dim in zip(shard.index, leaf.shape, strict=True)
            ]
            for shard in leaf.addressable_shards
            if shard.replica_id == 0
        ]
    gathered = multihost_utils.process_allgather(final, tiled=True)
    if me == 0:
        flat = {
            jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(gathered)[0]
        }
        np.savez(Path(cfg["out"]) / "reference.npz", **flat)
    record = {"decisions": decisions, "opened": opened, "owned": owned, "latest": latest}
    (Path(cfg["out"]) / f"process_{me}.json").write_text(json.dumps(record))
    multihost_utils.sync_global_devices("reference written")


def restore(cfg: dict[str, Any]) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import cocijax as cj

    me = cfg["process_id"]
    mesh = _mesh()
    # The abstract target: same tree, this run's devices; the first axis of 2-D leaves sharded.
    ref = dict(np.load(Path(cfg["out"]) / "reference.npz"))
    like, _ = _state(mesh)

    def abstract(leaf):
        spec = P("x", None) if leaf.ndim == 2 else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    target = jax.tree.map(abstract, like)
    policy = getattr(cj.policies, cfg["policy"])(**cfg["policy_kwargs"])
    with cj.CheckpointManager(cfg["directory"], roots=cfg["roots"], policy=policy) as mngr:
        restored = mngr.restore(cfg["step"], target=target)
    mismatches = []
    shards = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        key = jax.tree_util.keystr(path)
        want = ref[key]
        if leaf.shape != want.shape or leaf.dtype != want.dtype:
            mismatches.append(f"{key}: {leaf.shape}/{leaf.dtype} vs {want.shape}/{want.dtype}")
            continue
        for shard in leaf.addressable_shards:
            shards += 1
            if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                mismatches.append(f"{key} shard {shard.index} differs")
    record = {
        "mismatches": mismatches,
        "shards": shards,
        "devices": jax.device_count(),
        "leaves": len(ref),
    }
    out = Path(cfg["out"]) / f"restore_{cfg['num_processes']}_{me}.json"
    out.write_text(json.dumps(record))


def preempt(cfg: dict[str, Any]) -> None:
    import numpy as np

    import cocijax as cj

    me = cfg["process_id"]
    state = {"w": np.arange(8.0)}
    record: dict[str, Any] = {"preempted_at": None}
    # The test checks that both processes agree on the step and records it: it keeps control.
    policy = cj.policies.fixed(10**9)
    with cj.CheckpointManager(cfg["directory"], policy=policy, exit_on_preemption=False) as mngr:
        for step in range(1, cfg["steps"] + 1):
            time.sleep(0.002 * (1 + me))  # different step times: the processes drift apart
            state = {"w": state["w"] + 1.0}
            saved = mngr.save(step, state, loss=1.0)
            if step == 20:
                (Path(cfg["out"]) / f"ready_{me}").touch()
            if mngr.reached_preemption:
                record = {"preempted_at": step, "saved": saved}
                break
        record["steps"] = mngr.all_steps()
    (Path(cfg["out"]) / f"preempt_{me}.json").write_text(json.dumps(record))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _init_distributed(cfg)
    {"save": save, "restore": restore, "preempt": preempt}[cfg["mode"]](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
