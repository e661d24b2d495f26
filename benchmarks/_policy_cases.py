"""The policy benchmark's cases: one curve under one scenario, every policy run and scored.

:func:`run_case` runs each policy of :func:`policies_for` online over the curve (``cj.plan``, and
:func:`from_scratch` for the managers' own start), scores every schedule by its weighted
overhead and compares it with the best classic policy and the bound (the exact optimum, or the
best density schedule under Weibull failures). What is measured and why:
``benchmarks/policy_bench.py``'s docstring.
"""

from __future__ import annotations

import math

import numpy as np

import cocijax as cj

JOB_S = 8 * 3600.0
TIME_WEIGHT = 0.25
SCENARIOS = {
    "A": dict(mtbf_s=7200.0, checkpoint_cost_s=30.0, recovery_s=120.0, weibull_shape=1.0),
    "B": dict(mtbf_s=2880.0, checkpoint_cost_s=10.0, recovery_s=60.0, weibull_shape=1.0),
    "C": dict(mtbf_s=7200.0, checkpoint_cost_s=30.0, recovery_s=120.0, weibull_shape=0.7),
}
CLASSIC = ("young", "daly", "checkfreq")
STOPPED_EARLY = "coci, told 1.25 N"
RAN_OVER = "coci, told 0.8 N"
SCALES = np.geomspace(0.25, 4.0, 41)


def policies_for(n: int, sc: dict) -> dict[str, cj.policies.Policy]:
    """The policies compared on a curve of ``n`` steps under the scenario ``sc``, by name."""
    m, r = sc["mtbf_s"], sc["recovery_s"]
    return {
        "young": cj.policies.young(m),
        "daly": cj.policies.daly(m),
        "checkfreq": cj.policies.checkfreq(0.05),
        "coci_paper": cj.policies.coci_paper(m),
        "coci": cj.policies.coci(m, r, TIME_WEIGHT, total_steps=n),
        "coci no total": cj.policies.coci(m, r, TIME_WEIGHT),
        # A length declared wrong: the job is stopped at 80% of it, or runs 25% past it.
        STOPPED_EARLY: cj.policies.coci(m, r, TIME_WEIGHT, total_steps=round(1.25 * n)),
        RAN_OVER: cj.policies.coci(m, r, TIME_WEIGHT, total_steps=round(0.8 * n)),
    }


def from_scratch(y: np.ndarray, policy: cj.policies.Policy, tau: float, cost: float) -> np.ndarray:
    """The steps a manager saves at running ``policy`` from scratch over the losses ``y``.

    What the managers' driver (``cocijax.core._driver.PolicyDriver``) feeds the policy when every
    step takes ``tau`` and every save ``cost``: no step time for step 1 (not timed) nor step 2
    (one time is not given until a second confirms it), no cost until the first save is timed
    (the policy's own prior), and the early save after step 2, which the policy is not told.
    ``cj.plan`` runs it in one scan; ``tests/manager/test_driver.py`` checks that the driver
    itself saves at exactly these steps. Like the other rows, the final step is not added.
    """
    step_time = np.full(y.size, tau, np.float32)
    step_time[:2] = np.nan
    costs = np.full(y.size, cost, np.float32)
    costs[:2] = np.nan
    planned = cj.plan(y, policy, step_time_s=step_time, checkpoint_cost_s=costs)
    if planned.size and planned[0] == 1:  # the policy's own first save measured the cost
        costs[1] = cost
        return cj.plan(y, policy, step_time_s=step_time, checkpoint_cost_s=costs)
    return np.union1d(planned, [2]).astype(np.int64)


def windowed_mean(w: np.ndarray, half: int) -> np.ndarray:
    """The mean of ``w`` over ``[i - half, i + half]`` (clipped to the ends) at every step."""
    csum = np.concatenate([[0.0], np.cumsum(w)])
    lo = np.clip(np.arange(w.size) - half, 0, w.size)
    hi = np.clip(np.arange(w.size) + half + 1, 0, w.size)
    return (csum[hi] - csum[lo]) / (hi - lo)


def density_schedule(density: np.ndarray, tau: float, scale: float) -> np.ndarray:
    """Save steps where the integral of ``scale * density`` since the last save reaches 1."""
    steps, acc = [], 0.0
    for i, d in enumerate(scale * density * tau):
        acc += d
        if acc >= 1.0 - 0.5 * d:
            steps.append(i + 1)
            acc = 0.0
    return np.asarray(steps, np.int64)


def run_case(y: np.ndarray, sc: dict, trials: int, seed: int) -> dict:
    """Every policy's schedule on the losses ``y`` under the scenario ``sc``, scored.

    Returns:
      The overheads (``res``), save counts, the bound and each policy's capture and ratios
      against the best classic policy and the bound: one row of the tables.
    """
    n = y.size
    tau = JOB_S / n
    w = cj.sim.progress_weights(y, TIME_WEIGHT)
    poisson = sc["weibull_shape"] == 1.0
    job = dict(
        n_steps=n,
        step_time_s=tau,
        checkpoint_cost_s=sc["checkpoint_cost_s"],
        recovery_s=sc["recovery_s"],
        mtbf_s=sc["mtbf_s"],
    )

    def score(steps) -> tuple[float, float]:
        """(weighted, wall) overhead of a schedule."""
        if poisson:
            e = cj.sim.expected_overhead(steps, weights=w, **job)
            return e.weighted_s, e.wall_s
        r = cj.sim.simulate(
            steps, weights=w, weibull_shape=sc["weibull_shape"], trials=trials, seed=seed, **job
        )
        return r.weighted_overhead_s, r.wall_overhead_s

    res, saves = {}, {}
    for name, pol in policies_for(n, sc).items():
        saves[name] = cj.plan(y, pol, step_time_s=tau, checkpoint_cost_s=sc["checkpoint_cost_s"])
        res[name] = score(saves[name])
        if poisson and name in ("coci", "coci no total"):  # exact: no Monte Carlo run more
            scratch = f"{name}, from scratch"
            saves[scratch] = from_scratch(y, pol, tau, sc["checkpoint_cost_s"])
            res[scratch] = score(saves[scratch])
    dens = np.sqrt(w / (2.0 * sc["checkpoint_cost_s"] * sc["mtbf_s"]))
    heuristic = min((score(density_schedule(dens, tau, a)), a) for a in SCALES)[0]
    res["density bound"] = heuristic
    if poisson:
        kw = {k: job[k] for k in ("step_time_s", "checkpoint_cost_s", "recovery_s", "mtbf_s")}
        saves["optimal"] = cj.sim.optimal_schedule(w, **kw)
        res["optimal"] = score(saves["optimal"])
        young_steps = math.sqrt(2.0 * sc["checkpoint_cost_s"] * sc["mtbf_s"]) / tau
        trend = windowed_mean(w, int(young_steps / 2))
        saves["trend oracle"] = cj.sim.optimal_schedule(trend, **kw)
        res["trend oracle"] = score(saves["trend oracle"])
    bound = min(res["density bound"], res.get("optimal", (math.inf, 0)))
    classic = min(res[k][0] for k in CLASSIC)

    def against(name: str, told: str) -> float:
        return res[name][0] / res[told][0] - 1.0 if name in res else math.nan

    def capture(name: str) -> float:
        gain = classic - bound[0]
        return (classic - res[name][0]) / gain if gain > 0 else math.nan

    return dict(
        n=n,
        res=res,
        saves={k: len(v) for k, v in saves.items()},
        classic=classic,
        bound=bound[0],
        bound_red=1.0 - bound[0] / classic,
        capture=capture("coci"),
        capture_nt=capture("coci no total"),
        capture_early=capture(STOPPED_EARLY),
        capture_over=capture(RAN_OVER),
        capture_trend=capture("trend oracle") if "trend oracle" in res else math.nan,
        vs_bound=res["coci"][0] / bound[0] - 1.0,
        trend_vs_bound=res.get("trend oracle", (math.nan,))[0] / bound[0] - 1.0,
        vs_classic=res["coci"][0] / classic - 1.0,
        vs_classic_nt=res["coci no total"][0] / classic - 1.0,
        vs_classic_early=res[STOPPED_EARLY][0] / classic - 1.0,
        vs_classic_over=res[RAN_OVER][0] / classic - 1.0,
        wall_vs_young=res["coci"][1] / res["young"][1],
        wall_vs_young_nt=res["coci no total"][1] / res["young"][1],
        scratch_vs_told=against("coci, from scratch", "coci"),
        scratch_vs_told_nt=against("coci no total, from scratch", "coci no total"),
    )
