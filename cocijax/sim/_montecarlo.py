"""A schedule walked segment by segment: random failures (:func:`simulate`) or given ones
(:func:`replay`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from cocijax.sim._levels import two_level_job, two_level_steps
from cocijax.sim._levels_mc import simulate_two_level
from cocijax.sim._model import (
    MAX_OVERHEAD_FACTOR,
    SimResult,
    _check_job,
    _cumulative_work,
    _save_steps,
    _segments,
    _Trials,
    _weights,
)


def simulate(
    save_steps,
    *,
    n_steps: int,
    step_time_s: float,
    checkpoint_cost_s: float,
    recovery_s: float,
    mtbf_s: float,
    weibull_shape: float = 1.0,
    weights=None,
    trials: int = 1000,
    seed: int = 0,
    max_overhead_factor: float = MAX_OVERHEAD_FACTOR,
    persist_cost_s: float | None = None,
    machine_mtbf_s: float | None = None,
    machine_recovery_s: float | None = None,
) -> SimResult:
    """Monte Carlo overhead of a save schedule under random failures.

    Args:
      save_steps: 1-based steps after which the job saves (any order, duplicates and steps
        outside ``[1, n_steps]`` are dropped); for a two-level job, a
        :class:`~cocijax.sim.Schedule` (plain steps are then all level-2 saves).
      n_steps: number of training steps in the job.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save.
      recovery_s: seconds to recover after each failure (restart, reload).
      mtbf_s: mean time between failures.
      weibull_shape: Weibull shape ``k`` of the inter-failure times (1 = Poisson, < 1 = bursty).
      weights: per-step value weights (length ``n_steps``), e.g. from
        :func:`progress_weights`; ``None`` means all 1.
      trials: number of simulated jobs.
      seed: seed of the failure draws. The same seed gives the same failure times for every
        schedule (common random numbers), so differences between schedules have low variance.
      max_overhead_factor: abandon a trial once it has lost this many times the failure-free
        job time (see ``SimResult.finished``).
      persist_cost_s: two-level jobs: stall seconds of a level-2 save
        (``checkpoint_cost_s`` is then a level-1 save's).
      machine_mtbf_s: giving it makes the job two-level (see :mod:`cocijax.sim`): the mean
        time between machine failures, which only a level-2 save recovers from (``mtbf_s`` is
        then that of process failures); ``math.inf`` for none, as ``mtbf_s`` may then be.
      machine_recovery_s: two-level jobs: seconds to recover from a machine failure (from a
        level-2 save; ``recovery_s`` is then the recovery from a process failure).

    Returns:
      A :class:`SimResult` of means over trials (``n_saves`` counts both levels).

    Raises:
      ValueError: naming the offending argument if it is out of range.

    Example:
      >>> r = simulate([50, 100], n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0,
      ...              recovery_s=5.0, mtbf_s=1e9, trials=10)
      >>> r.wall_overhead_s, r.finished
      (2.0, 1.0)
      >>> from cocijax.sim import Schedule
      >>> two = Schedule([25, 50, 75, 100], [1, 2, 1, 2])  # level-1 saves of 0.5 s
      >>> simulate(two, n_steps=100, step_time_s=1.0, checkpoint_cost_s=0.5, recovery_s=5.0,
      ...          mtbf_s=1e9, persist_cost_s=1.0, machine_mtbf_s=1e9, machine_recovery_s=60.0,
      ...          trials=10).wall_overhead_s
      3.0
    """
    job = two_level_job(
        save_steps, n_steps, step_time_s, mtbf_s=mtbf_s, machine_mtbf_s=machine_mtbf_s,
        checkpoint_cost_s=checkpoint_cost_s, persist_cost_s=persist_cost_s,
        recovery_s=recovery_s, machine_recovery_s=machine_recovery_s,
    )  # fmt: skip
    for name, val in (
        ("weibull_shape", weibull_shape),
        ("trials", trials),
        ("max_overhead_factor", max_overhead_factor),
    ):
        if not (np.isfinite(val) and val > 0):
            raise ValueError(f"{name} must be a positive number, got {val}.")
    n_steps, trials = int(n_steps), int(trials)
    w = _weights(weights, n_steps)
    cap_s = max_overhead_factor * n_steps * step_time_s
    if job is not None:
        return simulate_two_level(
            save_steps, n_steps=n_steps, step_time_s=step_time_s, job=job,
            weibull_shape=weibull_shape, w=w, trials=trials, seed=seed, cap_s=cap_s,
        )  # fmt: skip
    steps = _save_steps(save_steps, n_steps)
    rng = np.random.default_rng(seed)
    scale = mtbf_s / math.gamma(1.0 + 1.0 / weibull_shape)

    def draw(k: int) -> np.ndarray:
        return scale * rng.weibull(weibull_shape, size=k)

    t = _Trials(trials, draw(trials), cap_s)
    _walk(t, steps, n_steps, step_time_s, checkpoint_cost_s, recovery_s, w, draw)
    return t.result(steps.size)


def replay(
    save_steps,
    failure_times_s,
    *,
    n_steps: int,
    step_time_s: float,
    checkpoint_cost_s: float,
    recovery_s: float,
    weights=None,
    commit_s: float = 0.0,
    machine_failures=None,
    persist_cost_s: float | None = None,
    machine_recovery_s: float | None = None,
    persist_commit_s: float | None = None,
) -> SimResult:
    """The overhead of one job whose failures came at given times: a recorded run, replayed.

    The cost model of :func:`simulate`, with one trial whose failures are not drawn but given,
    e.g. the failures a real run suffered, to predict what that run should have lost. Unlike
    there, a save may commit after its stall ends: an asynchronous save writes on while
    training goes on, and a failure before it has committed rolls the job back to the newest
    save that had (``commit_s``). Step, stall and recovery times that vary within the run are
    not modelled.

    **Two levels.** Given ``persist_cost_s`` and ``machine_recovery_s`` (and
    ``machine_failures``, which says which failures lost the machine), the job is two-level
    (see :mod:`cocijax.sim`): ``save_steps`` may be a :class:`~cocijax.sim.Schedule`, a
    process failure rolls the job back to its newest committed save of either level, a
    machine failure to its newest level-2 save that had reached the durable tier
    (``persist_commit_s`` after its stall) and costs ``machine_recovery_s``; a machine
    failure during a recovery makes it a machine recovery. A failure also stops every write
    in flight: a save not committed by then never commits.

    Args:
      save_steps: 1-based steps after which the job saves (as in :func:`simulate`), or a
        :class:`~cocijax.sim.Schedule` for a two-level job (plain steps are level-2 saves).
      failure_times_s: wall-clock seconds from the start of the job's first step to each
        failure, non-decreasing. Failures after the job has ended are left out.
      n_steps: number of training steps in the job.
      step_time_s: seconds per step.
      checkpoint_cost_s: stall seconds per save (a two-level job's level-1 save).
      recovery_s: seconds to recover after each failure (a two-level job's process
        failure); a failure during a recovery restarts it.
      weights: per-step value weights (length ``n_steps``); ``None`` means all 1.
      commit_s: seconds from the end of a save's stall until it has committed (0: safe once
        its stall ends, as :func:`simulate` assumes).
      machine_failures: two-level jobs: one bool per failure time, True for a machine
        failure (default: none).
      persist_cost_s: two-level jobs: stall seconds of a level-2 save.
      machine_recovery_s: two-level jobs: seconds to recover from a machine failure.
      persist_commit_s: two-level jobs: seconds from the end of a level-2 save's stall until
        it has committed on the durable tier (default ``commit_s``).

    Returns:
      A :class:`SimResult` of the one job (standard errors 0, ``finished`` 1, ``failures``
      the number that struck before the end).

    Raises:
      ValueError: naming the offending argument if it is out of range, or
        ``failure_times_s`` if it is not a non-decreasing list of finite, non-negative times,
        or ``machine_failures`` if it does not give one class per failure.

    Example:
      >>> job = dict(n_steps=100, step_time_s=1.0, checkpoint_cost_s=1.0, recovery_s=5.0)
      >>> r = replay([50, 100], [70.0], **job)
      >>> r.failures, r.recompute_s, r.recovery_s, r.stall_s  # 19 s after the save at step 50
      (1.0, 19.0, 5.0, 2.0)
      >>> replay([50, 100], [52.0], commit_s=3.0, **job).recompute_s  # step 50 not committed
      51.0
      >>> from cocijax.sim import Schedule
      >>> two = Schedule([30, 60], [2, 1])  # level 1 at step 60: lost with the machine
      >>> r = replay(two, [70.0, 80.0], machine_failures=[False, True], persist_cost_s=1.0,
      ...            machine_recovery_s=8.0, **job)
      >>> r.recompute_s, r.recovery_s  # 8 s back to step 60, then 35 s from step 65 back to 30
      (43.0, 13.0)
    """
    two_level = any(v is not None for v in (machine_failures, persist_cost_s, machine_recovery_s))
    if two_level:
        c2, r2 = persist_cost_s, machine_recovery_s
        for name, val in (("persist_cost_s", c2), ("machine_recovery_s", r2)):
            if val is None:
                raise ValueError(
                    f"{name} is needed for a two-level replay (machine_failures, "
                    "persist_cost_s or machine_recovery_s given)."
                )
    else:
        c2, r2 = checkpoint_cost_s, recovery_s  # every save is a level-2 one
    _check_job(n_steps, step_time_s, checkpoint_cost_s, recovery_s, mtbf_s=1.0)  # none needed
    _check_job(n_steps, step_time_s, c2, r2, mtbf_s=1.0)
    persist_commit_s = commit_s if persist_commit_s is None else persist_commit_s
    for name, val in (("commit_s", commit_s), ("persist_commit_s", persist_commit_s)):
        if not (np.isfinite(val) and val >= 0):
            raise ValueError(f"{name} must be a non-negative number, got {val}.")
    times = np.asarray(failure_times_s, dtype=np.float64)
    if (
        times.ndim != 1
        or not np.all(np.isfinite(times) & (times >= 0))
        or np.any(np.diff(times) < 0)
    ):
        raise ValueError(
            "failure_times_s must be a 1-D sequence of finite, non-negative, non-decreasing "
            f"seconds, got {failure_times_s!r}."
        )
    machine = np.zeros(times.size, bool) if machine_failures is None else machine_failures
    machine = np.asarray(machine)
    if machine.shape != times.shape or (machine.size and machine.dtype != bool):
        raise ValueError(
            "machine_failures must give one bool per failure time "
            f"({times.size}), got {machine_failures!r}."
        )
    machine = machine.astype(bool)  # an empty list is float
    n_steps = int(n_steps)
    steps, levels = two_level_steps(save_steps, n_steps)
    cw = _cumulative_work(_weights(weights, n_steps), step_time_s)
    t = _Trials(1, np.zeros(1), math.inf)
    job = _Replayed(
        n_steps, step_time_s, checkpoint_cost_s, c2, recovery_s, r2, commit_s, persist_commit_s
    )
    _replay_walk(t, steps, levels, cw, zip(times.tolist(), machine.tolist(), strict=True), job)
    return t.result(steps.size)


class _Replayed(NamedTuple):
    n_steps: int
    tau: float
    c1: float
    c2: float
    r1: float
    r2: float
    commit1: float
    commit2: float


def _replay_walk(t: _Trials, steps, levels, cw: np.ndarray, failures, job: _Replayed) -> None:
    """Walks the one trial of :func:`replay` through ``steps`` with the given failures
    (``(time, machine)`` pairs)."""
    never = (math.inf, False)
    now, (fail_at, machine) = 0.0, next(failures, never)
    pos = safe1 = safe2 = 0  # where the job runs from; the newest committed save, level 2
    pending: list[tuple[float, float, int]] = []  # (commit, durable commit, step) of saves
    while pos < job.n_steps:
        i = int(np.searchsorted(steps, pos, side="right"))
        end = int(steps[i]) if i < steps.size else job.n_steps
        level = int(levels[i]) if i < steps.size else 0
        c = (job.c1 if level == 1 else job.c2) if level else 0.0
        work = (end - pos) * job.tau
        if now + work + c <= fail_at:
            now += work + c
            t.stall[0] += c
            if level:
                durable = now + job.commit2 if level == 2 else math.inf
                pending.append((now + job.commit1, durable, end))
            pos = end
            continue
        # A failure: every write in flight stops; the job rolls back to what had committed.
        done = min(fail_at - now, work)
        t.stall[0] += fail_at - now - done
        safe1 = max([safe1] + [s for when, _, s in pending if when <= fail_at])
        safe2 = max([safe2] + [s for _, when, s in pending if when <= fail_at])
        reached = pos + done / job.tau
        t.fails[0] += 1
        now, lost_machine = fail_at, machine
        fail_at, machine = next(failures, never)
        # A failure during the recovery restarts it; a machine failure makes it a machine one.
        while fail_at - now < (job.r2 if lost_machine else job.r1):
            t.recov[0] += fail_at - now
            t.fails[0] += 1
            now, lost_machine = fail_at, lost_machine or machine
            fail_at, machine = next(failures, never)
        recovery = job.r2 if lost_machine else job.r1
        t.recov[0] += recovery
        now += recovery
        if lost_machine:  # the memory tier and the local disk are gone with the machine
            safe1 = safe2
        t.lost[0] += (reached - safe1) * job.tau
        t.lost_w[0] += np.interp(reached, np.arange(job.n_steps + 1), cw) - cw[safe1]
        pos, pending = safe1, []


def _walk(t, steps, n_steps, step_time_s, checkpoint_cost_s, recovery_s, w, draw) -> None:
    """Runs the trials ``t`` through the schedule; ``draw(k)`` gives the next ``k`` gaps."""
    cw = _cumulative_work(w, step_time_s)  # lost work: interpolated inside a step
    for s0, s1, c in _segments(steps, n_steps, checkpoint_cost_s):
        work = (s1 - s0) * step_time_s
        dur = work + c
        active = np.flatnonzero(t.alive)
        while active.size:
            ok = t.t_next[active] >= dur
            done = active[ok]
            t.t_next[done] -= dur
            t.stall[done] += c
            hit = active[~ok]
            if hit.size == 0:
                break
            x = t.t_next[hit]
            lw = np.minimum(x, work)
            t.lost[hit] += lw
            pos = s0 + lw / step_time_s
            t.lost_w[hit] += np.interp(pos, np.arange(n_steps + 1), cw) - cw[s0]
            t.stall[hit] += x - lw
            t.fails[hit] += 1
            t.recover(hit, recovery_s, draw)
            active = hit[t.alive[hit]]
