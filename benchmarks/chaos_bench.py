"""The live chaos benchmark: real training, real failures, policies compared in wall-clock time.

A supervisor starts the training job of ``benchmarks/chaos_job.py`` (a Flax model with about
390 MiB of parameters and Adam moments), SIGKILLs it (its whole process group, as a node
failure would) at failure times drawn from a seeded Poisson process, and starts it again at
once, until the planned steps are done. Recovery is real: a new process, imports, the
checkpoint manager, the restore and the compilation. Each seed draws one sequence of failure
times that every configuration gets (common random numbers); the failure clock starts when the
first process starts training, so that start-up work common to all is not exposed.

Configurations: ``coci``, ``young`` and ``daly`` through ``cj.CheckpointManager`` (given the
MTBF; the step time, save cost and recovery time are what the manager measures),
``orbax-fixed`` (Orbax's own ``ocp.CheckpointManager``, ``save_interval_steps`` = Young's
interval from the save cost and step time a calibration run measured, as a user would set it)
and ``no-failures`` (no checkpoints, no failures: the baseline of each seed). The cocijax
policies start from that calibrated cost too (``cost_prior_s``) until their first save is timed;
``--cost-prior default`` leaves them their default (10 s, meant for clusters), with which a
policy whose first interval outlasts the gaps between failures never saves, so never measures.

Measured per run, from the job's log (every step's loss and end time, every save's blocking
interval, the phases of every start) and the supervisor's kill times:

* **wall**: from the start of training to the end of the last step; **overhead** = wall minus
  the failure-free wall time (the median of the failure-free runs of all seeds: the job is the
  same, and one run slowed by a busy machine would otherwise shift a whole seed);
* its split: **stall** (time ``save`` blocked), **recomputed** (the work each failure destroyed:
  from the end of the step the next process resumed from, or from the killed process's start of
  training if none of its steps survived, to the kill, stalls excluded; the part lost because
  the newest save had not committed is shown apart), **recovery** (from each kill to the next
  start of training, which a restart reaches after its first step's warm-up; all of it when a
  failure strikes during a recovery), and the **rest** (steps slower than in the failure-free
  runs: background writes competing for the cores, and machine noise);
* **weighted overhead**: the overhead with each recomputed second weighted by the hindsight
  progress weight of its step (:func:`cocijax.sim.progress_weights` of a failure-free run's
  loss curve, ``time_weight`` 0.25, as ``benchmarks/policy_bench.py`` scores policies); and
  the same **without the rest** (stall + weighted recomputed + recovery: what ``policy_bench``
  scores, free of the machine's noise in the step time);
* **sim**: :func:`cocijax.sim.replay` of the run (its save steps and failure times, its mean
  step time, its mean stall per save, its mean recovery time, and the median time from a save's
  return to its commit, as the job logs it: a failure before the commit rolls the job back to
  the save before); the simulated job's overhead is
  taken against the same failure-free wall time as the measured one, and compared part by part
  (failures, stall, recomputed, recovery) with the run's;
* **expected**: :func:`cocijax.sim.expected_overhead` of the run's schedule with the same
  measurements under Poisson failures (what ``policy_bench`` would score), and with common
  ones: the failure-free step time and the mean recovery time of all runs (each run keeps its
  stall per save), which ranks the schedules free of the machine's noise;
* the phases of each recovery, the stall per save and the time from its end to the commit, the
  step time against the failure-free run's, and the saves a failure destroyed before they were
  committed.

Run (under the benchmark lock on a shared machine)::

    python benchmarks/chaos_bench.py [--quick] [--seeds 3] [--json PATH] [--write]

``--quick`` runs one seed of a short job (a few minutes on a quiet machine); ``--json`` writes
the runs; ``--workdir DIR`` keeps the logs, which ``--analyse DIR`` reports on again without
running; ``--write`` records the tables, the machine and the figure (``docs/chaos_bench.png``)
in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from _report import cpu_and_ram, filesystem, write_section
from rich.console import Console
from rich.table import Table

import cocijax as cj

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().with_name("chaos_job.py")
DOC_PNG = ROOT / "docs" / "chaos_bench.png"
SECTION = "chaos_bench"
CONFIGS = ("coci", "young", "daly", "orbax-fixed", "no-failures")
TIME_WEIGHT = 0.25
SIM_TOLERANCE = 0.15
FULL = dict(seeds=3, steps=10000, mtbf=20.0)
QUICK = dict(seeds=1, steps=3000, mtbf=10.0)
TINY_JOB = ["--buckets", "4096", "--dim", "8", "--hidden", "32", "--batch", "64"]
CALIBRATION = dict(steps=400, every=100)  # the Orbax save cost a user would measure
SETUP = "setup.json"  # in the work directory: what --analyse needs besides the logs


# -- running the job ---------------------------------------------------------------------------


def poisson_failures(seed: int, mtbf_s: float):
    """Failure times in seconds (an endless increasing sequence), the same for every config."""
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        t += float(rng.exponential(mtbf_s))
        yield t


def append(log: Path, record: dict) -> None:
    """Adds a supervisor record to the job's log (only while no job process is alive)."""
    with log.open("a+b") as f:
        # A line the killed job was writing may be torn: end it, so that ours stays whole.
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(json.dumps(record).encode() + b"\n")


def records(lines: list[bytes] | list[str]):
    """The JSON records of a log's lines, without the lines a kill tore."""
    for line in lines:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


class LogTail:
    """Follows the records a running job appends to its log."""

    def __init__(self, path: Path, n_steps: int):
        self.path, self.n_steps, self.offset = path, n_steps, 0
        self.ready: float | None = None  # the first process's start of training
        self.trained = False  # the last step is logged

    def update(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        for r in records(data[:end].splitlines()):
            if r.get("event") == "ready" and self.ready is None:
                self.ready = r["t"]
            self.trained = self.trained or r.get("step") == self.n_steps


def supervise(
    cmd: list[str], log: Path, failures, n_steps: int, timeout_s: float, env: dict | None = None
) -> None:
    """Runs ``cmd`` until it has trained ``n_steps``, killing it at the given failure times.

    ``failures`` yields seconds after the first process's ``ready`` record (the start of
    training); a failure due after the last step was logged is not delivered. Each kill and
    each start is appended to the log (``kill`` and ``spawn`` records).

    Raises:
      RuntimeError: the job exited with an error of its own, or ran past ``timeout_s``.
    """
    stderr = log.with_suffix(".stderr")
    tail = LogTail(log, n_steps)
    deadline = time.monotonic() + timeout_s

    def spawn() -> subprocess.Popen:
        append(log, {"event": "spawn", "t": time.monotonic()})
        with stderr.open("a") as err:
            # A session of its own: the kill takes the job's whole process group, as a node
            # failure would.
            return subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env
            )

    def kill(proc: subprocess.Popen) -> float:
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return t

    def wait(proc: subprocess.Popen, until: float) -> bool:
        """Waits until ``until``; False if the process ended first (raises on an error)."""
        try:
            proc.wait(timeout=max(0.0, min(until, deadline) - time.monotonic()))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                kill(proc)
                raise RuntimeError(f"chaos_job ran past {timeout_s:.0f} s: {log}") from None
            return True
        if proc.returncode != 0:
            text = stderr.read_text()[-3000:] if stderr.exists() else ""
            raise RuntimeError(f"chaos_job exited with {proc.returncode}: {cmd}\n{text}")
        return False

    proc = spawn()
    try:
        while tail.ready is None:  # the failure clock starts with training
            if not wait(proc, time.monotonic() + 0.02):
                return
            tail.update()
        for offset in failures:
            if not wait(proc, tail.ready + offset):
                return
            tail.update()
            if tail.trained:  # nothing left to destroy
                break
            append(log, {"event": "kill", "t": kill(proc)})
            proc = spawn()
        wait(proc, deadline)
    finally:
        if proc.poll() is None:  # interrupted (e.g. Ctrl-C): leave no job running
            kill(proc)


# -- reading a run -----------------------------------------------------------------------------


@dataclass
class Attempt:
    """One process of a run, as its log tells it."""

    spawn: float
    ready: float | None = None  # when it started training
    phases: dict[str, float] = field(default_factory=dict)  # when each phase of its start ended
    restored: int = 0
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (step, t, loss)
    saves: list[tuple[int, float, float]] = field(default_factory=list)  # (step, t0, t1)
    commits: dict[int, float] = field(default_factory=dict)  # step: when its save committed
    kill: float | None = None
    digest: str | None = None
    state_mib: float = math.nan

    def stalls(self, t0: float, t1: float) -> float:
        """Seconds its saves that began in ``[t0, t1)`` blocked."""
        return sum(b - a for _, a, b in self.saves if t0 <= a < t1)


def read_log(path: Path) -> list[Attempt]:
    attempts: list[Attempt] = []
    for r in records(path.read_text().splitlines()):
        event = r.get("event")
        if event == "spawn":
            attempts.append(Attempt(spawn=r["t"]))
        elif event == "ready":
            att = attempts[-1]
            att.ready, att.restored = r["t"], r["restored"] or 0
            att.state_mib = r.get("state_mib", math.nan)
            att.phases = {
                k: r[k] for k in ("imports", "open", "restore", "init", "compile") if k in r
            }
        elif event == "save":
            attempts[-1].saves.append((r["step"], r["t0"], r["t1"]))
        elif event == "commit":
            attempts[-1].commits[r["step"]] = r["t"]
        elif event == "kill":
            attempts[-1].kill = r["t"]
        elif event == "done":
            attempts[-1].digest = r["digest"]
        elif "step" in r:
            attempts[-1].steps.append((r["step"], r["t"], r["loss"]))
    return attempts


PHASES = ("start", "open", "restore or init", "compile", "first step")  # of a restart, in order


def warm_up(attempts: list[Attempt]) -> list[Attempt]:
    """The attempts, each restart's start of training moved past its first step's warm-up.

    The first step after a restart is the compiled program's first run on arrays just read
    back: it took 0.3-0.6 s against 20-60 ms for the others on the 2-core machine. The excess
    over a typical step is recovery (as in the manager's own recovery time, which ends with the
    first step after a restore), not training: as training it would be recomputed work
    that the simulator, which sees a constant step time, cannot predict.
    """
    typical = statistics.median(
        b - a for att in attempts for (_, a, _), (_, b, _) in itertools.pairwise(att.steps)
    )
    out = attempts[:1]  # the first start is a fresh start, as in the failure-free runs
    for att in attempts[1:]:
        if att.ready is not None and att.steps:
            extra = max(0.0, att.steps[0][1] - att.ready - typical)
            att = replace(att, ready=att.ready + extra)
        out.append(att)
    return out


@dataclass
class Measured:
    """What one run did (seconds)."""

    wall_s: float
    failure_times: list[float]  # since the start of training, the failures that struck
    save_steps: list[int]  # every save started before the end (replays included)
    save_times: list[float]  # when each began, since the start of training
    stall_s: float
    recompute_s: float
    uncommitted_s: float  # of recompute_s: lost because a save had not committed
    recompute_weighted_s: float
    recovery_s: float
    restarts: list[dict[str, float]]  # each completed recovery's phases (PHASES)
    lost_saves: int  # saves a failure destroyed before they were committed
    commit_s: float  # median time from the end of a save's stall to its commit (0: none seen)
    step_time_s: float  # mean, stalls excluded
    losses: np.ndarray  # loss of each step, from the process that finished it last
    curves: list[np.ndarray]  # per process: (seconds since the start of training, loss) rows
    down: list[tuple[float, float]]  # each recovery, from the kill to the start of training
    digest: str | None
    state_mib: float

    @property
    def recoveries(self) -> list[float]:
        return [sum(r.values()) for r in self.restarts]


def measure(attempts: list[Attempt], n_steps: int, weights: np.ndarray | None) -> Measured:
    """The wall time of a run and its split into stall, recomputed work and recovery."""
    w = np.ones(n_steps) if weights is None else weights
    attempts = warm_up(attempts)
    origin = attempts[0].ready
    end = next(t for att in attempts for s, t, _ in att.steps if s == n_steps)
    recovery = lost = lost_w = uncommitted = 0.0
    restarts, down, lost_saves = [], [], 0
    for prev_att, att in itertools.pairwise(attempts):
        if prev_att.kill >= end:
            break  # a failure after the last step: nothing to recover
        # A restart: from the kill to the start of training, or to the next kill.
        recovery += (att.ready or att.kill) - prev_att.kill
        down.append((prev_att.kill - origin, (att.ready or att.kill) - origin))
        if att.ready is not None:
            ph = att.phases
            marks = [prev_att.kill, ph["imports"], ph["open"], ph.get("restore", ph.get("init")),
                     ph["compile"], att.ready]  # fmt: skip
            restarts.append(
                {k: b - a for k, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True)}
            )
    for i, att in enumerate(attempts):
        if att.kill is None or att.ready is None or att.kill >= end:
            continue
        # The step the next training process resumed from: the work after it is lost.
        resumed = next(a.restored for a in attempts[i + 1 :] if a.ready is not None)
        lost_saves += sum(s > resumed for s, _, _ in att.saves)
        kept = [t for s, t, _ in att.steps if s <= resumed]
        prev = kept[-1] if kept else att.ready
        next_step, before = resumed + 1, lost
        for s, t, _ in att.steps:
            if s > resumed:
                d = t - prev - att.stalls(prev, t)
                lost, lost_w = lost + d, lost_w + w[s - 1] * d
                prev, next_step = t, s + 1
        partial = att.kill - prev - att.stalls(prev, att.kill)
        lost += partial
        lost_w += w[min(next_step, n_steps) - 1] * partial
        # A save whose stall had ended but which had not committed: a model in which a save is
        # safe once its stall ends (the simulator's) loses only the work after that stall.
        unsafe = [b for s, _, b in att.saves if s > resumed and b <= att.kill]
        if unsafe:
            safe_from = max(unsafe)
            uncommitted += (lost - before) - (
                att.kill - safe_from - att.stalls(safe_from, att.kill)
            )
    durations, losses, curves = [], np.full(n_steps, np.nan), []
    for att in attempts:
        prev = att.ready
        for s, t, loss in att.steps:
            durations.append(t - prev - att.stalls(prev, t))
            prev = t
            losses[s - 1] = loss
        curves.append(np.array([(t - origin, loss) for _, t, loss in att.steps]).reshape(-1, 2))
    saves = [(s, a, b) for att in attempts for s, a, b in att.saves if a < end]
    commits = [att.commits[s] - b for att in attempts for s, _, b in att.saves if s in att.commits]
    return Measured(
        wall_s=end - origin,
        failure_times=[a.kill - origin for a in attempts if a.kill is not None and a.kill < end],
        save_steps=sorted({s for s, _, _ in saves}),
        save_times=[a - origin for _, a, _ in saves],
        stall_s=sum(b - a for _, a, b in saves),
        recompute_s=lost,
        uncommitted_s=uncommitted,
        recompute_weighted_s=lost_w,
        recovery_s=recovery,
        restarts=restarts,
        lost_saves=lost_saves,
        commit_s=statistics.median(commits) if commits else 0.0,
        step_time_s=statistics.fmean(durations),
        losses=losses,
        curves=curves,
        down=down,
        digest=attempts[-1].digest,
        state_mib=attempts[0].state_mib,
    )


@dataclass
class Result:
    config: str
    seed: int
    m: Measured
    overhead_s: float = math.nan
    weighted_s: float = math.nan
    sim_s: float = math.nan  # the simulator's overhead (same baseline as overhead_s)
    sim: cj.sim.SimResult | None = None  # the replay of the run
    # The simulator's expected weighted overhead of the run's schedule under Poisson failures:
    # with the run's own measurements, and with common ones (see `expect`).
    expected_s: float = math.nan
    expected_common_s: float = math.nan
    saves: int = 0
    job: dict = field(default_factory=dict)  # the simulator's view of the run
    work_beyond_s: float = 0.0  # its failure-free time at its own step time, minus the baseline's

    @property
    def direct_s(self) -> float:
        """Stall + recomputed + recovery: the overhead without the rest (machine noise)."""
        return self.m.stall_s + self.m.recompute_s + self.m.recovery_s

    @property
    def direct_weighted_s(self) -> float:
        """``direct_s`` with recomputed seconds weighted: what ``policy_bench`` scores."""
        return self.m.stall_s + self.m.recompute_weighted_s + self.m.recovery_s

    @property
    def rest_s(self) -> float:
        return self.overhead_s - self.direct_s

    @property
    def sim_error(self) -> float:
        return self.sim_s / self.overhead_s - 1.0 if self.overhead_s else math.nan

    @property
    def sim_direct_error(self) -> float:
        """The replay against the measured stall + recomputed + recovery (no machine noise)."""
        return self.sim.wall_overhead_s / self.direct_s - 1.0 if self.direct_s else math.nan


def score(res: Result, baseline_s: float, weights: np.ndarray, n_steps: int) -> None:
    """Fills in the overheads (against ``baseline_s`` of wall time) and the replay of the run."""
    m = res.m
    res.overhead_s = m.wall_s - baseline_s
    res.weighted_s = res.overhead_s - m.recompute_s + m.recompute_weighted_s
    res.saves = len(m.save_times)
    if res.config == "no-failures":
        return
    res.job = dict(
        n_steps=n_steps,
        step_time_s=m.step_time_s,
        checkpoint_cost_s=m.stall_s / res.saves if res.saves else 0.0,
        # A run without failures has no recovery to measure, nor to replay.
        recovery_s=statistics.fmean(m.recoveries) if m.recoveries else 0.0,
        weights=weights,
    )
    # The simulated job's wall time is its work at the run's own step time plus the
    # replayed overhead; its overhead is taken against the same failure-free wall time.
    res.work_beyond_s = n_steps * m.step_time_s - baseline_s
    res.sim = cj.sim.replay(m.save_steps, m.failure_times, commit_s=m.commit_s, **res.job)
    res.sim_s = res.sim.wall_overhead_s + res.work_beyond_s


def expect(results: list[Result], mtbf_s: float, step_time_s: float) -> None:
    """Fills in the simulator's expectations of each run's schedule (see ``Result``).

    ``expected_s`` uses the run's own measurements. ``expected_common_s`` ranks the schedules
    free of the machine's noise: every run at ``step_time_s`` (the failure-free runs' median)
    and the mean recovery time of all runs, each with its own stall per save (what its
    checkpointing costs); no run is charged for a slower step time.
    """
    common = statistics.fmean([x for r in results for x in r.m.recoveries] or [0.0])
    for r in results:
        if r.config == "no-failures":
            continue
        own = {**r.job, "recovery_s": r.job["recovery_s"] if r.m.recoveries else common}
        e = cj.sim.expected_overhead(r.m.save_steps, mtbf_s=mtbf_s, **own)
        r.expected_s = e.weighted_s + r.work_beyond_s
        shared = {**r.job, "recovery_s": common, "step_time_s": step_time_s}
        e = cj.sim.expected_overhead(r.m.save_steps, mtbf_s=mtbf_s, **shared)
        r.expected_common_s = e.weighted_s


# -- the benchmark -----------------------------------------------------------------------------


class Bench:
    """Runs the configurations of the job under the supervisor, each in its own directory."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.every: int | None = args.every  # orbax-fixed's save_interval_steps
        self.cost_prior: float | None = None  # cocijax policies' cost_prior_s (None: default)

    def run(self, config: str, name: str, failures, steps: int = 0, every: int = 0) -> Path:
        """Runs one configuration to the end; returns its log."""
        steps, every = steps or self.args.steps, every or self.every
        log = self.workdir / f"{name}.jsonl"
        ckpt = self.workdir / f"{name}-ckpt"
        cmd = [sys.executable, str(JOB), "--config", config, "--log", str(log),
               "--steps", str(steps), *(TINY_JOB if self.args.tiny else [])]  # fmt: skip
        if config == "orbax-fixed":
            cmd += ["--dir", str(ckpt), "--every", str(every)]
        elif config != "no-failures":
            cmd += ["--dir", str(ckpt), "--mtbf", str(self.args.mtbf)]
            if self.cost_prior is not None:
                cmd += ["--cost-prior", str(self.cost_prior)]
        env = None
        if self.args.compile_cache:
            # Every start after the first of a configuration loads its compiled programs.
            env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(ckpt) + "-jax-cache",
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # fmt: skip
        try:
            supervise(cmd, log, failures, steps, self.args.timeout, env)
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)  # hundreds of MiB per run
            shutil.rmtree(str(ckpt) + "-jax-cache", ignore_errors=True)
        return log

    def calibrate(self) -> tuple[float, float]:
        """The blocking time of an Orbax save and the step time, as a user would measure them.

        A short run saves every ``CALIBRATION["every"]`` steps (far enough apart that no save
        waits for the previous one). Returns ``(save seconds, step seconds)``, medians.
        """
        log = self.run("orbax-fixed", "calibration", iter(()), **CALIBRATION)
        atts = read_log(log)
        # The first save (step 1) also sets Orbax up: the later ones are what a save costs.
        cost = statistics.median(b - a for att in atts for s, a, b in att.saves if s > 1)
        prev, steps = atts[0].ready, []
        for _, t, _ in atts[0].steps:
            steps.append(t - prev - atts[0].stalls(prev, t))
            prev = t
        return cost, statistics.median(steps)


def order(configs: list[str], seed: int) -> list[str]:
    """The configurations rotated by the seed: machine drift hits each at another place."""
    k = seed % len(configs)
    return configs[k:] + configs[:k]


def run_all(args: argparse.Namespace, workdir: Path, console: Console) -> dict:
    """Runs the calibration and every configuration of every seed; returns the setup record."""
    bench = Bench(args, workdir)
    started = time.monotonic()
    cj_configs = set(args.configs) & {"coci", "young", "daly"}
    calibrated = ("orbax-fixed" in args.configs and not args.every) or (
        args.cost_prior == "calibrated" and cj_configs
    )
    cal_cost, cal_tau = bench.calibrate() if calibrated else (math.nan, math.nan)
    if calibrated:
        if not args.every:
            interval = float(cj.policies.young_interval(cal_cost, args.mtbf))
            bench.every = max(1, round(interval / cal_tau))
        if args.cost_prior == "calibrated":
            bench.cost_prior = round(cal_cost, 4)
        console.print(
            f"calibration: an Orbax save blocked {cal_cost * 1e3:.0f} ms, a step took "
            f"{cal_tau * 1e3:.1f} ms (medians); orbax-fixed saves every {bench.every} steps; "
            f"cocijax policies' cost_prior_s: {bench.cost_prior or 'their default'}",
            highlight=False,
        )
    loads = []  # the 1-minute load average at the start and at the end of each run
    for seed in range(args.seeds):
        for config in order(list(args.configs), seed):
            load = os.getloadavg()[0]
            if config == "no-failures":
                draws = iter(())
            else:
                draws = iter(args.fail_at) if args.fail_at else poisson_failures(seed, args.mtbf)
            t0 = time.monotonic()
            log = bench.run(config, f"{config}-seed{seed}", draws)
            kills = sum(a.kill is not None for a in read_log(log))
            loads.append([load, os.getloadavg()[0]])
            console.print(
                f"seed {seed} {config:12s} {time.monotonic() - t0:6.1f} s, {kills} kills, "
                f"load {loads[-1][0]:.1f} to {loads[-1][1]:.1f}",
                highlight=False,
            )
    return dict(
        argv=sys.argv[1:],
        steps=args.steps,
        mtbf=args.mtbf,
        seeds=args.seeds,
        configs=list(args.configs),
        every=bench.every,
        cost_prior=bench.cost_prior,
        compile_cache=args.compile_cache,
        calibration=None if not calibrated else [cal_cost, cal_tau],
        loads=loads,
        disk=filesystem(str(workdir)),
        elapsed_s=time.monotonic() - started,
    )


def analyse(setup: dict, workdir: Path) -> Report:
    """Measures and scores every run whose log is in ``workdir``."""
    results, n = [], setup["steps"]
    logs = {
        (c, seed): read_log(workdir / f"{c}-seed{seed}.jsonl")
        for seed in range(setup["seeds"])
        for c in setup["configs"]
    }
    bases = [measure(logs["no-failures", seed], n, None) for seed in range(setup["seeds"])]
    # The failure-free wall time of the job: the median of its runs, so that one run slowed
    # by a busy machine does not shift every overhead of its seed.
    baseline_s = statistics.median(m.wall_s for m in bases)
    for seed, base in enumerate(bases):
        weights = cj.sim.progress_weights(base.losses, TIME_WEIGHT)
        for config in setup["configs"]:
            res = Result(config, seed, measure(logs[config, seed], n, weights))
            score(res, baseline_s, weights, n)
            results.append(res)
    expect(results, setup["mtbf"], statistics.median(m.step_time_s for m in bases))
    return Report(setup, results)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=160)
    if args.analyse:
        workdir = args.analyse
        setup = json.loads((workdir / SETUP).read_text())
    else:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-bench-"))
        workdir.mkdir(parents=True, exist_ok=True)
        setup = run_all(args, workdir, console)
        (workdir / SETUP).write_text(json.dumps(setup, indent=1) + "\n")
    report = analyse(setup, workdir)
    report.print(console)
    if args.json:
        args.json.write_text(json.dumps({"runs": report.json_runs()}, indent=1) + "\n")
    if args.plot or args.write:
        report.plot(args.plot or DOC_PNG)
    if args.write:
        write_section(SECTION, report.markdown())
    if not (args.workdir or args.analyse):
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


# -- the report --------------------------------------------------------------------------------


class Report:
    """The runs' tables (printed, and written to BENCHMARKS.md), targets, JSON and figure."""

    def __init__(self, setup: dict, results: list[Result]):
        self.setup, self.results = setup, results
        self.configs = [c for c in CONFIGS if c in setup["configs"]]
        self.scored = [r for r in results if r.config != "no-failures"]
        self.state_mib = results[0].m.state_mib
        self.base = {r.seed: r.m for r in results if r.config == "no-failures"}

    def by_config(self) -> dict[str, list[Result]]:
        return {
            c: [r for r in self.scored if r.config == c] for c in self.configs if c != "no-failures"
        }

    def json_runs(self) -> list[dict]:
        num = lambda x: round(x, 3) if math.isfinite(x) else None
        return [
            {
                "config": r.config,
                "seed": r.seed,
                "wall_s": num(r.m.wall_s),
                "failures": len(r.m.failure_times),
                "saves": r.saves,
                "overhead_s": num(r.overhead_s),
                "weighted_overhead_s": num(r.weighted_s),
                "sim_overhead_s": num(r.sim_s),
            }
            for r in self.results
        ]

    def tables(self) -> list[tuple[str, list[str], list[list[str]]]]:
        """``(title, columns, rows)`` of each table."""
        runs = []
        for r in sorted(self.results, key=lambda r: (r.seed, self.configs.index(r.config))):
            m, base = r.m, self.base[r.seed]
            row = [r.config, str(r.seed), f"{m.wall_s:.1f}", str(len(m.failure_times)),
                   str(r.saves), f"{m.step_time_s * 1e3:.1f}"]  # fmt: skip
            if r.config == "no-failures":
                row += ["", "", "", "", "", "", "", "", "", m.digest or "?"]
            else:
                same = m.digest is not None and m.digest == base.digest
                row += [f"{r.overhead_s:.1f}", f"{m.stall_s:.1f}", f"{m.recompute_s:.1f}",
                        f"{m.recovery_s:.1f}", f"{r.rest_s:.1f}", f"{r.weighted_s:.1f}",
                        f"{r.sim_s:.1f}", f"{r.sim_error:+.0%}", f"{r.sim_direct_error:+.0%}",
                        "same" if same else "DIFFERENT"]  # fmt: skip
            runs.append(row)
        mean = lambda xs: statistics.fmean(xs) if xs else math.nan
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0
        summary, costs = [], []
        base_step = statistics.median(m.step_time_s for m in self.base.values())
        for c, rs in self.by_config().items():
            weighted = [r.weighted_s for r in rs]
            direct = [r.direct_weighted_s for r in rs]
            summary.append([
                c, f"{mean([len(r.m.failure_times) for r in rs]):.1f}",
                f"{mean([r.saves for r in rs]):.1f}", f"{mean([r.overhead_s for r in rs]):.1f}",
                f"{mean(weighted):.1f} ± {sd(weighted):.1f}",
                f"{mean(direct):.1f} ± {sd(direct):.1f}",
                f"{mean([r.expected_s for r in rs]):.1f}",
                f"{mean([r.expected_common_s for r in rs]):.1f}",
            ])  # fmt: skip
            restarts = [x for r in rs for x in r.m.restarts]
            saves = sum(r.saves for r in rs)
            slower = mean([r.m.step_time_s / base_step - 1.0 for r in rs])
            costs.append([
                c, str(len(restarts)), f"{mean([sum(x.values()) for x in restarts]):.1f}",
                *(f"{mean([x[k] for x in restarts]):.2f}" for k in PHASES),
                f"{sum(r.m.stall_s for r in rs) / saves:.2f}" if saves else "",
                f"{mean([r.m.commit_s for r in rs]):.2f}",
                f"{slower:+.0%}", str(sum(r.m.lost_saves for r in rs)),
            ])  # fmt: skip
        return [
            (
                f"runs: {self.setup['steps']} steps, MTBF {self.setup['mtbf']:g} s",
                ["config", "seed", "wall s", "failures", "saves", "step ms", "overhead s",
                 "stall s", "recomputed s", "recovery s", "rest s", "weighted s", "sim s",
                 "sim err", "sim err, no rest", "params"],
                runs,
            ),
            (
                "mean over seeds",
                ["config", "failures", "saves", "overhead s", "weighted s (± sd)",
                 "weighted, no rest s (± sd)", "expected weighted s",
                 "expected, common costs s"],
                summary,
            ),
            (
                "what a failure and a save cost (means over the runs)",
                ["config", "restarts", "recovery s", *(f"{k} s" for k in PHASES),
                 "stall per save s", "then commit s", "step time vs failure-free",
                 "saves lost uncommitted"],
                costs,
            ),
            (
                "the replay against each run (run / replay)",
                ["config", "seed", "failures", "stall s", "recomputed s",
                 "of which after an uncommitted save s", "recovery s"],
                [[r.config, str(r.seed), f"{len(r.m.failure_times)} / {r.sim.failures:.0f}",
                  f"{r.m.stall_s:.1f} / {r.sim.stall_s:.1f}",
                  f"{r.m.recompute_s:.1f} / {r.sim.recompute_s:.1f}", f"{r.m.uncommitted_s:.1f}",
                  f"{r.m.recovery_s:.1f} / {r.sim.recovery_s:.1f}"] for r in self.scored],
            ),
            ("targets", ["target", "measured", "status"], [list(t) for t in self.targets()]),
        ]  # fmt: skip

    def targets(self) -> list[tuple[str, str, str]]:
        rows = []
        by = self.by_config()
        for key, what in (("weighted_s", "weighted overhead"),
                          ("direct_weighted_s", "weighted overhead without the rest")):  # fmt: skip
            mean = {c: statistics.fmean(getattr(r, key) for r in rs) for c, rs in by.items() if rs}
            others = [c for c in mean if c != "coci"]
            if "coci" not in mean or not others:
                break
            best = min(others, key=mean.get)
            run = {(r.config, r.seed): getattr(r, key) for r in self.scored}
            # Per seed (common failure times): coci's reduction against the best other config.
            cut = [1.0 - run["coci", s] / run[best, s] for s in sorted(self.base)
                   if run[best, s] > 0]  # fmt: skip
            spread = f"per seed {', '.join(f'{x:+.0%}' for x in cut)}"
            if len(cut) > 1:
                spread += f"; mean {statistics.fmean(cut):+.0%} ± {statistics.stdev(cut):.0%}"
            reduction = f"{1.0 - mean['coci'] / mean[best]:+.0%}" if mean[best] > 0 else "n/a"
            rows.append((
                f"coci's mean {what} below every other configuration's",
                f"coci {mean['coci']:.1f} s, best other {best} {mean[best]:.1f} s: reduction "
                f"{reduction} ({spread})",
                "met" if all(mean["coci"] < mean[c] for c in others) else "NOT met",
            ))  # fmt: skip
        if self.scored:
            for key, what in (("sim_error", "overhead"),
                              ("sim_direct_error", "stall + recomputed + recovery")):  # fmt: skip
                err = [getattr(r, key) for r in self.scored]
                within = sum(abs(e) <= SIM_TOLERANCE for e in err)
                e, worst = max(zip(err, self.scored, strict=True), key=lambda x: abs(x[0]))
                rows.append((
                    f"simulator within {SIM_TOLERANCE:.0%} of the measured {what}, every run",
                    f"{within} of {len(err)} runs; worst {e:+.0%} ({worst.config}, seed "
                    f"{worst.seed})",
                    "met" if within == len(err) else "NOT met",
                ))  # fmt: skip
            same = [r for r in self.scored if r.m.digest and r.m.digest == self.base[r.seed].digest]
            rows.append((
                "final parameters equal the uninterrupted run's",
                f"{len(same)} of {len(self.scored)} runs",
                "met" if len(same) == len(self.scored) else "NOT met",
            ))  # fmt: skip
        return rows

    def describe(self) -> str:
        """The parameters of the benchmark, and how noisy the machine was."""
        su, base = self.setup, list(self.base.values())
        cal = "no calibration run"
        if su["calibration"]:
            cost, tau = su["calibration"]
            cal = (f"a calibration run's Orbax save blocked {cost * 1e3:.0f} ms (median, step "
                   f"{tau * 1e3:.1f} ms)")  # fmt: skip
        prior = su["cost_prior"] if su["cost_prior"] is not None else "default"
        cache = "compiled programs cached" if su["compile_cache"] else "no compilation cache"
        # Older work directories kept one reading per run (its start).
        loads = [x for pair in su["loads"] for x in (pair if isinstance(pair, list) else [pair])]
        return (
            f"{su['steps']} steps, MTBF {su['mtbf']:g} s, {su['seeds']} seed(s); {cal}; "
            f"orbax-fixed saves every {su['every']} steps; cocijax policies' cost_prior_s "
            f"{prior}; {cache}. Noise: 1-minute load average at the start and end of each run "
            f"{min(loads):.1f} to {max(loads):.1f}, median {statistics.median(loads):.1f} "
            f"(2 cores, shared with other jobs); failure-free runs: mean step "
            f"{min(m.step_time_s for m in base) * 1e3:.1f} to "
            f"{max(m.step_time_s for m in base) * 1e3:.1f} ms, wall "
            f"{min(m.wall_s for m in base):.1f} to {max(m.wall_s for m in base):.1f} s; "
            f"{su['elapsed_s'] / 60:.1f} min in all"
        )

    def findings(self) -> list[str]:
        """What the tables say about noise, recovery and the replay, computed from them."""
        out, by = [], self.by_config()
        steps = [r.m.step_time_s * 1e3 for r in self.results]
        out.append(
            f"Machine noise: the mean step time of the runs ranged from {min(steps):.0f} to "
            f"{max(steps):.0f} ms (same job, same steps), the failure-free wall time from "
            f"{min(m.wall_s for m in self.base.values()):.0f} to "
            f"{max(m.wall_s for m in self.base.values()):.0f} s."
        )
        rec = {c: [x for r in rs for x in r.m.restarts] for c, rs in by.items()}
        if all(rec.values()):
            part = lambda c, k: statistics.fmean(x[k] for x in rec[c])
            each = [f"{c} {sum(part(c, k) for k in PHASES):.1f} s, compile "
                    f"{part(c, 'compile'):.1f} s" for c in rec]  # fmt: skip
            out.append(
                "Mean restart (kill to training) and its compile phase (the training step's "
                "compilation, and the policy update's, which the manager compiles meanwhile): "
                f"{'; '.join(each)}."
            )
        if self.scored:
            drift = [r for r in self.scored if round(r.sim.failures) != len(r.m.failure_times)]
            lost = sum(r.m.recompute_s for r in self.scored)
            unsafe = sum(r.m.uncommitted_s for r in self.scored)
            diff = lambda f: sum(abs(f(r)) for r in self.scored)
            out.append(
                f"Replay against runs, summed over the {len(self.scored)} runs: |recomputed "
                f"difference| {diff(lambda r: r.m.recompute_s - r.sim.recompute_s):.0f} s, "
                f"|recovery difference| {diff(lambda r: r.m.recovery_s - r.sim.recovery_s):.0f}"
                f" s, |stall difference| {diff(lambda r: r.m.stall_s - r.sim.stall_s):.0f} s. "
                f"{len(drift)} replays met another number of failures than their run (the "
                "replayed job, at mean step and recovery times, was elsewhere when they came). "
                f"{unsafe:.0f} s of the {lost:.0f} s recomputed were lost because the newest "
                "save had not committed yet (the replay models it with each run's median "
                "commit time; the expectations below count a save as safe when its stall ends)."
            )
            exp = {c: statistics.fmean(r.expected_common_s for r in rs) for c, rs in by.items()}
            meas = {c: statistics.fmean(r.weighted_s for r in rs) for c, rs in by.items()}
            order = lambda d: " < ".join(sorted(d, key=d.get))
            out.append(
                "Ranking by the simulator's expected weighted overhead of each run's schedule "
                f"(common step and recovery times, each its own stall per save): {order(exp)}; "
                f"by the measured weighted overhead: {order(meas)}."
            )
            cj_runs = [r for r in self.scored if r.config != "orbax-fixed" and r.saves]
            if cj_runs:
                out.append(
                    "The exact optimum in hindsight (`cj.sim.optimal_schedule` of each seed's "
                    "weights) at the same common costs and the cocijax runs' mean stall per "
                    f"save: {statistics.fmean(self.optimum(cj_runs)):.1f} s expected, the mean "
                    "over seeds."
                )
        return out

    def optimum(self, runs: list[Result]) -> list[float]:
        """The expected weighted overhead of each seed's optimal schedule at common costs."""
        costs = dict(
            step_time_s=statistics.median(m.step_time_s for m in self.base.values()),
            checkpoint_cost_s=sum(r.m.stall_s for r in runs) / sum(r.saves for r in runs),
            recovery_s=statistics.fmean(x for r in self.scored for x in r.m.recoveries),
            mtbf_s=self.setup["mtbf"],
        )
        out = []
        for seed in sorted({r.seed for r in runs}):
            weights = next(r.job["weights"] for r in runs if r.seed == seed)
            best = cj.sim.optimal_schedule(weights, **costs)
            e = cj.sim.expected_overhead(best, n_steps=len(weights), weights=weights, **costs)
            out.append(e.weighted_s)
        return out

    def print(self, console: Console) -> None:
        for title, columns, rows in self.tables():
            table = Table(title=title)
            for i, col in enumerate(columns):
                table.add_column(col, justify="left" if i == 0 else "right")
            for row in rows:
                table.add_row(*row)
            console.print(table)
        console.print(self.describe(), highlight=False)
        for line in self.findings():
            console.print(f"- {line}", highlight=False)

    def command(self) -> list[str]:
        """The run's options, without where its files went (machine paths stay out of docs)."""
        out, args = [], iter(self.setup["argv"])
        for a in args:
            if a in ("--workdir", "--json", "--plot"):
                next(args, None)
            elif a.split("=")[0] not in ("--workdir", "--json", "--plot", "--write"):
                out.append(a)
        return out

    def markdown(self) -> str:
        lines = [
            "## Live chaos benchmark (`benchmarks/chaos_bench.py`)",
            "",
            f"Machine: {cpu_and_ram()}; work directory on {self.setup.get('disk', '?')}; "
            f"{datetime.date.today().isoformat()}; Python "
            f"{platform.python_version()}. Command: "
            f"`{' '.join(['python', 'benchmarks/chaos_bench.py', *self.command()])}`.",
            "",
            f"{self.describe()}.",
            "",
            "The job (`benchmarks/chaos_job.py`): a character model of Python's own sources "
            f"(hashed n-gram embeddings and a Flax MLP; {self.state_mib:.0f} MiB of parameters "
            "and Adam moments). Failures: SIGKILL at seeded Poisson times, the same for every "
            "configuration of a seed, and a restart at once. Overhead: wall time minus the "
            "median failure-free wall time; rest = overhead - stall - recomputed - recovery "
            "(steps slower than in the failure-free runs). Weighted: recomputed seconds "
            f"weighted by hindsight progress (time_weight {TIME_WEIGHT}). sim: `cj.sim.replay` "
            "of the run (its saves and failures, its mean step time, stall per save and "
            "recovery time); expected: `cj.sim.expected_overhead` of the run's schedule with "
            "the same measurements.",
        ]
        for title, columns, rows in self.tables():
            lines += ["", f"{title[0].upper()}{title[1:]}:", "", "| " + " | ".join(columns) + " |",
                      "|" + "---|" * len(columns)]  # fmt: skip
            lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["", "Findings (computed from the tables):", ""]
        lines += [f"- {line}" for line in self.findings()]
        lines += ["", "![chaos benchmark](docs/chaos_bench.png)"]
        return "\n".join(lines)

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        seed = min(self.base)
        runs = [r for c in self.configs for r in self.results if r.config == c and r.seed == seed]
        fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.6), sharex=True,
                                 sharey=True, squeeze=False)  # fmt: skip
        top = max(float(np.nanmax(c[:, 1])) for r in runs for c in r.m.curves if c.size)
        for ax, r in zip(axes[:, 0], runs, strict=True):
            for t, loss in (c.T for c in r.m.curves if c.size):
                ax.plot(t, loss, ".", ms=1.0, color="0.7")
                k = 25  # a moving average over 25 steps of one process, for the eye
                if loss.size > k:
                    ax.plot(t[k - 1 :], np.convolve(loss, np.ones(k) / k, "valid"), lw=1.0,
                            color="C0")  # fmt: skip
            for a, b in r.m.down:
                ax.axvspan(a, b, color="C3", alpha=0.15, lw=0)
            for x in r.m.failure_times:
                ax.axvline(x, color="C3", lw=1.2)
            ax.plot(r.m.save_times, np.full(len(r.m.save_times), top), "|", color="C2", ms=8)
            label = r.config if r.config == "no-failures" else (
                f"{r.config}: {len(r.m.failure_times)} failures, {r.saves} saves, "
                f"overhead {r.overhead_s:.0f} s (weighted {r.weighted_s:.0f} s)"
            )  # fmt: skip
            ax.set_title(label, fontsize=9, loc="left")
            ax.set_ylabel("loss")
        axes[-1, 0].set_xlabel(
            "seconds since training started (red: failures and recoveries, green: saves)"
        )
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed of a short job")
    p.add_argument("--seeds", type=int, help=f"failure seeds (default {FULL['seeds']})")
    p.add_argument("--steps", type=int, help=f"training steps (default {FULL['steps']})")
    p.add_argument("--mtbf", type=float, help=f"MTBF in seconds (default {FULL['mtbf']:g})")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--fail-at", type=float, nargs="+", metavar="S",
                   help="failure times (seconds of each run) instead of Poisson draws")  # fmt: skip
    p.add_argument("--every", type=int, help="orbax-fixed's interval (default: calibrated)")
    p.add_argument(
        "--cost-prior",
        choices=("calibrated", "default"),
        default="calibrated",
        help="cocijax policies' cost_prior_s: the calibrated Orbax save cost (the knowledge "
        "orbax-fixed gets) or the policies' default",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model, to test the machinery")
    p.add_argument("--compile-cache", action="store_true",
                   help="restarts load compiled programs from JAX's persistent cache (one per "
                   "run) instead of compiling them")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run at most")
    p.add_argument("--workdir", type=Path, help="keep the logs here (default: a temp dir)")
    p.add_argument("--analyse", type=Path, metavar="DIR",
                   help="report on the logs kept by --workdir DIR; run nothing")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the runs as JSON here")
    p.add_argument("--plot", type=Path, help="draw the figure here (--write: docs/)")
    p.add_argument("--write", action="store_true", help="record the results in BENCHMARKS.md")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if "no-failures" not in args.configs:
        p.error("--configs must include no-failures (the baseline of every overhead)")
    if args.seeds < 1 or args.steps < 2 or not args.mtbf > 0:
        p.error("--seeds >= 1, --steps >= 2 and a positive --mtbf are needed")
    if args.fail_at and (any(t < 0 for t in args.fail_at) or args.fail_at != sorted(args.fail_at)):
        p.error(f"--fail-at must be non-negative increasing seconds, got {args.fail_at}")
    return args


if __name__ == "__main__":
    sys.exit(main())
