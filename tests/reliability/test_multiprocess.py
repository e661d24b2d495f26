"""Two JAX processes on 127.0.0.1 save one globally sharded state through the manager.

``_mp_worker.py`` runs the processes (``jax.distributed.initialize`` with gloo CPU collectives,
two simulated devices each, one 4-device mesh). The test then checks, from the files and the
records the processes left: every process took the same save decisions although each fed the
manager different losses and step times; each process opened only the pieces of the shards it
owns (replica 0) and together they wrote every piece; and the newest step restores equal to the
gathered original in one process (1 and 4 devices) and in two processes. A SIGTERM sent to one
process makes both take the preemption save at the same step, with JAX's preemption service and
without it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import item_dir, launch_job, pieces

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("reliability-multiprocess")]


def _launch(
    cfg: dict[str, Any],
    n: int,
    devices: int,
    timeout: float = 240.0,
    while_running: Callable[[list[subprocess.Popen]], None] | None = None,
) -> None:
    """Runs ``n`` workers (process ids 0..n-1) together; fails with their stderr if any fails."""
    launch_job(
        "_mp_worker.py", cfg, n, devices=devices, timeout=timeout, while_running=while_running
    )


def _contains(outer: list[list[int]], inner: list[list[int]]) -> bool:
    return all(o[0] <= i[0] and i[1] <= o[1] for o, i in zip(outer, inner, strict=True))


def test_two_processes_save_shards_and_restore_anywhere(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cfg = {
        "directory": str(tmp_path / "ckpt"),
        "roots": [str(tmp_path / "r0"), str(tmp_path / "r1")],
        "out": str(out),
        "steps": 8,
        # Young's interval depends on the measured step time, which differs per process.
        "policy": "young",
        "policy_kwargs": {"mtbf_s": 0.02, "cost_prior_s": 0.01},
    }
    _launch({**cfg, "mode": "save"}, n=2, devices=2)
    records = [json.loads((out / f"process_{i}.json").read_text()) for i in range(2)]

    # Same decisions everywhere, and at least one save happened.
    assert records[0]["decisions"] == records[1]["decisions"]
    assert any(records[0]["decisions"][:-1]), "the policy never saved: decisions untested"
    assert not all(records[0]["decisions"]), "the policy saved every step: decisions untested"
    step = records[0]["latest"]
    assert step == records[1]["latest"] == cfg["steps"]

    # Each process opened exactly the pieces of the shards it owns; together, all pieces.
    all_pieces = pieces(item_dir(Path(cfg["directory"]), step))
    assert all_pieces
    for piece in all_pieces:
        writers = [
            i
            for i, rec in enumerate(records)
            if any(p.rstrip("/").endswith(piece.relpath.rstrip("/")) for p in rec["opened"])
        ]
        owners = [
            i
            for i, rec in enumerate(records)
            if any(_contains(shard, piece.index) for shard in rec["owned"].get(piece.leaf, []))
        ]
        assert len(writers) == 1, f"{piece.leaf} {piece.relpath}: opened by processes {writers}"
        assert writers[0] in owners, (
            f"{piece.leaf} {piece.index} was written by process {writers[0]}, "
            f"which owns {records[writers[0]]['owned'].get(piece.leaf)}"
        )
    # Both processes wrote something (the weight is sharded over both).
    assert all(any(rec["owned"].values()) for rec in records)

    for n, devices in ((1, 1), (1, 4), (2, 2)):
        _launch({**cfg, "mode": "restore", "step": step}, n=n, devices=devices)
        for i in range(n):
            rec = json.loads((out / f"restore_{n}_{i}.json").read_text())
            assert rec["mismatches"] == [], (n, devices, rec)
            assert rec["devices"] == n * devices
            assert rec["shards"] >= rec["leaves"]


@pytest.mark.long
def test_a_shared_directory_of_4_processes_restores_on_2_and_on_1(tmp_path: Path) -> None:
    # One shared directory and shared roots (the default mode): 4 processes of 2 devices save;
    # 2 processes of 2 devices (4 in all) and 1 process of 4 then 1 device restore bit-exact.
    out = tmp_path / "out"
    out.mkdir()
    cfg = {
        "directory": str(tmp_path / "ckpt"),
        "roots": [str(tmp_path / "r0")],
        "out": str(out),
        "steps": 4,
        "policy": "fixed",
        "policy_kwargs": {"every": 2},
    }
    _launch({**cfg, "mode": "save"}, n=4, devices=2)
    assert json.loads((out / "process_0.json").read_text())["latest"] == 4
    for n, devices in ((2, 2), (1, 4), (1, 1)):
        _launch({**cfg, "mode": "restore", "step": 4}, n=n, devices=devices)
        for i in range(n):
            rec = json.loads((out / f"restore_{n}_{i}.json").read_text())
            assert rec["mismatches"] == [], (n, devices, rec)
            assert rec["devices"] == n * devices and rec["shards"] >= rec["leaves"], rec


@pytest.mark.parametrize("service", [True, False], ids=["jax-preemption-service", "flag-exchange"])
def test_sigterm_to_one_process_makes_both_save_the_same_step(tmp_path: Path, service) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cfg = {"directory": str(tmp_path / "ckpt"), "out": str(out), "steps": 20_000}
    cfg.update(roots=None, service=service, mode="preempt")

    def preempt_process_1(procs: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + 120
        while not all((out / f"ready_{i}").exists() for i in range(2)):
            assert all(p.poll() is None for p in procs), "a worker ended before it was ready"
            assert time.monotonic() < deadline, "the workers never got under way"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)  # process 0 gets nothing

    _launch(cfg, n=2, devices=1, while_running=preempt_process_1)
    records = [json.loads((out / f"preempt_{i}.json").read_text()) for i in range(2)]
    step = records[0]["preempted_at"]
    assert step is not None and step > 20, records
    assert records[1]["preempted_at"] == step
    assert records[0]["saved"] and records[1]["saved"]
    assert records[0]["steps"] == records[1]["steps"] == [step]
