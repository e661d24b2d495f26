"""Monte Carlo of the two-level model (:mod:`cocijax.sim._levels`): each trial walks its own way
through the schedule, since a machine failure sends it back a varying number of segments."""

from __future__ import annotations

import math

import numpy as np

from cocijax.sim._levels import TwoLevel, level_segments, two_level_steps
from cocijax.sim._model import SimResult, _cumulative_work, _Trials


def simulate_two_level(
    save_steps, *, n_steps, step_time_s, job: TwoLevel, weibull_shape, w, trials, seed, cap_s
) -> SimResult:
    """:func:`cocijax.sim.simulate` in the two-level model: two renewal processes of failures
    (process and machine, each Weibull with its own mean), one clock each per trial."""
    steps, levels = two_level_steps(save_steps, n_steps)
    rng = np.random.default_rng(seed)
    gamma = math.gamma(1.0 + 1.0 / weibull_shape)
    scales = [1.0 / (lam * gamma) if lam > 0 else math.inf for lam in (job.lam1, job.lam2)]

    def draw(cls: int, k: int) -> np.ndarray:
        if math.isinf(scales[cls]):
            return np.full(k, math.inf)
        return scales[cls] * rng.weibull(weibull_shape, size=k)

    t = _Trials(trials, np.zeros(trials), cap_s)
    clocks = np.stack([draw(0, trials), draw(1, trials)])  # seconds to the next failure
    _walk(t, clocks, (steps, levels, n_steps, step_time_s, job), w, draw)
    return t.result(steps.size)


def _walk(t: _Trials, clocks: np.ndarray, schedule: tuple, w: np.ndarray, draw) -> None:
    """Runs every trial through the schedule: one segment attempt per trial per round."""
    steps, levels, n_steps, tau, job = schedule
    starts, ends, stall, closes = level_segments(steps, levels, n_steps, job)
    first = np.zeros(starts.size, np.int64)  # the first segment of each segment's interval
    for j in range(1, starts.size):
        first[j] = j if closes[j - 1] else first[j - 1]
    work = (ends - starts) * tau
    dur = work + stall
    cw = _cumulative_work(w, tau)
    grid = np.arange(n_steps + 1)
    seg = np.zeros(clocks.shape[1], np.int64)
    while True:
        act = np.flatnonzero(t.alive & (seg < starts.size))
        if act.size == 0:
            return
        j = seg[act]
        nxt = clocks[:, act].min(axis=0)
        ok = nxt >= dur[j]
        done, jd = act[ok], j[ok]
        clocks[:, done] -= dur[jd]
        t.stall[done] += stall[jd]
        seg[done] += 1
        hit, jh, x = act[~ok], j[~ok], nxt[~ok]
        if hit.size == 0:
            continue
        machine = clocks[1, hit] <= clocks[0, hit]
        _redraw(clocks, hit, machine, x, draw)
        done_work = np.minimum(x, work[jh])
        t.stall[hit] += x - done_work
        t.fails[hit] += 1
        machine = _recover(t, clocks, hit, machine, job, draw)
        back = np.where(machine, first[jh], jh)  # the segment the trial restarts from
        reached = starts[jh] + done_work / tau
        t.lost[hit] += (reached - starts[back]) * tau
        t.lost_w[hit] += np.interp(reached, grid, cw) - cw[starts[back]]
        seg[hit] = back
        t.alive[hit] &= t.stall[hit] + t.lost[hit] + t.recov[hit] < t.cap_s


def _redraw(clocks, idx, machine, elapsed, draw) -> None:
    """Advances the clocks of trials ``idx`` by ``elapsed``; the class that failed draws anew."""
    clocks[:, idx] -= elapsed
    clocks[1, idx[machine]] = draw(1, int(machine.sum()))
    clocks[0, idx[~machine]] = draw(0, int((~machine).sum()))


def _recover(t: _Trials, clocks, hit, machine, job: TwoLevel, draw) -> np.ndarray:
    """Recovers the trials ``hit``: a failure restarts a recovery, a machine failure during a
    level-1 one makes it a level-2 one. Returns which trials roll back to a level-2 save."""
    machine = machine.copy()
    pending = np.arange(hit.size)
    while pending.size:
        idx = hit[pending]
        r = np.where(machine[pending], job.r2, job.r1)
        nxt = clocks[:, idx].min(axis=0)
        short = nxt < r
        fine = ~short
        t.recov[idx[fine]] += r[fine]
        clocks[:, idx[fine]] -= r[fine]
        sp, x = pending[short], nxt[short]
        if sp.size == 0:
            break
        which = clocks[1, hit[sp]] <= clocks[0, hit[sp]]
        _redraw(clocks, hit[sp], which, x, draw)
        machine[sp] |= which
        t.recov[hit[sp]] += x
        t.fails[hit[sp]] += 1
        # A recovery longer than the MTBF may never complete: stop at the cap.
        over = t.stall[hit[sp]] + t.lost[hit[sp]] + t.recov[hit[sp]] >= t.cap_s
        t.alive[hit[sp[over]]] = False
        pending = sp[~over]
    return machine
