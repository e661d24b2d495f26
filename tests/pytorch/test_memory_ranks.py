"""Two PyTorch ranks under ``torchrun`` (gloo on CPU), each with its own memory tier.

One job is run four times on one directory and one memory folder (on this machine's tmpfs, as
both ranks of a one-machine job share it: each rank has a folder of its own in it). Each run
restores the latest step, saves a few more, and ends with a real ``SIGKILL`` of rank 1
(``torchrun`` then stops rank 0), except the last. Between runs the test plays a rebooted host
(rank 1's memory folder emptied) and a damaged copy (a byte of rank 1's newest memory step
flipped). What each rank restored is read from the records the workers wrote (see
``_memory_ranks_worker.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from torch_helpers import run_job

HERE = Path(__file__).parent

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.xdist_group("torch-ranks"),
]


def _run(tmp_path: Path, memory: Path, run: str, steps: int, end: str) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cfg = {
        "directory": str(tmp_path / "ckpt"),
        "memory": str(memory),
        "out": str(out),
        "run": run,
        "steps": steps,
        "end": end,
    }
    job = run_job(HERE / "_memory_ranks_worker.py", json.dumps(cfg))
    records = [out / f"{run}-rank{r}.json" for r in range(2)]
    assert all(p.is_file() for p in records), job.stdout[-5000:]
    assert (job.returncode == 0) == (end == "close"), job.stdout[-5000:]
    return [json.loads(p.read_text()) for p in records]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.long
def test_ranks_restore_from_memory_only_when_every_rank_holds_the_step_intact(tmp_path, memory):
    # Level 2 at steps 4 and 8 (memory, then the directory), level 1 at the others (memory);
    # step 2 is the early save that measures the cost (persisted).
    first = _run(tmp_path, memory, "first", steps=6, end="kill")
    for record in first:
        assert record["after"] == [[5, 6], [2, 4, 5, 6]]
    folders = [Path(r["memory_folder"]) for r in first]
    assert folders[0] != folders[1] and {f.parent for f in folders} == {memory}

    # 1. Rank 1 killed: both ranks' memory tiers hold step 6; both restore it from memory,
    # each its own rows and counter, and the job counts a process failure.
    killed = _run(tmp_path, memory, "killed", steps=2, end="kill")
    for rank, record in enumerate(killed):
        assert record["restored"] == [6, "memory"]
        assert record["exact"] and record["counter"] == 1000 * rank + 6
        assert record["after"] == [[7, 8], [2, 4, 7, 8]]
    assert killed[0]["failures"] == [1, 0]  # rank 0 keeps the job's history

    # 2. Rank 1's host rebooted: its memory folder is empty. No rank restores from memory
    # (rank 0's copies are dropped): both restore step 8 from the directory, and the job
    # counts a machine failure.
    shutil.rmtree(folders[1])
    rebooted = _run(tmp_path, memory, "rebooted", steps=2, end="kill")
    for rank, record in enumerate(rebooted):
        assert record["listed"] == [[], [2, 4, 8]]
        assert record["restored"] == [8, "local"]
        assert record["exact"] and record["counter"] == 1000 * rank + 8
        assert record["after"] == [[9, 10], [2, 4, 8, 9, 10]]
    assert rebooted[0]["failures"] == [2, 1]  # rank 1's memory marker was lost with its host

    # 3. Rank 1's newest memory copy (step 10, level 1: in memory only) is damaged: every rank
    # skips step 10 and restores step 9 from memory.
    _flip_a_byte(folders[1] / "10" / "__0_0.distcp")
    damaged = _run(tmp_path, memory, "damaged", steps=0, end="close")
    for rank, record in enumerate(damaged):
        assert record["restored"] == [9, "memory"]
        assert record["exact"] and record["counter"] == 1000 * rank + 9
        assert any(
            "skipping damaged step 10 (memory copy): rank 1:" in w for w in record["warnings"]
        )
        assert record["after"] == [[9], [2, 4, 8, 9]]
    assert damaged[0]["failures"] == [3, 1]
