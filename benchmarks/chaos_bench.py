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

**The failure mix** (``--mix``): each failure is also drawn a class (``--machine-share`` of
machine failures, default 0.2; the same times and classes for every configuration of a seed). A
process kill leaves the memory tier and the local disk; a machine failure deletes both before
the restart, which then reads the durable tier (a directory standing for remote storage).
Configurations: ``coci-2level`` and ``young-2level`` (memory tier, local disk and durable tier,
the two-level policy of that name, told each class's MTBF), ``coci-1level`` (``coci`` told the
MTBF of all failures, the local disk drained to the durable tier, no memory tier) and
``orbax-fixed`` (Orbax's manager on the local disk at Young's interval for all failures, and a
second Orbax manager on the durable path at Young's interval for machine failures, rounded to a
multiple of the first, saving there instead of locally at those steps), and ``no-failures``.
Each run is measured as above and replayed by the two-level :func:`cocijax.sim.replay`; the
report gives the failures by class, the saves by level, the recovery by class and the tier that
served it, and each configuration's paired 95% t interval (over seeds) of its overhead minus
``coci-2level``'s (``_chaos_mix``).

Run (under the benchmark lock on a shared machine)::

    python benchmarks/chaos_bench.py [--quick] [--seeds 3] [--json PATH] [--write]
    python benchmarks/chaos_bench.py --mix [--small] [--seeds 6] [--json PATH] [--write]

``--quick`` runs one seed of a short job (a few minutes on a quiet machine); ``--json`` writes
the runs; ``--workdir DIR`` keeps the logs, which ``--analyse DIR`` reports on again without
running; ``--write`` records the tables, the machine and the figure (``docs/chaos_bench.png``)
in BENCHMARKS.md.

Here: the benchmark's runs and options; ``_chaos_supervisor`` runs the job under failures,
``_chaos_runs`` reads and scores a run, ``_chaos_report`` makes the tables and the figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _chaos_mix import MIX_CONFIGS, TWO_LEVEL, MixReport, replay_mix
from _chaos_report import Report
from _chaos_runs import CONFIGS, TIME_WEIGHT, Result, expect, measure, read_log, score
from _chaos_supervisor import append, mixed_failures, poisson_failures, supervise
from _report import filesystem, write_section
from rich.console import Console

import cocijax as cj

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().with_name("chaos_job.py")
DOC_PNG = ROOT / "docs" / "chaos_bench.png"
SECTION = "chaos_bench"
SECTION_MIX = "chaos_bench_mix"
FULL = dict(seeds=3, steps=10000, mtbf=20.0)
QUICK = dict(seeds=1, steps=3000, mtbf=10.0)
# --mix's defaults, for a quiet machine (the recorded run used --small and its own sizes).
MIX_FULL = dict(seeds=6, steps=5000, mtbf=20.0)
MIX_QUICK = dict(seeds=1, steps=2000, mtbf=10.0)
SHM = Path("/dev/shm")  # the memory tier's tmpfs (Linux)
SMALL_JOB = ["--buckets", str(2**16), "--hidden", "256", "--batch", "128"]
TINY_JOB = ["--buckets", "4096", "--dim", "8", "--hidden", "32", "--batch", "64"]
CALIBRATION = dict(steps=400, every=100)  # the Orbax save cost a user would measure
SETUP = "setup.json"  # in the work directory: what --analyse needs besides the logs


# -- the benchmark -----------------------------------------------------------------------------


class Bench:
    """Runs the configurations of the job under the supervisor, each in its own directory."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.every: int | None = args.every  # orbax-fixed's save_interval_steps
        self.every_durable: int | None = None  # --mix: orbax-fixed's durable manager's
        self.cost_prior: float | None = None  # cocijax policies' cost_prior_s (None: default)
        self.memory = SHM / f"{workdir.name}-memory"  # --mix: the memory tiers

    def command(self, config: str, name: str, steps: int, every: int, mix: bool):
        """``(cmd, env, paths)``: the job's command line and environment for one run, and
        where it keeps its checkpoints (local, durable, memory)."""
        log = self.workdir / f"{name}.jsonl"
        ckpt = self.workdir / f"{name}-ckpt"
        durable, memory = Path(f"{ckpt}-durable"), self.memory / name
        cmd = [sys.executable, str(JOB), "--config", config, "--log", str(log),
               "--steps", str(steps), *(TINY_JOB if self.args.tiny else [])]  # fmt: skip
        cmd += SMALL_JOB if self.args.small and not self.args.tiny else []
        if config == "orbax-fixed":
            cmd += ["--dir", str(ckpt), "--every", str(every)]
            if mix:
                cmd += ["--durable", str(durable), "--every-durable", str(self.every_durable)]
        elif config != "no-failures":
            mtbf = self.args.mtbf
            if config in TWO_LEVEL:  # told each class's MTBF
                share = self.args.machine_share
                cmd += ["--memory", str(memory), "--machine-mtbf", str(mtbf / share)]
                mtbf /= 1.0 - share
            cmd += ["--dir", str(ckpt), "--mtbf", str(mtbf)]
            cmd += ["--durable", str(durable)] if mix else []
            if self.cost_prior is not None:
                cmd += ["--cost-prior", str(self.cost_prior)]
        env = None
        if self.args.compile_cache:
            # Every start after the first of a configuration loads its compiled programs; with
            # --mix the first too (one cache for all, warmed by `warm`).
            cache = self.workdir / "jax-cache" if mix else Path(f"{ckpt}-jax-cache")
            env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # fmt: skip
        return cmd, env, (ckpt, durable, memory, Path(f"{ckpt}-jax-cache"))

    def run(self, config: str, name: str, failures, steps: int = 0, every: int = 0,
            mix: bool = False) -> Path:  # fmt: skip
        """Runs one configuration to the end; returns its log."""
        steps, every = steps or self.args.steps, every or self.every
        cmd, env, paths = self.command(config, name, steps, every, mix)
        ckpt, _, memory, _ = paths

        def lose_machine() -> None:  # what a machine failure takes: memory and local disk
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(memory, ignore_errors=True)

        log = self.workdir / f"{name}.jsonl"
        try:
            supervise(cmd, log, failures, steps, self.args.timeout, env, lose_machine)
        finally:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)  # hundreds of MiB per run
        return log

    def warm(self, config: str) -> None:
        """Runs the configuration's job (no failures) until it has saved twice, then kills it.

        Its compiled programs (the training step, the policy) are then in the shared cache
        before any failure can strike: on a loaded machine a compilation can outlast the MTBF,
        and a process killed while compiling caches nothing, so every restart would compile
        again and the job would never get far.
        """
        cmd, env, paths = self.command(config, f"warm-{config}", self.args.steps, self.every, True)
        log = self.workdir / f"warm-{config}.jsonl"
        append(log, {"event": "spawn", "t": time.monotonic()})
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env=env)  # fmt: skip
        deadline = time.monotonic() + self.args.timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
                events = [a for att in read_log(log) for a in att.saves] if log.exists() else []
                if len(events) >= 2:
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
            log.unlink(missing_ok=True)

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
    """Runs the calibration and every configuration of every seed; returns the setup record,
    written to the work directory after each seed."""
    bench = Bench(args, workdir)
    started = time.monotonic()
    cj_configs = set(args.configs) - {"orbax-fixed", "no-failures"}
    calibrated = ("orbax-fixed" in args.configs and not args.every) or (
        args.cost_prior == "calibrated" and cj_configs
    )
    cal_cost, cal_tau = bench.calibrate() if calibrated else (math.nan, math.nan)
    if calibrated:
        if not args.every:
            interval = float(cj.policies.young_interval(cal_cost, args.mtbf))
            bench.every = max(1, round(interval / cal_tau))
            # --mix: its durable manager at Young's interval for machine failures, a multiple.
            machine = float(cj.policies.young_interval(cal_cost, args.mtbf / args.machine_share))
            bench.every_durable = bench.every * max(1, round(machine / cal_tau / bench.every))
        if args.cost_prior == "calibrated":
            bench.cost_prior = round(cal_cost, 4)
        console.print(
            f"calibration: an Orbax save blocked {cal_cost * 1e3:.0f} ms, a step took "
            f"{cal_tau * 1e3:.1f} ms (medians); orbax-fixed saves every {bench.every} steps"
            f"{f' (durable: every {bench.every_durable})' if args.mix else ''}; "
            f"cocijax policies' cost_prior_s: {bench.cost_prior or 'their default'}",
            highlight=False,
        )
    loads = []  # the 1-minute load average at the start and at the end of each run
    setup = dict(
        argv=sys.argv[1:],
        steps=args.steps,
        mtbf=args.mtbf,
        seeds=0,
        configs=list(args.configs),
        every=bench.every,
        mix=args.mix,
        machine_share=args.machine_share,
        every_durable=bench.every_durable,
        cost_prior=bench.cost_prior,
        compile_cache=args.compile_cache,
        calibration=None if not calibrated else [cal_cost, cal_tau],
        loads=loads,
        disk=filesystem(str(workdir)),
    )
    if args.mix and args.compile_cache:
        for config in args.configs:
            if config != "no-failures":
                bench.warm(config)
    for seed in range(args.seeds):
        for config in order(list(args.configs), seed):
            load = os.getloadavg()[0]
            if config == "no-failures":
                draws = iter(())
            elif args.fail_at:
                draws = iter(args.fail_at)
            elif args.mix:
                draws = mixed_failures(seed, args.mtbf, args.machine_share)
            else:
                draws = poisson_failures(seed, args.mtbf)
            t0 = time.monotonic()
            log = bench.run(config, f"{config}-seed{seed}", draws, mix=args.mix)
            kills = [a.machine for a in read_log(log) if a.kill is not None]
            loads.append([load, os.getloadavg()[0]])
            console.print(
                f"seed {seed} {config:12s} {time.monotonic() - t0:6.1f} s, {len(kills)} kills "
                f"({sum(kills)} machine), "
                f"load {loads[-1][0]:.1f} to {loads[-1][1]:.1f}",
                highlight=False,
            )
        # The seeds done so far: --analyse reports on them if the run is stopped.
        setup.update(seeds=seed + 1, elapsed_s=time.monotonic() - started)
        (workdir / SETUP).write_text(json.dumps(setup, indent=1) + "\n")
    return setup


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
            if setup.get("mix") and config != "no-failures":
                replay_mix(res, logs[config, seed], n)
            results.append(res)
    if setup.get("mix"):
        return MixReport(setup, results, logs)
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
    report = analyse(setup, workdir)
    report.print(console)
    mix = isinstance(report, MixReport)
    if args.json:
        out = report.json() if mix else {"runs": report.json_runs()}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.plot or (args.write and not mix):  # the figure is the one-level mode's
        report.plot(args.plot or DOC_PNG)
    if args.write:
        write_section(SECTION_MIX if mix else SECTION, report.markdown())
    if not (args.workdir or args.analyse):
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed of a short job")
    p.add_argument("--seeds", type=int, help=f"failure seeds (default {FULL['seeds']})")
    p.add_argument("--steps", type=int, help=f"training steps (default {FULL['steps']})")
    p.add_argument("--mtbf", type=float, help=f"MTBF in seconds (default {FULL['mtbf']:g})")
    p.add_argument(
        "--mix",
        action="store_true",
        help="a failure mix: process kills and machine failures, two-level configs",
    )
    p.add_argument(
        "--machine-share",
        type=float,
        default=0.2,
        help="--mix: the share of machine failures (default 0.2)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        choices=sorted({*CONFIGS, *MIX_CONFIGS}),
        help=f"default: {' '.join(CONFIGS)}; with --mix {' '.join(MIX_CONFIGS)}",
    )
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
    p.add_argument("--small", action="store_true",
                   help="a smaller model (a 49 MiB state), for a loaded machine")  # fmt: skip
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
    preset = (
        (MIX_QUICK if args.quick else MIX_FULL) if args.mix else (QUICK if args.quick else FULL)
    )
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.configs = args.configs or list(MIX_CONFIGS if args.mix else CONFIGS)
    allowed = MIX_CONFIGS if args.mix else CONFIGS
    if set(args.configs) - set(allowed):
        p.error(f"--configs: with{'' if args.mix else 'out'} --mix, choose from {allowed}")
    if args.mix and not 0.0 < args.machine_share < 1.0:
        p.error(f"--machine-share must be between 0 and 1, got {args.machine_share}")
    if args.mix and args.fail_at:
        p.error("--fail-at draws no failure classes: leave it out with --mix")
    if args.mix and not SHM.is_dir():
        p.error(f"--mix needs a tmpfs at {SHM} for the memory tier")
    if "no-failures" not in args.configs:
        p.error("--configs must include no-failures (the baseline of every overhead)")
    if args.seeds < 1 or args.steps < 2 or not args.mtbf > 0:
        p.error("--seeds >= 1, --steps >= 2 and a positive --mtbf are needed")
    if args.fail_at and (any(t < 0 for t in args.fail_at) or args.fail_at != sorted(args.fail_at)):
        p.error(f"--fail-at must be non-negative increasing seconds, got {args.fail_at}")
    return args


if __name__ == "__main__":
    sys.exit(main())
