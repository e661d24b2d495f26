"""The live chaos benchmark: real training, real failures, policies compared in wall-clock time.

A supervisor starts the training job of ``benchmarks/chaos_job.py`` (a Flax model with about
390 MiB of parameters and Adam moments), SIGKILLs it (the whole process group, as a node
failure would) at failure times drawn from a seeded Poisson process, and starts it again at
once, until the planned steps are done. Recovery is real: a new process, imports, restore and
compilation. Each seed draws one sequence of failure times, which every configuration gets
(common random numbers); the clock starts when the first process begins training, so a
failure lands at the same training progress in every configuration as nearly as the machine
allows.

Configurations: ``coci``, ``young`` and ``daly`` through ``cj.CheckpointManager`` (given the
MTBF; step time, save cost and recovery time measured by the manager), ``orbax-fixed``
(Orbax's own ``ocp.CheckpointManager`` with ``save_interval_steps`` set to Young's interval
from the save cost measured in a calibration run, as a user would set it) and ``no-failures``
(no checkpoints, no failures: the baseline of each seed).

Measured per run, from the job's log (every step's loss and end time, every save's blocking
interval) and the supervisor's kill times:

* **wall**: from the start of training to the end of the last step; **overhead** = wall minus
  the failure-free run's of the same seed;
* its split: **stall** (time ``save`` blocked), **recomputed** (work lost at each failure: from
  the end of the step the next process resumed from, or from the start of training of the
  killed process if none of its steps survived, to the kill, minus stalls), **recovery** (from
  each kill to the next process's start of training; the whole life of a process killed before
  it started training), and the **rest** (steps slower than in the failure-free run: background
  writes competing for the two cores, and machine noise);
* **weighted overhead**: the overhead with each recomputed second weighted by the hindsight
  progress weight of its step (:func:`cocijax.sim.progress_weights` of the failure-free run's
  loss curve, ``time_weight`` 0.25, as ``benchmarks/policy_bench.py`` scores policies);
* **simulated**: :func:`cocijax.sim.replay` of the run: its save steps, its failure times, its
  median step time, its mean stall per save and its mean recovery time.

Run (under the benchmark lock on a shared machine)::

    python benchmarks/chaos_bench.py [--quick] [--seeds 3] [--json PATH] [--write]

``--quick`` runs one seed of a short job (a few minutes); ``--json`` writes the runs;
``--write`` records the table, the machine and the figure (``docs/chaos_bench.png``) in
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from _report import cpu_and_ram, write_section
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
FULL = dict(seeds=3, steps=3000, mtbf=30.0)
QUICK = dict(seeds=1, steps=1000, mtbf=20.0)
TINY_JOB = ["--buckets", "4096", "--dim", "8", "--hidden", "32", "--batch", "64"]
CALIBRATION = dict(steps=400, every=100)  # the Orbax save cost a user would measure


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
    with log.open("a") as f:
        f.write(json.dumps(record) + "\n")


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
        for line in data[:end].splitlines():
            r = json.loads(line)
            if r.get("event") == "ready" and self.ready is None:
                self.ready = r["t"]
            self.trained = self.trained or r.get("step") == self.n_steps


def supervise(cmd: list[str], log: Path, failures, n_steps: int, timeout_s: float) -> None:
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
                cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
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


# -- reading a run -----------------------------------------------------------------------------


@dataclass
class Attempt:
    """One process of a run, as its log tells it."""

    spawn: float
    ready: float | None = None
    restored: int = 0
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (step, t, loss)
    saves: list[tuple[int, float, float]] = field(default_factory=list)  # (step, t0, t1)
    kill: float | None = None
    digest: str | None = None


def read_log(path: Path) -> list[Attempt]:
    attempts: list[Attempt] = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        event = r.get("event")
        if event == "spawn":
            attempts.append(Attempt(spawn=r["t"]))
        elif event == "ready":
            attempts[-1].ready, attempts[-1].restored = r["t"], r["restored"] or 0
        elif event == "save":
            attempts[-1].saves.append((r["step"], r["t0"], r["t1"]))
        elif event == "kill":
            attempts[-1].kill = r["t"]
        elif event == "done":
            attempts[-1].digest = r["digest"]
        elif "step" in r:
            attempts[-1].steps.append((r["step"], r["t"], r["loss"]))
    return attempts


@dataclass
class Measured:
    """What one run did (seconds)."""

    wall_s: float
    failure_times: list[float]  # since the start of training, the failures that struck
    save_steps: list[int]  # every save started before the end (replays included)
    stall_s: float
    recompute_s: float
    recompute_weighted_s: float
    recovery_s: float
    recoveries: list[float]  # each completed recovery (kill to the start of training)
    step_time_s: float  # mean, stalls excluded
    losses: np.ndarray  # loss of each step, from the process that finished it last
    digest: str | None
    curve: list[tuple[float, float]]  # (seconds since the start of training, loss)
    kills: list[float]
    save_times: list[float]


def stalls_between(att: Attempt, t0: float, t1: float) -> float:
    return sum(b - a for _, a, b in att.saves if t0 <= a < t1)


def measure(attempts: list[Attempt], n_steps: int, weights: np.ndarray | None) -> Measured:
    """The wall time of a run and its split into stall, recomputed work and recovery."""
    w = np.ones(n_steps) if weights is None else weights
    origin = attempts[0].ready
    end = next(t for att in attempts for s, t, _ in att.steps if s == n_steps)
    kills = [a.kill for a in attempts if a.kill is not None and a.kill < end]
    stall = sum(b - a for att in attempts for _, a, b in att.saves if a < end)
    recovery, recoveries = 0.0, []
    lost = lost_w = 0.0
    for i, att in enumerate(attempts):
        if i > 0 and attempts[i - 1].kill is not None:
            began = att.ready if att.ready is not None else att.kill
            recovery += began - attempts[i - 1].kill
            if att.ready is not None:
                recoveries.append(att.ready - attempts[i - 1].kill)
        if att.kill is None or att.ready is None or att.kill >= end:
            continue
        # The step the next training process resumed from: work after it is lost.
        resumed = next(a.restored for a in attempts[i + 1 :] if a.ready is not None)
        kept = [t for s, t, _ in att.steps if s <= resumed]
        prev = kept[-1] if kept else att.ready
        next_step = resumed + 1
        for s, t, _ in att.steps:
            if s > resumed:
                d = t - prev - stalls_between(att, prev, t)
                lost, lost_w = lost + d, lost_w + w[s - 1] * d
                prev, next_step = t, s + 1
        partial = att.kill - prev - stalls_between(att, prev, att.kill)
        lost += partial
        lost_w += w[min(next_step, n_steps) - 1] * partial
    durations, losses, curve = [], np.full(n_steps, np.nan), []
    for att in attempts:
        prev = att.ready
        for s, t, loss in att.steps:
            durations.append(t - prev - stalls_between(att, prev, t))
            prev = t
            losses[s - 1] = loss
            curve.append((t - origin, loss))
    return Measured(
        wall_s=end - origin,
        failure_times=[k - origin for k in kills],
        save_steps=sorted({s for att in attempts for s, a, _ in att.saves if a < end}),
        stall_s=stall,
        recompute_s=lost,
        recompute_weighted_s=lost_w,
        recovery_s=recovery,
        recoveries=recoveries,
        step_time_s=statistics.fmean(durations),
        losses=losses,
        digest=attempts[-1].digest,
        curve=curve,
        kills=[k - origin for k in kills],
        save_times=[a - origin for att in attempts for _, a, _ in att.saves if a < end],
    )


@dataclass
class Result:
    config: str
    seed: int
    m: Measured
    overhead_s: float = math.nan
    weighted_s: float = math.nan
    sim_s: float = math.nan  # the simulator's overhead (same baseline as overhead_s)
    sim_weighted_s: float = math.nan
    saves: int = 0

    @property
    def rest_s(self) -> float:
        return self.overhead_s - self.m.stall_s - self.m.recompute_s - self.m.recovery_s

    @property
    def sim_error(self) -> float:
        return self.sim_s / self.overhead_s - 1.0 if self.overhead_s else math.nan


def score(res: Result, baseline: Measured, weights: np.ndarray, n_steps: int) -> None:
    """Fills in the overheads and the simulator's replay of the run."""
    m = res.m
    res.overhead_s = m.wall_s - baseline.wall_s
    res.weighted_s = res.overhead_s - m.recompute_s + m.recompute_weighted_s
    res.saves = len(m.save_times)
    if res.config == "no-failures":
        return
    sim = cj.sim.replay(
        m.save_steps,
        m.failure_times,
        n_steps=n_steps,
        step_time_s=m.step_time_s,
        checkpoint_cost_s=m.stall_s / res.saves if res.saves else 0.0,
        recovery_s=statistics.fmean(m.recoveries) if m.recoveries else 0.0,
        weights=weights,
    )
    # The simulated job's wall time is its work at the run's own step time plus the
    # replayed overhead; its overhead is taken against the same failure-free run.
    work_beyond = n_steps * m.step_time_s - baseline.wall_s
    res.sim_s = sim.wall_overhead_s + work_beyond
    res.sim_weighted_s = sim.weighted_overhead_s + work_beyond


# -- the benchmark -----------------------------------------------------------------------------


class Bench:
    """Runs the configurations of the job under the supervisor, each in its own directory."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.every: int | None = args.every  # orbax-fixed's save_interval_steps
        self.cost_prior: float | None = None  # cocijax policies' cost_prior_s (None: default)

    def run(self, config: str, name: str, failures, steps: int | None = None) -> Path:
        """Runs one configuration to the end; returns its log."""
        steps = steps or self.args.steps
        log = self.workdir / f"{name}.jsonl"
        ckpt = self.workdir / f"{name}-ckpt"
        cmd = [sys.executable, str(JOB), "--config", config, "--log", str(log),
               "--steps", str(steps), *(TINY_JOB if self.args.tiny else [])]  # fmt: skip
        if config == "orbax-fixed":
            cmd += ["--dir", str(ckpt), "--every", str(self.every)]
        elif config != "no-failures":
            cmd += ["--dir", str(ckpt), "--mtbf", str(self.args.mtbf)]
            if self.cost_prior is not None:
                cmd += ["--cost-prior", str(self.cost_prior)]
        try:
            supervise(cmd, log, failures, steps, self.args.timeout)
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)  # hundreds of MiB per run
        return log

    def calibrate(self) -> tuple[float, float]:
        """The blocking time of an Orbax save and the step time, as a user would measure them.

        A short run saves every ``CALIBRATION["every"]`` steps (far enough apart that no save
        waits for the previous one). Returns ``(save seconds, step seconds)``, medians.
        """
        self.every = CALIBRATION["every"]
        try:
            log = self.run("orbax-fixed", "calibration", iter(()), CALIBRATION["steps"])
        finally:
            self.every = self.args.every
        atts = read_log(log)
        # The first save (step 1) also sets Orbax up: the later ones are what a save costs.
        cost = statistics.median(b - a for att in atts for s, a, b in att.saves if s > 1)
        prev, steps = atts[0].ready, []
        for _, t, _ in atts[0].steps:
            steps.append(t - prev - stalls_between(atts[0], prev, t))
            prev = t
        return cost, statistics.median(steps)


def order(configs: list[str], seed: int) -> list[str]:
    """The configurations rotated by the seed: machine drift hits each at another place."""
    k = seed % len(configs)
    return configs[k:] + configs[:k]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=160)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
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
    results: list[Result] = []
    loads = []
    for seed in range(args.seeds):
        logs = {}
        for config in order(list(args.configs), seed):
            loads.append(os.getloadavg()[0])
            if config == "no-failures":
                draws = iter(())
            else:
                draws = iter(args.fail_at) if args.fail_at else poisson_failures(seed, args.mtbf)
            t0 = time.monotonic()
            logs[config] = bench.run(config, f"{config}-seed{seed}", draws)
            kills = sum(a.kill is not None for a in read_log(logs[config]))
            console.print(
                f"seed {seed} {config:12s} {time.monotonic() - t0:6.1f} s, {kills} kills, "
                f"load {loads[-1]:.1f}",
                highlight=False,
            )
        base = measure(read_log(logs["no-failures"]), args.steps, None)
        weights = cj.sim.progress_weights(base.losses, TIME_WEIGHT)
        for config in args.configs:
            res = Result(config, seed, measure(read_log(logs[config]), args.steps, weights))
            score(res, base, weights, args.steps)
            results.append(res)
    elapsed = time.monotonic() - started
    report = Report(args, results, bench, cal_cost, cal_tau, loads, elapsed)
    report.print(console)
    if args.json:
        args.json.write_text(json.dumps({"runs": report.json_runs()}, indent=1) + "\n")
    if args.plot or args.write:
        report.plot(args.plot or DOC_PNG)
    if args.write:
        write_section(SECTION, report.markdown())
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


# -- the report --------------------------------------------------------------------------------


class Report:
    def __init__(self, args, results, bench, cal_cost, cal_tau, loads, elapsed):
        self.args, self.results = args, results
        self.every, self.cost_prior = bench.every, bench.cost_prior
        self.cal_cost, self.cal_tau = cal_cost, cal_tau
        self.loads, self.elapsed = loads, elapsed
        self.configs = [c for c in CONFIGS if c in args.configs]

    def json_runs(self) -> list[dict]:
        num = lambda x: None if x is None or not math.isfinite(x) else round(x, 3)
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

    COLUMNS = ("config", "seed", "wall s", "failures", "saves", "overhead s", "stall s",
               "recomputed s", "recovery s", "rest s", "weighted s", "sim s", "sim err",
               "sim weighted s", "params")  # fmt: skip

    def rows(self) -> list[list[str]]:
        out = []
        digests = {r.seed: r.m.digest for r in self.results if r.config == "no-failures"}
        for r in sorted(self.results, key=lambda r: (r.seed, self.configs.index(r.config))):
            ff = r.config == "no-failures"
            same = r.m.digest is not None and r.m.digest == digests.get(r.seed)
            out.append([
                r.config, str(r.seed), f"{r.m.wall_s:.1f}", str(len(r.m.failure_times)),
                str(r.saves), "" if ff else f"{r.overhead_s:.1f}", f"{r.m.stall_s:.1f}",
                f"{r.m.recompute_s:.1f}", f"{r.m.recovery_s:.1f}",
                "" if ff else f"{r.rest_s:.1f}", "" if ff else f"{r.weighted_s:.1f}",
                "" if ff else f"{r.sim_s:.1f}",
                "" if ff else f"{r.sim_error:+.0%}",
                "" if ff else f"{r.sim_weighted_s:.1f}",
                r.m.digest or "?" if ff else ("same" if same else "DIFFERENT"),
            ])  # fmt: skip
        return out

    def summary(self) -> dict:
        by = {c: [r for r in self.results if r.config == c] for c in self.configs}
        mean = lambda rs, key: statistics.fmean(getattr(r, key) for r in rs)
        out = {
            c: dict(
                overhead=mean(rs, "overhead_s"),
                weighted=mean(rs, "weighted_s"),
                weighted_sd=statistics.stdev(r.weighted_s for r in rs) if len(rs) > 1 else 0.0,
                failures=statistics.fmean(len(r.m.failure_times) for r in rs),
                saves=statistics.fmean(r.saves for r in rs),
            )
            for c, rs in by.items()
            if c != "no-failures" and rs
        }
        return out

    def targets(self) -> list[tuple[str, str, str]]:
        s = self.summary()
        rows = []
        others = [c for c in s if c != "coci"]
        if "coci" in s and others:
            best = min(others, key=lambda c: s[c]["weighted"])
            weighted = {(r.config, r.seed): r.weighted_s for r in self.results}
            per_seed = [
                1.0 - weighted["coci", seed] / weighted[best, seed]
                for seed in sorted({r.seed for r in self.results})
            ]
            lowest = all(s["coci"]["weighted"] < s[c]["weighted"] for c in others)
            rows.append((
                "coci's mean weighted overhead lowest",
                f"coci {s['coci']['weighted']:.1f} s, best other {best} "
                f"{s[best]['weighted']:.1f} s: reduction {statistics.fmean(per_seed):+.0%} "
                f"(per seed {', '.join(f'{x:+.0%}' for x in per_seed)})",
                "met" if lowest else "NOT met",
            ))  # fmt: skip
        scored = [r for r in self.results if r.config != "no-failures"]
        if scored:
            out = [r for r in scored if not abs(r.sim_error) <= SIM_TOLERANCE]
            rows.append((
                f"simulator within {SIM_TOLERANCE:.0%} of measured overhead, every run",
                f"{len(scored) - len(out)} of {len(scored)} runs; worst "
                f"{max(scored, key=lambda r: abs(r.sim_error)).sim_error:+.0%}",
                "met" if not out else "NOT met",
            ))  # fmt: skip
        digests = {r.seed: r.m.digest for r in self.results if r.config == "no-failures"}
        checked = [r for r in self.results if r.config != "no-failures" and r.seed in digests]
        if checked:
            same = [r for r in checked if r.m.digest and r.m.digest == digests[r.seed]]
            rows.append((
                "final parameters equal an uninterrupted run's",
                f"{len(same)} of {len(checked)} runs",
                "met" if len(same) == len(checked) else "NOT met",
            ))  # fmt: skip
        return rows

    def noise(self) -> str:
        ff = [r.m.step_time_s for r in self.results if r.config == "no-failures"]
        walls = [r.m.wall_s for r in self.results if r.config == "no-failures"]
        text = (
            f"1-minute load average at the start of each run: {min(self.loads):.1f} to "
            f"{max(self.loads):.1f} (median {statistics.median(self.loads):.1f}; 2 cores)"
        )
        if ff:
            text += (
                f"; failure-free runs: median step {min(ff) * 1e3:.1f} to {max(ff) * 1e3:.1f} "
                f"ms, wall {min(walls):.1f} to {max(walls):.1f} s"
            )
        return text

    def print(self, console: Console) -> None:
        table = Table(title=f"chaos_bench: {self.args.steps} steps, MTBF {self.args.mtbf:g} s")
        for col in self.COLUMNS:
            table.add_column(col, justify="left" if col == "config" else "right")
        for row in self.rows():
            table.add_row(*row)
        console.print(table)
        t = Table(title="mean over seeds")
        for col in ("config", "failures", "saves", "overhead s", "weighted s", "weighted sd"):
            t.add_column(col, justify="left" if col == "config" else "right")
        for c, s in self.summary().items():
            t.add_row(c, f"{s['failures']:.1f}", f"{s['saves']:.1f}", f"{s['overhead']:.1f}",
                      f"{s['weighted']:.1f}", f"{s['weighted_sd']:.1f}")  # fmt: skip
        console.print(t)
        t = Table(title="targets")
        for col in ("target", "measured", "status"):
            t.add_column(col)
        for row in self.targets():
            t.add_row(*row)
        console.print(t)
        console.print(f"noise: {self.noise()}; {self.elapsed / 60:.1f} min in all", highlight=False)

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        seed = min(r.seed for r in self.results)
        runs = [r for c in self.configs for r in self.results if r.config == c and r.seed == seed]
        fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.6), sharex=True,
                                 sharey=True, squeeze=False)  # fmt: skip
        for ax, r in zip(axes[:, 0], runs, strict=True):
            t, loss = np.array(r.m.curve).T
            ax.plot(t, loss, ".", ms=1.0, color="0.6")
            k = 25  # a moving average over 25 logged steps, for the eye
            if loss.size > k:
                ax.plot(t[k - 1 :], np.convolve(loss, np.ones(k) / k, "valid"), lw=1.0, color="C0")
            for x in r.m.kills:
                ax.axvline(x, color="C3", lw=1.2)
            ax.plot(r.m.save_times, np.full(len(r.m.save_times), np.nanmax(loss)), "|",
                    color="C2", ms=8)  # fmt: skip
            label = r.config if r.config == "no-failures" else (
                f"{r.config}: {len(r.m.failure_times)} failures, {r.saves} saves, "
                f"overhead {r.overhead_s:.0f} s (weighted {r.weighted_s:.0f} s)"
            )  # fmt: skip
            ax.set_title(label, fontsize=9, loc="left")
            ax.set_ylabel("loss")
        axes[-1, 0].set_xlabel(
            "seconds since training started (red: failures, green ticks: saves started)"
        )
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)

    def markdown(self) -> str:
        a = self.args
        cal = (
            f"`save_interval_steps` {self.every} = Young's interval from the calibration run "
            f"(an Orbax save blocked {self.cal_cost * 1e3:.0f} ms, median step "
            f"{self.cal_tau * 1e3:.1f} ms)"
            if math.isfinite(self.cal_cost)
            else f"`save_interval_steps` {self.every} (given)"
        )
        lines = [
            "## Live chaos benchmark (`benchmarks/chaos_bench.py`)",
            "",
            f"Machine: {cpu_and_ram()}; {datetime.date.today().isoformat()}; Python "
            f"{platform.python_version()}. Command: `python benchmarks/chaos_bench.py "
            f"--seeds {a.seeds} --steps {a.steps} --mtbf {a.mtbf:g} --write` "
            f"({self.elapsed / 60:.0f} min).",
            "",
            f"The job (`benchmarks/chaos_job.py`): a character-level model of Python's own "
            f"sources, hashed n-gram embeddings and a Flax MLP, about 390 MiB of parameters and "
            f"Adam moments, {a.steps} steps. Failures: SIGKILL at seeded Poisson times (MTBF "
            f"{a.mtbf:g} s, the same times for every configuration of a seed), restart at once. "
            f"orbax-fixed: {cal}. Overhead = wall time minus the failure-free run's; "
            f"weighted: recomputed seconds weighted by hindsight progress (time_weight "
            f"{TIME_WEIGHT}); sim: `cj.sim.replay` of the run (its saves, failures, median step "
            f"time, mean stall and mean recovery). Rest = overhead - stall - recomputed - "
            f"recovery (steps slower than in the failure-free run).",
            "",
            f"Noise: {self.noise()}.",
            "",
            "| " + " | ".join(self.COLUMNS) + " |",
            "|" + "---|" * len(self.COLUMNS),
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows()]
        lines += ["", "| config | failures | saves | overhead s | weighted s | weighted sd |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {c} | {s['failures']:.1f} | {s['saves']:.1f} | {s['overhead']:.1f} | "
            f"{s['weighted']:.1f} | {s['weighted_sd']:.1f} |"
            for c, s in self.summary().items()
        ]
        lines += ["", "| target | measured | status |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in self.targets()]
        lines += ["", "![chaos benchmark](docs/chaos_bench.png)"]
        return "\n".join(lines)


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
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run at most")
    p.add_argument("--workdir", type=Path, help="keep the logs here (default: a temp dir)")
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
