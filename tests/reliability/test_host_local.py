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
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import item_dir, launch_job

from cocijax import storage

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("reliability-multiprocess")]

DEVICES = 8  # in all, over the processes


def _launch(
    cfg: dict[str, Any], timeout: float = 300.0, devices: int = DEVICES, killed: int = -1
) -> None:
    """Runs ``len(cfg["dirs"])`` workers together (``devices`` in all); fails with their
    stderr if any fails (but process ``killed``, which must die of SIGKILL)."""
    n = len(cfg["dirs"])
    launch_job("_hosts_worker.py", cfg, n, devices=devices // n, timeout=timeout, killed=killed)


def _records(cfg: dict[str, Any], name: str) -> list[dict[str, Any]]:
    out = Path(cfg["out"])
    return [json.loads((out / f"{name}_{i}.json").read_text()) for i in range(len(cfg["dirs"]))]


def _config(tmp_path: Path, processes: int = 2, **extra: Any) -> dict[str, Any]:
    out = tmp_path / "out"
    out.mkdir()
    dirs = [str(tmp_path / f"host{i}" / "ckpt") for i in range(processes)]
    return {"dirs": dirs, "durable": str(tmp_path / "durable"), "out": str(out), **extra}


@pytest.mark.long  # CI keeps the replaced host and the kill mid-save (make test-long: all)
def test_each_process_saves_its_own_copy_and_drains_its_shards(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=6)
    _launch({**cfg, "mode": "save"})
    saves = _records(cfg, "save")
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

    # Another topology (the devices in reverse order): each process's own copy lacks rows its
    # devices now hold, so every process reads the step from both processes' folders (one
    # machine: both reachable), and, once process 1's folder is gone, from the durable tier.
    _launch({**cfg, "mode": "restore", "reverse": True})
    restores = _records(cfg, "restore")
    assert [(r["step"], r["tier"]) for r in restores] == [(6, "local")] * 2, restores
    for r in restores:
        assert r["mismatches"] == [] and r["shards"] > 0, r
    shutil.rmtree(Path(cfg["dirs"][1]).parent)
    _launch({**cfg, "dirs": cfg["dirs"][:1], "mode": "restore", "reverse": True}, devices=4)
    [r] = _records({**cfg, "dirs": cfg["dirs"][:1]}, "restore")
    assert (r["step"], r["tier"], r["mismatches"]) == (6, "durable", []), r


@pytest.mark.parametrize(
    ("processes", "durable"),
    [
        (2, "path"),
        pytest.param(2, "s3", marks=pytest.mark.long),
        pytest.param(4, "path", marks=pytest.mark.long),
    ],
)
def test_a_replaced_host_restores_from_the_durable_tier(
    tmp_path: Path, request: pytest.FixtureRequest, processes: int, durable: str
) -> None:
    # Every second saved step is drained: the durable tier gets step 4, not 6, so the newest
    # step every process can serve after process 1 loses its folder is 4 (the others still
    # have 6 locally; restoring it there would leave the processes on different steps).
    cfg = _config(tmp_path, processes, steps=6, durable_every=2)
    if durable == "s3":
        s3 = request.getfixturevalue("s3")
        cfg.update(durable=s3.url("run"), durable_options=s3.options)
    _launch({**cfg, "mode": "save"})
    saves = _records(cfg, "save")
    assert saves[0]["durable"] == [4]
    assert all(rec["local"] == [4, 6] for rec in saves), saves

    shutil.rmtree(Path(cfg["dirs"][1]).parent)  # a new machine: empty local folders
    _launch({**cfg, "mode": "restore"})
    restores = _records(cfg, "restore")
    assert [r["step"] for r in restores] == [4] * processes
    tiers = ["local"] * processes
    tiers[1] = "durable"
    assert [r["tier"] for r in restores] == tiers
    assert all(r["steps"] == [4] for r in restores), restores
    for r in restores:
        assert r["mismatches"] == [] and r["shards"] > 0, r


@pytest.mark.long  # CI keeps the replaced host and the kill mid-save (make test-long: all)
def test_a_step_one_process_could_not_commit_is_listed_by_none(tmp_path: Path) -> None:
    # Process 1's local commit of step 6 fails (a full disk): its wait raises that; process
    # 0's durable drain of step 6 never gets process 1's shards and commits nothing; once they
    # exchanged what they hold, neither lists step 6. The job goes on: step 8 is saved and
    # drained everywhere, and the part process 0 drained of step 6 is collected.
    cfg = _config(tmp_path, failing=1, timeout_s=5.0)
    _launch({**cfg, "mode": "fault"})
    faults = _records(cfg, "fault")
    assert "No space left on device (injected)" in faults[1]["error_6"], faults[1]
    assert "DurableTierError" in faults[0]["error_6"], faults[0]
    assert "process(es) [1]" in faults[0]["error_6"], faults[0]
    assert [f["steps_6"] for f in faults] == [[2, 4]] * 2, faults
    assert all("error_8" not in f for f in faults), faults
    assert [f["steps_8"] for f in faults] == [[2, 4, 8]] * 2, faults
    assert faults[0]["durable"] == [2, 4, 8]
    assert not (Path(cfg["durable"]) / "6").exists()


@pytest.mark.long  # CI keeps the replaced host and the kill mid-save (make test-long: all)
def test_a_process_that_never_opens_makes_the_others_fail_within_the_bound(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, timeout_s=3.0)
    _launch({**cfg, "mode": "absent"})
    record = json.loads((Path(cfg["out"]) / "absent_0.json").read_text())
    assert record["error"] is not None, record
    assert record["error"].startswith("HostsError: "), record
    assert "process(es) 1 " in record["error"] and "within 3 s" in record["error"], record
    assert record["elapsed_s"] < 60, record  # a hang guard: the bound is 3 s


def _restored(cfg: dict[str, Any], processes: int) -> list[dict[str, Any]]:
    return _records({**cfg, "dirs": cfg["dirs"][:processes]}, "restore")


@pytest.mark.long
def test_a_job_of_4_processes_restores_on_2_and_on_1(tmp_path: Path) -> None:
    # 4 processes of 2 devices save steps 2, 4, 6 (6 forced), every second one drained: the
    # durable tier holds step 4 whole, each process's folder its own quarter of steps 4 and 6.
    cfg = _config(tmp_path, 4, steps=6, durable_every=2)
    _launch({**cfg, "mode": "save"})
    assert _records(cfg, "save")[0]["durable"] == [4]
    folders = sorted(p.name for p in (Path(cfg["durable"]) / "cocijax-folders").iterdir())
    assert len(folders) == 4, folders  # each process recorded its folder

    # Step 6 is only in the 4 folders, each holding a quarter of the rows; every folder is
    # reachable (one machine): the reading processes merge the 4 copies.
    for processes in (2, 1):  # 4 devices in all, then 1
        run = {**cfg, "dirs": cfg["dirs"][:processes], "mode": "restore"}
        _launch(run, devices=4 // processes * processes)
        for r in _restored(cfg, processes):
            assert (r["step"], r["tier"]) == (6, "local"), r
            assert r["mismatches"] == [] and r["shards"] > 0, r
    # The openings drained no part of the processes' copies as a whole step.
    assert not (item_dir(cfg["durable"], 6) / "cocijax_manifest.json").exists()

    shutil.rmtree(Path(cfg["dirs"][3]).parent)  # process 3's machine is gone
    for processes in (2, 1):
        run = {**cfg, "dirs": cfg["dirs"][:processes], "mode": "restore"}
        # Step 6 is committed in every reading process's folder, but no tier holds process
        # 3's rows of it: a region no tier holds for the new devices.
        _launch({**run, "may_fail": True}, devices=4 // processes * processes)
        for i, r in enumerate(_restored(cfg, processes)):
            assert r["error"].startswith("RegionNotHeldError: "), r
            assert f"holds the shards of process {i} only" in r["error"], r
            assert "Leaf ['opt_state']" in r["error"] or "Leaf ['params']" in r["error"], r
            assert "region [" in r["error"], r
            assert any("other processes' local" in note for note in r["notes"]), r
            assert any("fallback=True" in note for note in r["notes"]), r
        # With fallback, the newest step complete in some tier: step 4 from the durable tier.
        _launch({**run, "fallback": True}, devices=4 // processes * processes)
        for r in _restored(cfg, processes):
            assert (r["step"], r["tier"]) == (4, "durable"), r
            assert r["mismatches"] == [] and r["shards"] > 0, r
    # One process asked for step 4, which its folder holds a quarter of (and the 3 folders
    # left three quarters): the durable copy.
    _launch({**cfg, "dirs": cfg["dirs"][:1], "mode": "restore", "step": 4}, devices=4)
    [r] = _restored(cfg, 1)
    assert (r["step"], r["tier"], r["mismatches"]) == (4, "durable", []), r


@pytest.mark.long
def test_fallback_takes_every_process_to_the_same_step(tmp_path: Path) -> None:
    # Steps 2, 4, 6 saved, every second one drained: step 6 is in the processes' folders
    # only. Process 1's copy of step 6 is damaged: alone, it would fall back to step 4 while
    # process 0 restores 6. Together, both restore step 4, and process 0 drops its step 6
    # (the job saves it again).
    cfg = _config(tmp_path, steps=6, durable_every=2)
    _launch({**cfg, "mode": "save"})
    state = item_dir(cfg["dirs"][1], 6)
    chunks = [
        p for p in state.glob("cocijax-stripe-*/**/*") if p.is_file() and p.name != "zarr.json"
    ]
    assert chunks, state
    for chunk in chunks:
        chunk.write_bytes(bytes(b ^ 0xFF for b in chunk.read_bytes()))

    _launch({**cfg, "mode": "restore", "fallback": True})
    restores = _records(cfg, "restore")
    assert [(r["step"], r["tier"]) for r in restores] == [(4, "local")] * 2, restores
    for r in restores:
        assert r["mismatches"] == [] and r["shards"] > 0, r
    assert not (Path(cfg["dirs"][0]) / "6").exists()


def test_a_process_killed_mid_save_leaves_no_piece_of_its_step(tmp_path: Path) -> None:
    # Process 1 is killed in its local commit of step 6; process 0 committed step 6 in its own
    # folder and drained its shards of it. After the restart no process lists step 6; the job
    # resumes from step 4 with other weights, saves step 6 again and step 8: each process's
    # step 6 is the new one (not the killed run's, which a step already present would keep)
    # in its folder and on the durable tier, bit-exact.
    cfg = _config(tmp_path, killed=1, timeout_s=5.0)
    _launch({**cfg, "mode": "kill"}, killed=1)
    error = json.loads((Path(cfg["out"]) / "kill_0.json").read_text())["error_6"]
    assert error.startswith(("DurableTierError", "HostsError")), error
    assert (Path(cfg["dirs"][0]) / "6").exists()  # process 0's own commit of step 6

    _launch({**cfg, "mode": "resume"})
    resumed = _records(cfg, "resume")
    for r in resumed:
        assert r["steps_opened"] == [2, 4] and r["restored"] == 4, r
        assert r["steps"] == [2, 4, 6, 8] and r["local"] == [6, 8], r
        assert r["mismatches_local"] == [] and r["mismatches_durable"] == [], r
    assert resumed[0]["durable"] == [2, 4, 6, 8]
    assert storage.verify(item_dir(cfg["durable"], 6)) == []


@pytest.mark.long  # CI keeps the replaced host and the kill mid-save (make test-long: all)
def test_skewed_clocks_change_neither_the_saves_nor_the_kept_steps(tmp_path: Path) -> None:
    # Each process's clock has its own offset and runs at its own rate: the step times and
    # save costs each measures differ 16-fold, and so would the intervals Young's rule takes
    # from them. The decision is process 0's, broadcast: the same steps saved and kept.
    skew = [(0.0, 1.0), (-3.6e4, 16.0)]
    cfg = _config(tmp_path, skew=skew, mtbf_s=4.0)
    _launch({**cfg, "mode": "skew"})
    runs = _records(cfg, "skew")
    assert runs[0]["saved"] == runs[1]["saved"], runs
    assert 1 < len(runs[0]["saved"]) < 24, runs  # a decision that depends on the clock
    assert runs[0]["local"] == runs[1]["local"] == runs[0]["saved"][-2:], runs
    assert runs[0]["steps"] == runs[1]["steps"], runs
    assert runs[0]["durable"] == runs[0]["saved"], runs
