"""The chaos benchmark's logic on small inputs: its supervisor, what it measures, its report.

``benchmarks/chaos_bench.py`` supervises a training job (kills it at given times, restarts it),
reads the job's log back and splits each run's wall time into stall, recomputed work and
recovery, which ``cj.sim.replay`` of the run must reproduce. Here the supervisor runs a fake job
of a few lines, and the measurement and the report read a log written by hand, whose every
number is worked out in the comments. One real run of the Flax job (about a minute) is behind
the ``long`` marker (``make test-long``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cocijax as cj

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCH = BENCHMARKS / "chaos_bench.py"


@pytest.fixture(scope="module")
def bench():
    """The benchmark module (it imports its siblings from ``benchmarks/``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        import chaos_bench

        yield chaos_bench


def _write(path: Path, rows: list[dict | str]) -> Path:
    """A log: JSON records, and strings as they are (a line a kill tore)."""
    with path.open("a") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _ready(t: float, restored: int | None, **phases: float) -> dict:
    return {"event": "ready", "t": t, "restored": restored, "state_mib": 1.0, **phases}


def _steps(times: dict[int, float]) -> list[dict]:
    return [{"step": s, "t": t, "loss": 1.0 / s} for s, t in times.items()]


def _save(step: int, t0: float, t1: float) -> dict:
    return {"event": "save", "step": step, "t0": t0, "t1": t1}


# A job of 6 steps of 1 s whose saves block 0.3 s and commit 1 s after their stall. The first
# process starts training at 1.0 and saves steps 2 and 4; it is killed at 6.0, after the save of
# step 4 ended (5.6) but before it committed (6.6): the second process resumes from step 2. Its
# start takes 0.5 s per phase (6.0 to 8.0), and its first step 1.5 s, 0.5 s of which is warm-up
# (recovery, not training): training restarts at 8.5.
FAILED_RUN = [
    {"event": "spawn", "t": 0.0},
    _ready(1.0, None, imports=0.5, open=0.6, init=0.8, compile=1.0),
    *_steps({1: 2.0, 2: 3.0}),
    _save(2, 3.0, 3.3),
    *_steps({3: 4.3}),
    {"event": "commit", "step": 2, "t": 4.3},
    *_steps({4: 5.3}),
    _save(4, 5.3, 5.6),
    '{"step": 5, "lo',  # the line the kill tore
    {"event": "kill", "t": 6.0},
    {"event": "spawn", "t": 6.0},
    _ready(8.0, 2, imports=6.5, open=7.0, restore=7.5, compile=8.0),
    *_steps({3: 9.5, 4: 10.5}),
    _save(4, 10.5, 10.8),
    *_steps({5: 11.8}),
    {"event": "commit", "step": 4, "t": 11.8},
    *_steps({6: 12.8}),
    {"event": "done", "t": 12.8, "digest": "d"},
]
# The same job without failures or saves: 6 s of training.
BASELINE_RUN = [
    {"event": "spawn", "t": 0.0},
    _ready(1.0, None, imports=0.5, open=0.6, init=0.8, compile=1.0),
    *_steps({s: 1.0 + s for s in range(1, 7)}),
    {"event": "done", "t": 7.0, "digest": "d"},
]


def test_read_log_splits_the_processes_and_skips_a_torn_line(bench, tmp_path):
    first, second = bench.read_log(_write(tmp_path / "run.jsonl", FAILED_RUN))
    assert (first.ready, first.restored, first.kill) == (1.0, 0, 6.0)
    assert [s for s, _, _ in first.steps] == [1, 2, 3, 4]
    assert first.saves == [(2, 3.0, 3.3), (4, 5.3, 5.6)] and first.commits == {2: 4.3}
    assert first.phases == {"imports": 0.5, "open": 0.6, "init": 0.8, "compile": 1.0}
    assert (second.spawn, second.ready, second.restored, second.kill) == (6.0, 8.0, 2, None)
    assert [s for s, _, _ in second.steps] == [3, 4, 5, 6] and second.digest == "d"


def test_measure_splits_a_failed_run_into_stall_recomputed_and_recovery(bench, tmp_path):
    weights = np.linspace(1.0, 2.0, 6)
    m = bench.measure(bench.read_log(_write(tmp_path / "run.jsonl", FAILED_RUN)), 6, weights)
    approx = pytest.approx
    assert m.wall_s == approx(11.8)  # training started at 1.0, the last step ended at 12.8
    assert m.failure_times == approx([5.0])
    assert m.save_steps == [2, 4] and m.save_times == approx([2.0, 4.3, 9.5])
    assert m.stall_s == approx(0.9)  # three saves of 0.3 s (step 4 twice)
    # Lost: from the end of step 2 (3.0) to the kill (6.0), less the two stalls in between.
    assert m.recompute_s == approx(2.4)
    # Steps 3 and 4 at 1 s each, 0.4 s of step 5, each at its step's weight.
    assert m.recompute_weighted_s == approx(weights[2] + weights[3] + 0.4 * weights[4])
    # All but the 0.4 s after the uncommitted save's stall: a save that was safe when its
    # stall ended would have lost only those.
    assert m.uncommitted_s == approx(2.0) and m.lost_saves == 1
    # From the kill to the restart's training, its first step's warm-up included.
    assert m.recovery_s == approx(2.5) and m.down == [approx((5.0, 7.5))]
    (restart,) = m.restarts  # start, open, restore, compile, first step's warm-up
    assert list(restart.values()) == approx([0.5] * 5)
    assert m.commit_s == approx(1.0) and m.step_time_s == approx(1.0)
    np.testing.assert_allclose(m.losses, 1.0 / np.arange(1, 7))
    assert m.digest == "d"
    # The split is the whole overhead over the failure-free run (6 s): nothing is left over.
    assert m.stall_s + m.recompute_s + m.recovery_s == approx(m.wall_s - 6.0)


def test_the_report_scores_each_run_against_the_failure_free_one_and_the_replay(bench, tmp_path):
    _write(tmp_path / "orbax-fixed-seed0.jsonl", FAILED_RUN)
    _write(tmp_path / "no-failures-seed0.jsonl", BASELINE_RUN)
    setup = dict(argv=["--workdir", str(tmp_path), "--quick"], steps=6, mtbf=10.0, seeds=1,
                 configs=["orbax-fixed", "no-failures"], every=2, cost_prior=None,
                 compile_cache=False, calibration=None, loads=[[1.0, 1.0], [1.0, 1.5]],
                 disk="tmpfs", elapsed_s=60.0)  # fmt: skip
    (tmp_path / "setup.json").write_text(json.dumps(setup))
    out = tmp_path / "runs.json"
    assert bench.main(["--analyse", str(tmp_path), "--json", str(out)]) == 0
    runs = {run["config"]: run for run in json.loads(out.read_text())["runs"]}
    base, run = runs.pop("no-failures"), runs.pop("orbax-fixed")
    assert not runs
    assert base == {"config": "no-failures", "seed": 0, "wall_s": 6.0, "failures": 0,
                    "saves": 0, "overhead_s": 0.0, "weighted_overhead_s": 0.0,
                    "sim_overhead_s": None}  # fmt: skip
    weights = cj.sim.progress_weights(1.0 / np.arange(1, 7), bench.TIME_WEIGHT)
    assert run["wall_s"] == 11.8 and run["failures"] == 1 and run["saves"] == 3
    assert run["overhead_s"] == pytest.approx(5.8)
    weighted = 5.8 - 2.4 + weights[2] + weights[3] + 0.4 * weights[4]
    assert run["weighted_overhead_s"] == pytest.approx(weighted, abs=1e-3)
    # The replay (saves at steps 2 and 4 of 0.3 s, each committed 1 s later, a failure at 5.0
    # before the second committed, 2.5 s of recovery) is the run, second for second.
    assert run["sim_overhead_s"] == pytest.approx(5.8, abs=1e-3)
    report = bench.analyse(setup, tmp_path)
    text = report.markdown()
    assert str(tmp_path) not in text  # machine paths stay out of BENCHMARKS.md
    assert "| orbax-fixed | 0 | 11.8 | 1 | 3 |" in text


FAKE_JOB = """
import json, sys, time
log, n = sys.argv[1], int(sys.argv[2])
def write(record):
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\\n")
write({"event": "ready", "t": time.monotonic(), "restored": None})
for step in range(1, n + 1):
    time.sleep(0.01)
    write({"step": step, "t": time.monotonic(), "loss": 1.0})
write({"event": "done", "t": time.monotonic(), "digest": "d"})
"""


def test_the_supervisor_kills_at_the_failure_time_and_restarts_until_the_job_is_done(
    bench, tmp_path
):
    log = tmp_path / "job.jsonl"
    cmd = [sys.executable, "-c", FAKE_JOB, str(log), "100"]  # 100 steps of at least 10 ms
    # The second failure is due long after the job ends: not delivered.
    bench.supervise(cmd, log, iter([0.2, 1000.0]), 100, timeout_s=120)
    first, second = bench.read_log(log)
    assert first.kill is not None and first.kill - first.ready >= 0.2
    assert len(first.steps) < 100  # killed mid-run
    assert second.kill is None and [s for s, _, _ in second.steps] == list(range(1, 101))
    assert second.spawn >= first.kill and second.digest == "d"


def test_the_supervisor_names_a_job_that_failed_on_its_own(bench, tmp_path):
    cmd = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3"):
        bench.supervise(cmd, tmp_path / "job.jsonl", iter([1.0]), 10, timeout_s=60)


def test_poisson_failures_are_the_same_for_a_seed_and_increase(bench):
    draw = lambda seed: list(itertools.islice(bench.poisson_failures(seed, 10.0), 2000))
    times = draw(1)
    assert times == draw(1) and times != draw(2)
    assert np.all(np.diff(times) > 0)
    assert np.mean(np.diff(times)) == pytest.approx(10.0, rel=0.1)  # 2000 gaps of mean 10 s


def _records(path: Path) -> list[dict]:
    """A log's records, without a line a kill tore."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@pytest.mark.long
def test_a_killed_job_resumes_from_its_checkpoint_and_ends_like_an_uninterrupted_run(tmp_path):
    """The benchmark itself, end to end, on a tiny model: a real process, a real SIGKILL and a
    real restart, with the failure at a given time. Nothing about timings is asserted."""
    pytest.importorskip("flax")
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
    runs = {run["config"]: run for run in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"orbax-fixed", "no-failures"}
    assert runs["orbax-fixed"]["failures"] == 1 and runs["orbax-fixed"]["saves"] >= 2

    # The log tells the story: the job was killed once, the second process resumed from a
    # step the first one had saved, and finished with the uninterrupted run's state.
    log = _records(tmp_path / "orbax-fixed-seed0.jsonl")
    events = [r.get("event") for r in log]
    assert events.count("spawn") == 2 and events.count("kill") == 1
    kill = events.index("kill")
    saved = {r["step"] for r in log[:kill] if r.get("event") == "save"}
    # Each commit is logged after its save; the first one committed long before the kill.
    order = {(r.get("event"), r.get("step")): i for i, r in enumerate(log)}
    commits = [r["step"] for r in log if r.get("event") == "commit"]
    assert commits and all(order["save", s] < order["commit", s] for s in commits), commits
    assert 1 in commits and order["commit", 1] < kill
    first, second = (r for r in log if r.get("event") == "ready")
    assert first["restored"] is None
    assert second["restored"] in saved
    steps = [r["step"] for r in log[kill:] if "loss" in r]
    assert steps == list(range(second["restored"] + 1, 3001))
    (done,) = (r for r in log if r.get("event") == "done")
    baseline = _records(tmp_path / "no-failures-seed0.jsonl")
    (base_done,) = (r for r in baseline if r.get("event") == "done")
    assert done["digest"] == base_done["digest"]


# -- the failure mix (--mix) -------------------------------------------------------------------


def _commit(tier: str | None, step: int, t: float) -> dict:
    return {"event": "commit", "step": step, "t": t, **({"tier": tier} if tier else {})}


def _level_save(step: int, t0: float, t1: float, level: int) -> dict:
    return {**_save(step, t0, t1), "level": level}


# A two-level run of 10 steps of 1 s. The first process saves step 2 at level 2 (stall 0.5 s,
# in memory, on disk and on the durable tier 1 s later) and step 4 at level 1 (0.2 s, in memory
# only); a process kill at 7.2 s leaves the memory tier: the second process resumes from step 4
# (from memory), saves step 6 at level 1 and is killed at 13.4 s by a machine failure, which
# loses steps 4 and 6 with the memory tier: the third process resumes from step 2 (durable).
# Each restart's first step takes 1.5 s, 0.5 s of it warm-up.
MIX_RUN = [
    {"event": "spawn", "t": 0.0},
    _ready(1.0, None, imports=0.5, open=0.6, init=0.8, compile=1.0),
    *_steps({1: 2.0, 2: 3.0}),
    _level_save(2, 3.0, 3.5, 2),
    *_steps({3: 4.5}),
    _commit(None, 2, 4.5),
    _commit("memory", 2, 4.5),
    _commit("durable", 2, 4.5),
    *_steps({4: 5.5}),
    _level_save(4, 5.5, 5.7, 1),
    *_steps({5: 6.7}),
    _commit("memory", 4, 6.7),
    {"event": "kill", "t": 7.2, "machine": False},
    {"event": "spawn", "t": 7.2},
    {**_ready(9.2, 4, imports=7.7, open=8.2, restore=8.7, compile=9.2), "tier": "memory"},
    *_steps({5: 10.7, 6: 11.7}),
    _level_save(6, 11.7, 11.9, 1),
    *_steps({7: 12.9}),
    _commit("memory", 6, 12.9),
    {"event": "kill", "t": 13.4, "machine": True},
    {"event": "spawn", "t": 13.4},
    {**_ready(16.4, 2, imports=14.4, open=15.4, restore=15.9, compile=16.4), "tier": "durable"},
    *_steps({3: 17.9, **{s: 14.9 + s for s in range(4, 11)}}),
    _level_save(10, 24.9, 25.4, 2),
    {"event": "done", "t": 25.4, "digest": "d"},
]
BASELINE_10 = [
    {"event": "spawn", "t": 0.0},
    _ready(1.0, None, imports=0.5, open=0.6, init=0.8, compile=1.0),
    *_steps({s: 1.0 + s for s in range(1, 11)}),
    {"event": "done", "t": 11.0, "digest": "d"},
]


def test_the_mix_measures_a_machine_failure_back_past_the_saves_it_lost(bench, tmp_path):
    atts = bench.read_log(_write(tmp_path / "run.jsonl", MIX_RUN))
    assert [a.machine for a in atts] == [False, True, False]
    assert [a.tier for a in atts] == [None, "memory", "durable"]
    assert atts[0].levels == {2: 2, 4: 1} and atts[0].tier_commits["memory"] == {2: 4.5, 4: 6.7}
    m = bench.measure(atts, 10, np.ones(10))
    approx = pytest.approx
    assert m.wall_s == approx(23.9) and m.failure_times == approx([6.2, 12.4])
    assert m.failure_machine == [False, True] and m.restart_machine == [False, True]
    assert m.stall_s == approx(0.9)  # the final save ends after the last step: not counted
    # Recovery: 7.2 to 9.7 and 13.4 to 16.9 (each with its first step's warm-up).
    assert m.recovery_s == approx(6.0)
    # Recomputed: 1.5 s after step 4 at the process kill; 3.5 s of the second process
    # (steps 5 to 7 and 0.5 s); steps 3 and 4 of the first process, which the machine failure
    # lost with the memory tier (2 s).
    assert m.recompute_s == approx(1.5 + 3.5 + 2.0)
    assert m.stall_s + m.recompute_s + m.recovery_s == approx(m.wall_s - 10.0)


def test_the_mix_report_replays_each_run_at_two_levels_and_pairs_the_configs(bench, tmp_path):
    for name in ("coci-2level", "coci-1level"):
        _write(tmp_path / f"{name}-seed0.jsonl", MIX_RUN)
    _write(tmp_path / "no-failures-seed0.jsonl", BASELINE_10)
    setup = dict(argv=["--mix", "--workdir", str(tmp_path)], steps=10, mtbf=5.0, seeds=1,
                 configs=["coci-2level", "coci-1level", "no-failures"], every=None,
                 every_durable=None, mix=True, machine_share=0.2, cost_prior=None,
                 compile_cache=False, calibration=None, loads=[[1.0, 1.0]], disk="tmpfs",
                 elapsed_s=60.0)  # fmt: skip
    (tmp_path / "setup.json").write_text(json.dumps(setup))
    out = tmp_path / "mix.json"
    assert bench.main(["--analyse", str(tmp_path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = {run["config"]: run for run in data["runs"]}
    run = runs["coci-2level"]
    assert run["failures"] == {"process": 1, "machine": 1}
    assert run["saves"] == {"level1": 2, "level2": 2}
    assert run["overhead_s"] == pytest.approx(13.9)
    assert [len(run["recovery_phases"][k]) for k in ("process", "machine")] == [1, 1]
    assert run["recovery_phases"]["machine"][0]["restore or init"] == pytest.approx(0.5)
    assert run["restored_tiers"] == ["memory", "durable"]
    # The replay: steps 2 (level 2, 0.5 s), 4 and 6 (level 1, 0.2 s), commits 1 s after each
    # stall, recoveries of 2.5 s (process) and 3.5 s (machine). The process failure (6.2 s)
    # loses 1.5 s back to step 4; the machine failure (12.4 s, at step 7.5) 5.5 s back to
    # step 2, which the job then passes again, saving steps 4 and 6 again (0.4 s more stall).
    assert run["sim_overhead_s"] == pytest.approx(1.5 + 5.5 + 6.0 + 0.5 + 4 * 0.2)
    # One seed: the paired difference is 0, without an interval.
    assert data["paired_to"] == "coci-2level"
    assert data["paired"]["coci-1level"]["overhead_s"] == [0.0, None, None]
    text = bench.analyse(setup, tmp_path).markdown()
    assert str(tmp_path) not in text and "| coci-2level | 0 | 23.9 | 1 / 1 | 2 / 2 |" in text


def test_the_paired_interval_is_students_t_over_seeds(bench):
    from _chaos_mix import paired

    # Differences 2, 3, 4: mean 3, sd 1, t(0.975, 2 df) = 4.303.
    mean, low, high = paired([3.0, 5.0, 7.0], [1.0, 2.0, 3.0])
    half = 4.3027 / math.sqrt(3)
    assert (mean, low, high) == pytest.approx((3.0, 3.0 - half, 3.0 + half), abs=1e-3)


def test_mixed_failures_keep_the_seeds_times_and_draw_classes_once_per_seed(bench):
    from _chaos_supervisor import mixed_failures

    draw = lambda seed: list(itertools.islice(mixed_failures(seed, 10.0, 0.2), 2000))
    mix = draw(3)
    assert mix == draw(3) and [t for t, _ in mix] == list(
        itertools.islice(bench.poisson_failures(3, 10.0), 2000)
    )
    assert np.mean([m for _, m in mix]) == pytest.approx(0.2, abs=0.03)  # 2000 draws


def test_the_supervisor_loses_the_machine_only_at_a_machine_failure(bench, tmp_path):
    log = tmp_path / "job.jsonl"
    cmd = [sys.executable, "-c", FAKE_JOB, str(log), "200"]  # 200 steps of at least 10 ms
    lost = []
    bench.supervise(cmd, log, iter([(0.2, False), (0.4, True)]), 200, 120, None,
                    lambda: lost.append(len(bench.read_log(log))))  # fmt: skip
    first, second, third = bench.read_log(log)
    assert (first.machine, second.machine, third.kill) == (False, True, None)
    assert lost == [2]  # once, after the second process was killed, before the third started


@pytest.mark.parametrize("config", ["coci-2level", "young-2level", "coci-1level", "orbax-fixed"])
def test_each_mix_config_starts_the_job_with_its_tiers(bench, tmp_path, monkeypatch, config):
    import chaos_job

    args = bench.parse_args(["--mix", "--tiny", "--workdir", str(tmp_path)])
    assert args.configs == list(bench.MIX_CONFIGS) and (args.seeds, args.steps) == (6, 5000)
    b = bench.Bench(args, tmp_path)
    b.every, b.every_durable, b.cost_prior = 50, 200, 0.01
    seen = {}

    def supervise(cmd, log, failures, n_steps, timeout_s, env, lose_machine):
        seen["args"] = chaos_job.parse_args(cmd[2:])  # the job accepts its command line
        seen["lose"] = lose_machine

    monkeypatch.setattr(bench, "supervise", supervise)
    b.run(config, "run", iter(()), mix=True)
    job = seen["args"]
    assert job.durable is not None and job.config == config
    if config in ("coci-2level", "young-2level"):
        assert job.memory is not None
        assert (job.mtbf, job.machine_mtbf) == pytest.approx((20.0 / 0.8, 20.0 / 0.2))
    else:
        assert job.memory is None
    job.dir.mkdir(parents=True)
    seen["lose"]()
    assert not job.dir.exists()
