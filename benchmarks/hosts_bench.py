"""Two JAX processes, local folders per process and a shared persistent folder, per method.

The scenario of issue 31: two processes on 127.0.0.1 (``jax.distributed``, gloo, two simulated
CPU devices each), one 2 x 2 mesh whose first axis is the replica axis (each process holds one
whole replica, sharded over its two devices: what Orbax's emergency manager expects). Each
process has a local folder of its own; one folder, the persistent one, is shared. Per method:

* ``orbax-emergency``: ``orbax.checkpoint.experimental.emergency.checkpoint_manager
  .CheckpointManager`` (local saves every step, persistent every second step);
* ``orbax-standard``: Orbax's ``CheckpointManager`` (``StandardSave``, async) on the shared
  folder;
* ``cocijax``: ``cj.CheckpointManager`` on the shared folder;
* ``cocijax-local``: ``cj.CheckpointManager(local, durable=shared, host_local=True)``: each
  process commits its shards in its own folder and drains them to the shared folder, where the
  step is committed once every process's shards are there.

Phase one saves ``--steps`` steps (forced) in both processes and times, per save, the blocking
call (``blocking_s``: the median) and, for each step that goes to the persistent folder, the
time from the save call until it is committed there (``to_persistent_s``: the median; the script
waits for it before the next save). Phase two restarts both processes with process 1's local
folder emptied, as on a new machine, and times the restore of the newest step
(``restore_replaced_s``, the slower process's) and compares every addressable shard with what
was saved (``bit_exact``). A method that fails records its error (the last lines of its
output) instead.

Run: ``python benchmarks/hosts_bench.py [--quick] [--json PATH]``. Prints a table; one JSON row
per method with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROCESSES = 2
DEVICES = 2  # per process
TIMEOUT_S = 600.0


# -- in a worker process --------------------------------------------------------------------


def _init(cfg: dict[str, Any]) -> Any:
    """Joins the job; returns the 2 x 2 mesh (axis ``replica``: one row per process)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{cfg['port']}",
        num_processes=PROCESSES,
        process_id=cfg["process_id"],
        initialization_timeout=120,
    )
    rows = [[d for d in jax.devices() if d.process_index == p] for p in range(PROCESSES)]
    return Mesh(np.array(rows), ("replica", "data"))


def _state(mesh: Any, mib: int, step: int) -> dict[str, Any]:
    """Two float32 leaves of ``mib`` MiB in all, replicated over ``replica``, sharded over
    ``data``; their values depend on ``step``."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = mib * 2**20 // 4 // 2 // 256
    sharding = NamedSharding(mesh, P(None, "data"))
    out = {}
    for i, name in enumerate(("a", "b")):
        host = (np.arange(rows * 256, dtype=np.float32).reshape(rows, 256) + step + i) / 3.0
        out[name] = jax.make_array_from_callback(host.shape, sharding, lambda x, h=host: h[x])
    return out


def _abstract(state: dict[str, Any]) -> dict[str, Any]:
    import jax

    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )


class _Emergency:
    """Orbax's emergency manager: local folders, the shared folder every second step."""

    def __init__(self, cfg: dict[str, Any], mesh: Any, abstract: Any):
        from orbax.checkpoint._src.multihost import multihost
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as em

        # What Orbax's own emergency benchmark does first (its save fails without the second:
        # "Please call initialize_distributed_to_device_ids()").
        if not multihost.is_runtime_to_distributed_ids_initialized():
            multihost.initialize_runtime_to_distributed_ids()
        if not multihost.is_distributed_to_device_ids_initialized():
            multihost.initialize_distributed_to_device_ids()
        options = em.CheckpointManagerOptions(
            local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=em.PersistentCheckpointOptions(save_interval_steps=2, max_to_keep=2),
        )
        self.mngr = em.CheckpointManager(
            cfg["local"], cfg["shared"], global_mesh=mesh, abstract_state=abstract,
            options=options,
        )  # fmt: skip

    def persistent(self, step: int) -> bool:
        return step % 2 == 0

    def save(self, step: int, state: Any) -> None:
        import orbax.checkpoint as ocp

        # Not forced: its own intervals say which folders get the step.
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

    def restore(self, abstract: Any) -> Any:
        return self.mngr.restore(self.mngr.latest_step()).state


class _Standard:
    """Orbax's standard manager on the shared folder."""

    def __init__(self, cfg: dict[str, Any], mesh: Any, abstract: Any):
        import orbax.checkpoint as ocp

        self.mngr = ocp.CheckpointManager(cfg["shared"])

    def persistent(self, step: int) -> bool:
        return True

    def save(self, step: int, state: Any) -> None:
        import orbax.checkpoint as ocp

        self.mngr.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, abstract: Any) -> Any:
        import orbax.checkpoint as ocp

        return self.mngr.restore(self.mngr.latest_step(), args=ocp.args.StandardRestore(abstract))


class _Cocijax:
    """cocijax's manager on the shared folder."""

    def __init__(self, cfg: dict[str, Any], mesh: Any, abstract: Any):
        import cocijax as cj

        self.mngr = cj.CheckpointManager(cfg["shared"], policy=cj.policies.fixed(10**9))

    def persistent(self, step: int) -> bool:
        return True

    def save(self, step: int, state: Any) -> None:
        self.mngr.save(step, state, loss=1.0, force=True)

    def restore(self, abstract: Any) -> Any:
        return self.mngr.restore(target=abstract)


class _CocijaxLocal(_Cocijax):
    """cocijax with ``host_local=True``: each process's own folder, the durable tier shared."""

    def __init__(self, cfg: dict[str, Any], mesh: Any, abstract: Any):
        import cocijax as cj

        self.mngr = cj.CheckpointManager(
            cfg["local"], durable=cfg["shared"], host_local=True, policy=cj.policies.fixed(10**9)
        )

    def wait_persistent(self) -> None:
        self.mngr.wait_until_finished(durable=True)  # drained and committed on the shared tier


METHODS = {
    "orbax-emergency": _Emergency,
    "orbax-standard": _Standard,
    "cocijax": _Cocijax,
    "cocijax-local": _CocijaxLocal,
}


def _work(cfg: dict[str, Any]) -> dict[str, Any]:
    """One process of one phase of one method; returns what it measured."""
    import jax
    import numpy as np

    mesh = _init(cfg)
    Path(cfg["local"]).mkdir(parents=True, exist_ok=True)  # empty on a new machine
    abstract = _abstract(_state(mesh, cfg["mib"], 0))
    method = METHODS[cfg["method"]](cfg, mesh, abstract)
    out: dict[str, Any] = {}
    if cfg["phase"] == "save":
        blocking, persistent = [], []
        for step in range(1, cfg["steps"] + 1):
            state = jax.block_until_ready(_state(mesh, cfg["mib"], step))
            start = time.perf_counter()
            method.save(step, state)
            blocking.append(time.perf_counter() - start)
            if method.persistent(step):
                getattr(method, "wait_persistent", method.mngr.wait_until_finished)()
                persistent.append(time.perf_counter() - start)
        method.mngr.wait_until_finished()
        out = {"blocking": blocking, "persistent": persistent}
    else:
        start = time.perf_counter()
        restored = jax.block_until_ready(method.restore(abstract))
        out["restore_s"] = time.perf_counter() - start
        want = _state(mesh, cfg["mib"], cfg["steps"])
        out["bit_exact"] = all(
            np.array_equal(np.asarray(got.data), np.asarray(ref.data))
            for name in want
            for got, ref in zip(
                restored[name].addressable_shards, want[name].addressable_shards, strict=True
            )
        )
    method.mngr.close()
    return out


# -- the driver -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phase(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs one phase in both processes; their results, or RuntimeError with the error."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    port = _free_port()
    procs = []
    for i in range(PROCESSES):
        case = {**cfg, "process_id": i, "port": port, "local": str(Path(cfg["root"]) / f"local{i}")}
        command = [sys.executable, __file__, "--_worker", json.dumps(case)]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(subprocess.Popen(command, env=env, **pipes))
    results, errors = [], []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"process {i}: no end after {TIMEOUT_S:g} s") from None
        if p.returncode != 0:
            lines = [line for line in err.splitlines() if line.strip()]
            errors.append(f"process {i} exited {p.returncode}: {lines[-1] if lines else ''}")
        else:
            results.append(json.loads(out.strip().splitlines()[-1]))
    if errors:
        raise RuntimeError("; ".join(errors))
    return results


def run_method(method: str, *, steps: int, mib: int, root: Path) -> dict[str, Any]:
    """Both phases of one method in ``root``; its JSON row."""
    row: dict[str, Any] = {"method": method, "processes": PROCESSES, "mib": mib, "steps": steps}
    row |= dict(blocking_s=None, to_persistent_s=None, restore_replaced_s=None, bit_exact=None)
    cfg = {"method": method, "steps": steps, "mib": mib, "root": str(root)}
    cfg["shared"] = str(root / "shared")
    try:
        saved = _phase({**cfg, "phase": "save"})
        row["blocking_s"] = max(statistics.median(r["blocking"]) for r in saved)
        row["to_persistent_s"] = max(statistics.median(r["persistent"]) for r in saved)
        shutil.rmtree(root / "local1", ignore_errors=True)  # process 1 is a new machine
        restored = _phase({**cfg, "phase": "restore"})
        row["restore_replaced_s"] = max(r["restore_s"] for r in restored)
        row["bit_exact"] = all(r["bit_exact"] for r in restored)
    except RuntimeError as e:
        row["error"] = str(e)
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{PROCESSES} processes on 127.0.0.1, a shared persistent folder")
    for name in ("method", "blocking s", "to persistent s", "restore replaced s", "bit exact"):
        table.add_column(name)
    table.add_column("error", overflow="fold")
    for row in rows:
        cells = [row["blocking_s"], row["to_persistent_s"], row["restore_replaced_s"]]
        table.add_row(
            row["method"],
            *("-" if v is None else f"{v:.3f}" for v in cells),
            "-" if row["bit_exact"] is None else str(row["bit_exact"]),
            row.get("error", ""),
        )
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB, 4 steps (else 256, 6)")
    parser.add_argument("--json", help="write the rows (a JSON list) to this file")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker:
        print(json.dumps(_work(json.loads(args._worker))))
        return 0
    steps, mib = (4, 8) if args.quick else (6, 256)
    rows = []
    for method in args.methods:
        with tempfile.TemporaryDirectory(prefix=f"hosts-{method}-") as root:
            rows.append(run_method(method, steps=steps, mib=mib, root=Path(root)))
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
