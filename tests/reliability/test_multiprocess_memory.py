"""Several JAX processes, each with a memory tier of its own (``host_local=True, memory=``).

``_mpmemory_worker.py`` runs the processes (``jax.distributed`` on 127.0.0.1 with gloo, 8
simulated devices in all). Each process has its own directory and its own memory folder on the
tmpfs (standing for its host's memory); the durable tier is a shared path. A two-level policy
saves level 1 (memory only) at odd steps and level 2 (memory, disk, durable) at even ones. The
first run ends without closing (a failure of the job); the tests restart the job and check from
the files the processes left which step each restored, from which tier, and bit-exact.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import launch_job

from cocijax.core._memory import find_tmpfs

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("reliability-multiprocess")]

DEVICES = 8  # in all, over the processes
PROCESSES = 2


def _launch(cfg: dict[str, Any], timeout: float = 180.0) -> None:
    """Runs the workers together; fails with their stderr if any fails."""
    launch_job("_mpmemory_worker.py", cfg, PROCESSES, devices=DEVICES // PROCESSES, timeout=timeout)


def _records(cfg: dict[str, Any], name: str) -> list[dict[str, Any]]:
    out = Path(cfg["out"])
    return [json.loads((out / f"{name}_{i}.json").read_text()) for i in range(PROCESSES)]


@pytest.fixture
def cfg(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Each process's directory and memory folder (on the tmpfs), the shared durable tier."""
    tmpfs = find_tmpfs()
    if tmpfs is None:
        pytest.skip("no shared-memory tmpfs on this machine")
    memory = [tempfile.mkdtemp(dir=tmpfs, prefix=f"cocijax-test-host{i}-") for i in range(2)]
    out = tmp_path / "out"
    out.mkdir()
    dirs = [str(tmp_path / f"host{i}" / "ckpt") for i in range(PROCESSES)]
    yield {"dirs": dirs, "memory": memory, "durable": str(tmp_path / "durable"), "out": str(out)}
    for folder in memory:
        shutil.rmtree(folder, ignore_errors=True)


def _save(cfg: dict[str, Any], steps: int = 5) -> None:
    _launch({**cfg, "mode": "save", "steps": steps})
    evens = list(range(2, steps + 1, 2))
    for rec in _records(cfg, "save"):
        assert rec["saved"] == list(range(1, steps + 1)), rec
        # Level 1 (odd) in memory only, level 2 (even) also on each disk and the durable tier;
        # each memory tier keeps two slots.
        assert rec["memory"] == [steps - 1, steps], rec
        assert rec["local"] == rec["durable"] == evens[-2:], rec


@pytest.mark.long  # CI keeps the rebooted host (make test-long: all)
def test_every_process_restores_from_its_memory_when_all_hold_the_step(cfg) -> None:
    _save(cfg)
    _launch({**cfg, "mode": "restore"})
    for rec in _records(cfg, "restore"):
        assert (rec["step"], rec["tier"]) == (5, "memory"), rec
        assert rec["mismatches"] == [] and rec["shards"] > 0, rec
        assert rec["memory"] == [4, 5], rec
        # The first run died; each host's memory survived: a process failure on each.
        assert (rec["failures"], rec["machine_failures"]) == (1, 0), rec
        assert rec["after"] == {"memory": [6, 7], "local": [2, 4, 6]}, rec


def test_a_rebooted_host_makes_every_process_restore_from_the_disk(cfg) -> None:
    _save(cfg)
    # Process 1's host rebooted: its tmpfs is empty (its disk kept).
    rebooted = Path(cfg["memory"][1])
    shutil.rmtree(rebooted)
    rebooted.mkdir()
    _launch({**cfg, "mode": "restore"})
    restores = _records(cfg, "restore")
    for rec in restores:
        # Step 5 was in memory only (level 1), and only process 0 still has it: no process
        # lists it. Step 4 is in process 0's memory too, but not in process 1's: both read
        # their disk copy.
        assert (rec["step"], rec["tier"]) == (4, "local"), rec
        assert rec["steps"] == [2, 4] and rec["memory"] == [], rec
        assert rec["mismatches"] == [] and rec["shards"] > 0, rec
        # The job goes on from step 4: process 0's memory step 5 (which process 1 lacked) is
        # saved anew.
        assert rec["after"] == {"memory": [5, 6], "local": [2, 4, 6]}, rec
    failures = [(r["failures"], r["machine_failures"]) for r in restores]
    assert failures == [(1, 0), (1, 1)]  # process 1's host lost its memory: a machine failure


@pytest.mark.long  # CI keeps the rebooted host (make test-long: all)
def test_a_damaged_memory_copy_on_one_process_moves_every_process_to_an_older_step(cfg):
    _save(cfg)
    # A byte flipped in process 1's memory copy of step 5, a level-1 step (memory only): found
    # only as it is read (its checksum).
    chunk = next(p for p in Path(cfg["memory"][1]).glob("*/5/state/**/c.*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    _launch({**cfg, "mode": "restore"})
    restores = _records(cfg, "restore")
    # Process 1 has no other copy of step 5: every process restores step 4 from its memory
    # (process 0 too, whose step 5 is intact: never each its own step).
    assert [(r["step"], r["tier"]) for r in restores] == [(4, "memory")] * 2
    for rec in restores:
        assert rec["mismatches"] == [] and rec["shards"] > 0, rec
        assert rec["after"] == {"memory": [5, 6], "local": [2, 4, 6]}, rec
