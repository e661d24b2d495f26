"""The chaos benchmark's machinery: a tiny job killed once by the supervisor, resumed, reported.

``benchmarks/chaos_bench.py`` runs the real supervisor here (a real process, a real SIGKILL, a
real restart) on a tiny model, with the failure at a given time instead of a Poisson draw.
Nothing about timings is asserted: only what happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos_bench.py"
KEYS = {"config", "seed", "wall_s", "failures", "saves", "overhead_s", "weighted_overhead_s",
        "sim_overhead_s"}  # fmt: skip

pytest.importorskip("flax")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_killed_job_resumes_from_its_checkpoint_and_ends_like_an_uninterrupted_run(tmp_path):
    out = tmp_path / "runs.json"
    cmd = [
        sys.executable, str(BENCH), "--tiny", "--steps", "3000", "--seeds", "1",
        # Orbax's manager saves the first step and then every 500: a committed checkpoint
        # exists long before the failure however busy the machine is, and the job (a few
        # seconds of training) is far from done when it strikes.
        "--configs", "orbax-fixed", "no-failures", "--every", "500", "--fail-at", "1.0",
        "--workdir", str(tmp_path), "--json", str(out),
    ]  # fmt: skip
    # JAX's persistent compilation cache keeps the test short: the three processes compile the
    # same programs (the benchmark itself compiles at every start, as a restarted job does).
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    data = json.loads(out.read_text())
    assert set(data) == {"runs"}
    assert all(set(run) == KEYS for run in data["runs"])
    runs = {run["config"]: run for run in data["runs"]}
    assert set(runs) == {"orbax-fixed", "no-failures"}
    base, run = runs["no-failures"], runs["orbax-fixed"]
    assert base["failures"] == 0 and base["saves"] == 0 and base["sim_overhead_s"] is None
    assert run["failures"] == 1 and run["saves"] >= 2
    for key in ("wall_s", "overhead_s", "weighted_overhead_s", "sim_overhead_s"):
        assert isinstance(run[key], float), key

    # The log tells the story: the job was killed once, the second process resumed from a
    # step the first one had saved, and finished with the uninterrupted run's state.
    log = records(tmp_path / "orbax-fixed-seed0.jsonl")
    events = [r.get("event") for r in log]
    assert events.count("spawn") == 2 and events.count("kill") == 1
    kill = events.index("kill")
    saved = {r["step"] for r in log[:kill] if r.get("event") == "save"}
    # Each commit is logged after its save; the first one committed long before the kill.
    order = {(r.get("event"), r.get("step")): i for i, r in enumerate(log)}
    commits = [r["step"] for r in log if r.get("event") == "commit"]
    assert all(order["save", s] < order["commit", s] for s in commits), commits
    assert 1 in commits and order["commit", 1] < kill
    first, second = (r for r in log if r.get("event") == "ready")
    assert first["restored"] is None
    assert second["restored"] in saved
    steps = [r["step"] for r in log[kill:] if "loss" in r]
    assert steps == list(range(second["restored"] + 1, 3001))
    (done,) = (r for r in log if r.get("event") == "done")
    (base_done,) = (
        r for r in records(tmp_path / "no-failures-seed0.jsonl") if r.get("event") == "done"
    )
    assert done["digest"] == base_done["digest"]
