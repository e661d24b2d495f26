"""Several JAX processes with local folders of their own and a shared durable tier.

``_hosts_worker.py`` runs the processes (``jax.distributed`` on 127.0.0.1 with gloo, 8
simulated devices in all, ``CheckpointManager(host_local=True)``). The tests check, from the
files the processes left: each process's folder holds its own copy (its manifest marked with
its process index, covering the regions its devices hold and nothing else); the durable step
is committed once, from every process's shards, its manifest recording which process drained
which piece; and after a process is restarted with an empty folder (a replaced host) the job
restores the newest step every process can serve, bit-exact, the replaced process from the
durable tier and the others from their own folders.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import HERE, child_env, free_port, item_dir

from cocijax import storage

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("reliability-multiprocess")]

PROCESSES = 2
DEVICES = 8  # in all: 4 per process


def _launch(cfg: dict[str, Any], timeout: float = 240.0) -> None:
    """Runs the workers together; fails with their stderr if any fails."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "_hosts_worker.py"),
                json.dumps({**cfg, "num_processes": PROCESSES, "process_id": i, "port": port}),
            ],
            env=child_env(DEVICES // PROCESSES),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    errors = []
    try:
        for i, p in enumerate(procs):
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                errors.append(f"process {i} exited {p.returncode}:\n{err[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert not errors, "\n".join(errors)


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}_{i}.json").read_text()) for i in range(PROCESSES)]


def _config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    out = tmp_path / "out"
    out.mkdir()
    dirs = [str(tmp_path / f"host{i}" / "ckpt") for i in range(PROCESSES)]
    return {"dirs": dirs, "durable": str(tmp_path / "durable"), "out": str(out), **extra}


def test_each_process_saves_its_own_copy_and_drains_its_shards(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=6)
    _launch({**cfg, "mode": "save"})
    saves = _records(Path(cfg["out"]), "save")
    assert saves[0]["saved"] == saves[1]["saved"] == [2, 4, 6]
    for i, rec in enumerate(saves):
        # Per-process retention (max_to_keep=2): each process deleted in its own folder.
        assert rec["local"] == [4, 6], (i, rec)
        on_disk = sorted(int(p.name) for p in Path(cfg["dirs"][i]).iterdir() if p.name.isdigit())
        assert on_disk == [4, 6], (i, on_disk)
    assert saves[0]["durable"] == [2, 4, 6]

    # Each local copy is its process's: marked so, and holding exactly the regions its devices
    # hold (the replicated bias too: a copy restores without the other processes).
    for i, rec in enumerate(saves):
        manifest = storage.read_manifest(item_dir(cfg["dirs"][i], 6))
        assert manifest.holder == i
        assert {p.process for p in manifest.pieces} == {i}
        held: dict[str, set] = {}
        for p in manifest.pieces:
            box = tuple((a, b) for a, b in zip(p.start, p.stop, strict=True))
            held.setdefault(manifest.leaves[p.leaf].path, set()).add(box)
        owned = {k: {tuple(map(tuple, b)) for b in v} for k, v in rec["owned"].items() if v}
        assert held == owned, i

    # The durable step: one manifest of the whole tree, from both processes' shards.
    durable = storage.read_manifest(item_dir(cfg["durable"], 6))
    assert durable.holder is None
    assert {p.process for p in durable.pieces} == {0, 1}
    assert storage.verify(item_dir(cfg["durable"], 6)) == []


def test_a_replaced_host_restores_from_the_durable_tier(tmp_path: Path) -> None:
    # Every second saved step is drained: the durable tier gets step 4, not 6, so the newest
    # step every process can serve after process 1 loses its folder is 4 (process 0 still has
    # 6 locally; restoring it alone would leave the processes on different steps).
    cfg = _config(tmp_path, steps=6, durable_every=2)
    _launch({**cfg, "mode": "save"})
    saves = _records(Path(cfg["out"]), "save")
    assert saves[0]["durable"] == [4]
    assert saves[0]["local"] == saves[1]["local"] == [4, 6]

    shutil.rmtree(Path(cfg["dirs"][1]).parent)  # a new machine: empty local folders
    _launch({**cfg, "mode": "restore"})
    restores = _records(Path(cfg["out"]), "restore")
    assert [r["step"] for r in restores] == [4, 4]
    assert [r["tier"] for r in restores] == ["local", "durable"]
    assert restores[0]["steps"] == restores[1]["steps"] == [4]
    for r in restores:
        assert r["mismatches"] == [] and r["shards"] > 0, r
