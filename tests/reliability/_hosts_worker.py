"""One JAX process of the host-local tests; run as ``python _hosts_worker.py CONFIG_JSON``.

Every process has a local directory of its own (``cfg["dirs"][process]``) and shares the
durable tier ``cfg["durable"]`` (``CheckpointManager(host_local=True)``); devices are simulated
(``child_env``), one mesh axis over every device of every process.

``cfg["mode"]``:

* ``"save"``: trains ``cfg["steps"]`` steps of a sharded weight, a replicated bias and their
  Adam state, saving every second step (the last one forced), then waits for the durable tier.
  Writes ``<out>/save_<i>.json`` (the steps it lists, its local steps, the durable ones, the
  regions its devices hold) and process 0 the gathered final state of every saved step to
  ``<out>/reference_<step>.npz``.
* ``"restore"``: opens the manager again (the test may have emptied a process's folder: a
  replaced host), restores the newest step or ``cfg["step"]`` (sharded over this run's devices,
  in reverse order with ``cfg["reverse"]``; with ``cfg["fallback"]`` an older step if need be;
  with ``cfg["may_fail"]`` its error is recorded instead) and compares every
  addressable shard with the reference; writes ``<out>/restore_<i>.json`` (the step, the tier it
  came from, the mismatches).
* ``"fault"``: one process's local commit of a step fails (see :func:`fault`).
* ``"kill"``, ``"resume"``: a process killed mid-save, then the job again (see :func:`kill`).
* ``"skew"``: clocks of different offsets and rates (see :func:`skew`).
* ``"absent"``: only process 0 opens a manager (see :func:`absent`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from _mp_worker import _init_distributed, _mesh, _state


def _manager(cfg: dict[str, Any], **kwargs: Any):
    import cocijax as cj

    me = cfg["process_id"]
    return cj.CheckpointManager(
        cfg["dirs"][me],
        roots=[root[me] for root in cfg.get("roots", [])] or None,
        durable=cfg["durable"],
        durable_options=cfg.get("durable_options"),
        durable_every=cfg.get("durable_every", 1),
        host_local=True,
        policy=kwargs.pop("policy", None) or cj.policies.fixed(2),
        max_to_keep=2,
        store_timeout_s=cfg.get("timeout_s", 30.0),
        **kwargs,
    )


def _flat(tree: Any) -> dict[str, Any]:
    import jax

    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save(cfg: dict[str, Any]) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    me = cfg["process_id"]
    state, step_fn = _state(_mesh())
    params, opt_state = state["params"], state["opt_state"]
    saved = []
    with _manager(cfg) as mngr:
        for step in range(1, cfg["steps"] + 1):
            params, opt_state = step_fn(params, opt_state)
            current = {"params": params, "opt_state": opt_state}
            if mngr.save(step, current, loss=1.0 / step, force=step == cfg["steps"]):
                saved.append(step)
                # Every process takes part in the gather; process 0 keeps the reference.
                gathered = multihost_utils.process_allgather(current, tiled=True)
                if me == 0:
                    flat = {k: np.asarray(v) for k, v in _flat(gathered).items()}
                    np.savez(Path(cfg["out"]) / f"reference_{step}.npz", **flat)
        mngr.wait_until_finished(durable=True)
        record = {
            "saved": saved,
            "steps": mngr.all_steps(),
            "local": mngr._local_steps(),
            "durable": mngr._durable.refresh(),
        }
    owned = {}
    for key, leaf in _flat(current).items():
        owned[key] = sorted(
            {
                tuple((s.start or 0, s.stop if s.stop is not None else dim))
                for s, dim in zip(shard.index, leaf.shape, strict=True)
            }
            for shard in leaf.addressable_shards
        )
    record["owned"] = {k: [list(map(list, box)) for box in v] for k, v in owned.items()}
    record["process_count"] = jax.process_count()
    (Path(cfg["out"]) / f"save_{me}.json").write_text(json.dumps(record))


def restore(cfg: dict[str, Any]) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    me = cfg["process_id"]
    mesh = _mesh()
    if cfg.get("reverse"):  # another topology: each process's devices hold others' rows
        mesh = Mesh(np.array(jax.devices()[::-1]), ("x",))
    like, _ = _state(mesh)

    def abstract(leaf):
        spec = P("x", None) if leaf.ndim == 2 else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    target = jax.tree.map(abstract, like)
    with _manager(cfg) as mngr:
        steps = mngr.all_steps()
        try:
            restored = mngr.restore(
                cfg.get("step"), target=target, fallback=cfg.get("fallback", False)
            )
        except Exception as e:
            if not cfg.get("may_fail"):
                raise
            error = {"error": f"{type(e).__name__}: {e}", "notes": getattr(e, "__notes__", [])}
            (Path(cfg["out"]) / f"restore_{me}.json").write_text(json.dumps(error))
            return
        step, tier = mngr.restored_step, mngr.restored_tier
    ref = dict(np.load(Path(cfg["out"]) / f"reference_{step}.npz"))
    mismatches = []
    shards = 0
    for key, leaf in _flat(restored).items():
        for shard in leaf.addressable_shards:
            shards += 1
            if not np.array_equal(np.asarray(shard.data), ref[key][shard.index]):
                mismatches.append(f"{key} shard {shard.index} differs")
    record = {"step": step, "tier": tier, "steps": steps, "mismatches": mismatches}
    record["shards"] = shards
    (Path(cfg["out"]) / f"restore_{me}.json").write_text(json.dumps(record))


def _fail_next_commit() -> dict[str, bool]:
    """Makes this process's next local commit fail (as a full disk would); returns the switch."""
    from cocijax.storage import _commit

    armed = {"on": False}
    commit = _commit.Writer.commit

    async def failing(self, directory, snapshot):
        if armed["on"]:
            armed["on"] = False
            raise OSError(28, "No space left on device (injected)", str(directory))
        return await commit(self, directory, snapshot)

    _commit.Writer.commit = failing
    return armed


def fault(cfg: dict[str, Any]) -> None:
    """Steps 2 and 4 are saved everywhere; process ``cfg["failing"]``'s local commit of step 6
    fails; then step 8 is saved everywhere. Writes ``<out>/fault_<i>.json``."""
    me = cfg["process_id"]
    armed = _fail_next_commit() if me == cfg["failing"] else {"on": False}
    state, step_fn = _state(_mesh())
    params, opt_state = state["params"], state["opt_state"]
    record: dict[str, Any] = {}
    with _manager(cfg) as mngr:
        for step in range(1, 9):
            params, opt_state = step_fn(params, opt_state)
            armed["on"] = armed["on"] or (step == 6 and me == cfg["failing"])
            try:
                mngr.save(step, {"params": params, "opt_state": opt_state}, loss=1.0)
                if step in (4, 6, 8):
                    mngr.wait_until_finished(durable=True)
            except Exception as e:
                record[f"error_{step}"] = f"{type(e).__name__}: {e}"
            if step in (4, 6, 8):
                record[f"steps_{step}"] = mngr.all_steps()
        record["durable"] = mngr._durable.refresh()
    (Path(cfg["out"]) / f"fault_{me}.json").write_text(json.dumps(record))


def kill(cfg: dict[str, Any]) -> None:
    """Steps 2 and 4 are saved and drained everywhere; process ``cfg["killed"]`` is killed
    (SIGKILL) in its local commit of step 6, its shards written, its manifest not; the others
    commit step 6 locally and drain their shards of it, wait for the durable tier (which
    fails: the killed process never arrives), then exit without JAX's shutdown barrier."""
    import signal

    from cocijax.storage import _commit

    me = cfg["process_id"]
    if me == cfg["killed"]:
        commit = _commit.Writer.commit

        async def killed(self, directory, snapshot):
            if "/6." in str(directory) or str(directory).endswith("/6"):
                os.kill(os.getpid(), signal.SIGKILL)
            return await commit(self, directory, snapshot)

        _commit.Writer.commit = killed
    state, step_fn = _state(_mesh())
    params, opt_state = state["params"], state["opt_state"]
    mngr = _manager(cfg)
    for step in range(1, 7):
        params, opt_state = step_fn(params, opt_state)
        try:
            mngr.save(step, {"params": params, "opt_state": opt_state}, loss=1.0)
            if step in (4, 6):
                mngr.wait_until_finished(durable=True)
        except Exception as e:
            if step != 6:
                raise
            log = Path(cfg["out"]) / f"kill_{me}.json"
            log.write_text(json.dumps({"error_6": f"{type(e).__name__}: {e}"}))
    try:
        mngr.close(timeout_s=5.0)
    finally:
        os._exit(0)  # JAX's shutdown barrier would wait for the dead process


def resume(cfg: dict[str, Any]) -> None:
    """The job after a kill (see :func:`kill`): restores the newest step, moves its weight
    (so that the steps saved again differ from the killed run's), saves steps 6 and 8 and
    drains them, then reads step 6 back from this process's folder and from the durable tier.
    Writes ``<out>/resume_<i>.json`` and process 0 ``<out>/resumed_<step>.npz``."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    me = cfg["process_id"]
    like, step_fn = _state(_mesh())
    record: dict[str, Any] = {}
    with _manager(cfg) as mngr:
        record["steps_opened"] = mngr.all_steps()
        state = mngr.restore(target=like)
        record["restored"] = mngr.restored_step
        params = dict(state["params"], w=state["params"]["w"] + 1.0)
        opt_state = state["opt_state"]
        for step in range(mngr.restored_step + 1, 9):
            params, opt_state = step_fn(params, opt_state)
            current = {"params": params, "opt_state": opt_state}
            if mngr.save(step, current, loss=1.0, force=step == 8):
                gathered = multihost_utils.process_allgather(current, tiled=True)
                if me == 0:
                    flat = {k: np.asarray(v) for k, v in _flat(gathered).items()}
                    np.savez(Path(cfg["out"]) / f"resumed_{step}.npz", **flat)
        mngr.wait_until_finished(durable=True)
        record["steps"] = mngr.all_steps()
        record["local"] = mngr._local_steps()
        record["durable"] = mngr._durable.refresh()
        jax.effects_barrier()
        multihost_utils.sync_global_devices("resumed references written")
        ref = dict(np.load(Path(cfg["out"]) / "resumed_6.npz"))
        for tier in ("local", "durable"):
            restored = mngr.restore(6, target=like, tier=tier)
            record[f"mismatches_{tier}"] = [
                f"{key} shard {shard.index}"
                for key, leaf in _flat(restored).items()
                for shard in leaf.addressable_shards
                if not np.array_equal(np.asarray(shard.data), ref[key][shard.index])
            ]
    (Path(cfg["out"]) / f"resume_{me}.json").write_text(json.dumps(record))


def skew(cfg: dict[str, Any]) -> None:
    """Trains 24 steps under Young's rule (its interval in steps depends on the step time and
    the save cost this process measures) with a clock of this process's own offset and rate
    (``cfg["skew"][process]``; each reading a quarter of a unit later than the one before, so
    that runs repeat). Writes ``<out>/skew_<i>.json``: the steps saved and kept."""
    import cocijax as cj

    me = cfg["process_id"]
    offset, rate = cfg["skew"][me]
    readings = iter(range(1, 1 << 30))

    def clock() -> float:
        return offset + rate * 0.25 * next(readings)

    state, step_fn = _state(_mesh())
    params, opt_state = state["params"], state["opt_state"]
    saved = []
    policy = cj.policies.young(mtbf_s=cfg["mtbf_s"], cost_prior_s=0.5)
    with _manager(cfg, policy=policy, clock=clock) as mngr:
        for step in range(1, 25):
            params, opt_state = step_fn(params, opt_state)
            if mngr.save(step, {"params": params, "opt_state": opt_state}, loss=1.0 / step):
                saved.append(step)
        mngr.wait_until_finished(durable=True)
        record = {"saved": saved, "steps": mngr.all_steps(), "local": mngr._local_steps()}
        record["durable"] = mngr._durable.refresh()
    (Path(cfg["out"]) / f"skew_{me}.json").write_text(json.dumps(record))


def absent(cfg: dict[str, Any]) -> None:
    """Process 0 opens a manager; the others never do (a user's bug, or a hung process): its
    opening must fail within ``cfg["timeout_s"]``. Writes ``<out>/absent_0.json``."""
    import time

    import jax

    jax.devices()  # every process joins JAX's backend (its start-up waits for all)
    out = Path(cfg["out"]) / "absent_0.json"
    if cfg["process_id"] != 0:
        while not out.exists():  # stays up (the job's other process) until process 0 is done
            time.sleep(0.05)
        return
    start = time.monotonic()
    try:
        _manager(cfg).close()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps({"error": error, "elapsed_s": time.monotonic() - start}))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _init_distributed(cfg)
    modes = {"save": save, "restore": restore, "fault": fault, "absent": absent}
    modes.update(kill=kill, resume=resume, skew=skew)
    modes[cfg["mode"]](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
