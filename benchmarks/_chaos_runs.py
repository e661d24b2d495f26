"""The chaos benchmark's reading of a run: its log parsed, measured, scored and replayed.

A run's log (one :class:`Attempt` per process) is turned into what it did (:class:`Measured`:
wall time, stall, recomputed work, recovery), then into a :class:`Result` against the
failure-free runs (:func:`score`) with the simulator's replay and expectations (:func:`expect`).
What each quantity means: ``benchmarks/chaos_bench.py``'s docstring.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from _chaos_supervisor import records

import cocijax as cj

CONFIGS = ("coci", "young", "daly", "orbax-fixed", "no-failures")
TIME_WEIGHT = 0.25


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
    # The failure mix (``chaos_bench --mix``):
    machine: bool = False  # its kill was a machine failure (memory and local disk lost)
    tier: str | None = None  # the tier its restore read
    levels: dict[int, int] = field(default_factory=dict)  # step: the level of its save
    tier_commits: dict[str, dict[int, float]] = field(default_factory=dict)  # memory, durable
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
            att.ready, att.restored, att.tier = r["t"], r["restored"] or 0, r.get("tier")
            att.state_mib = r.get("state_mib", math.nan)
            att.phases = {
                k: r[k] for k in ("imports", "open", "restore", "init", "compile") if k in r
            }
        elif event == "save":
            attempts[-1].saves.append((r["step"], r["t0"], r["t1"]))
            attempts[-1].levels[r["step"]] = r.get("level", 2)
        elif event == "commit" and "tier" in r:
            attempts[-1].tier_commits.setdefault(r["tier"], {})[r["step"]] = r["t"]
        elif event == "commit":
            attempts[-1].commits[r["step"]] = r["t"]
        elif event == "kill":
            attempts[-1].kill, attempts[-1].machine = r["t"], r.get("machine", False)
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


def lost_later(attempts: list[Attempt], i: int, resumed: int, w: np.ndarray) -> tuple[float, float]:
    """``(seconds, weighted)`` of the work of attempt ``i`` up to step ``resumed`` (where the
    next process resumed) that a later failure rolled back: a machine failure that lost the
    newer saves of the memory tier and the local disk sends the job back past them."""
    att = attempts[i]
    lowest = min(a.restored for a in attempts[i + 1 :] if a.ready is not None)
    seconds = weighted = 0.0
    prev = att.ready
    for s, t, _ in att.steps:
        d = t - prev - att.stalls(prev, t)
        if lowest < s <= resumed:
            seconds, weighted = seconds + d, weighted + w[s - 1] * d
        prev = t
    return seconds, weighted


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
    restart_machine: list[bool]  # of each restart: whether the failure before it lost the machine
    failure_machine: list[bool]  # of each failure in failure_times: a machine failure
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
    restarts, restart_machine, down, lost_saves = [], [], [], 0
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
            restart_machine.append(prev_att.machine)
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
        later, later_w = lost_later(attempts, i, resumed, w)
        lost, lost_w = lost + later, lost_w + later_w
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
    failed = [a for a in attempts if a.kill is not None and a.kill < end]
    return Measured(
        wall_s=end - origin,
        failure_times=[a.kill - origin for a in failed],
        failure_machine=[a.machine for a in failed],
        save_steps=sorted({s for s, _, _ in saves}),
        save_times=[a - origin for _, a, _ in saves],
        stall_s=sum(b - a for _, a, b in saves),
        recompute_s=lost,
        uncommitted_s=uncommitted,
        recompute_weighted_s=lost_w,
        recovery_s=recovery,
        restarts=restarts,
        restart_machine=restart_machine,
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
