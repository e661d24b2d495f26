"""The policy benchmark at two levels (``policy_bench.py --two-level``).

Each curve is stretched to an 8-hour job, as in the one-level benchmark, and run under each
scenario of ``SCENARIOS`` by four schedules, every one scored by its exact expected weighted
overhead in the two-level model (:mod:`cocijax.sim`, Poisson failures, hindsight weights of
time_weight 0.25):

* ``coci two-level``: :func:`cocijax.policies.coci_two_level`, told ``total_steps``;
* ``classic two-level``: :func:`cocijax.policies.young_two_level`, Young's interval at each
  level;
* ``pattern``: the other classic candidate, shown to justify the choice: the first-order optimal
  periodic pattern of Benoit et al. (IEEE TC 2017; the model of Di et al., IPDPS 2014), ``k``
  equal level-1 intervals then a level-2 save, ``k = sqrt((C2 - C1) M2 / (C1 M1))`` and period
  ``W = sqrt(2 ((k - 1) C1 + C2) / (1 / (k M1) + 1 / M2))``, rounded to whole steps;
* ``coci one-level``: :func:`cocijax.policies.coci` as a one-level job would run it: every save
  level 2 (cost ``C2``), planned for the combined failure rate and the level-2 recovery;
* ``bound``: the exact two-level optimum (:func:`cocijax.sim.optimal_schedule`).

Capture = (classic two-level - policy) / (classic two-level - bound).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
from _policy_cases import JOB_S, TIME_WEIGHT
from _policy_targets import print_targets

import cocijax as cj

SCENARIOS = {
    # The scenario A.
    "A2": dict(mtbf_s=7200.0, machine_mtbf_s=43200.0, checkpoint_cost_s=0.5,
               persist_cost_s=30.0, recovery_s=15.0, machine_recovery_s=120.0),
    # A job on four times the machines: failures four times as frequent, a state twice the
    # size per save (C1 1 s, C2 60 s) and a longer restart after losing a machine (rescheduling,
    # then reading the durable tier: 5 min).
    "L2": dict(mtbf_s=1800.0, machine_mtbf_s=10800.0, checkpoint_cost_s=1.0,
               persist_cost_s=60.0, recovery_s=30.0, machine_recovery_s=300.0),
}  # fmt: skip
GROUPS = {
    "shared curves": ("shared",),
    "own curves, tune split": ("tune",),
    "own curves, holdout split (held out of tuning)": ("holdout",),
    "own curves, fresh split (trained after coci was fixed)": ("fresh",),
}
POLICIES = ("coci two-level", "classic two-level", "pattern", "coci one-level", "bound")


def pattern(n: int, tau: float, sc: dict) -> cj.sim.Schedule:
    """Benoit et al.'s first-order optimal periodic pattern (module docstring)."""
    c1, c2 = sc["checkpoint_cost_s"], sc["persist_cost_s"]
    m1, m2 = sc["mtbf_s"], sc["machine_mtbf_s"]
    k = max(1, round(math.sqrt(max(c2 - c1, 0.0) * m2 / (max(c1, 1e-9) * m1))))
    period = math.sqrt(2.0 * ((k - 1) * c1 + c2) / (1.0 / (k * m1) + 1.0 / m2))
    every = max(1, round(period / k / tau))  # steps between saves: one a step at least
    k = max(1, round(period / (every * tau)))  # saves per period, as they come
    steps = np.arange(every, n + 1, every, dtype=np.int64)
    return cj.sim.Schedule(steps, np.where(np.arange(1, steps.size + 1) % k == 0, 2, 1))


def run_case(y: np.ndarray, sc: dict) -> dict:
    """The schedules of every policy on the losses ``y`` under the scenario ``sc``, scored."""
    n = y.size
    tau = JOB_S / n
    w = cj.sim.progress_weights(y, TIME_WEIGHT)
    job = dict(n_steps=n, step_time_s=tau, **sc)
    c1, c2, r1, r2 = (sc[k] for k in ("checkpoint_cost_s", "persist_cost_s", "recovery_s",
                                       "machine_recovery_s"))  # fmt: skip
    m1, m2 = sc["mtbf_s"], sc["machine_mtbf_s"]
    feed = dict(step_time_s=tau, checkpoint_cost_s=c1, persist_cost_s=c2)
    schedules = {
        "coci two-level": cj.plan(y, cj.policies.coci_two_level(
            m1, r1, TIME_WEIGHT, total_steps=n, machine_mtbf_s=m2, machine_recovery_s=r2), **feed),
        "classic two-level": cj.plan(y, cj.policies.young_two_level(m1, m2), **feed),
        "pattern": pattern(n, tau, sc),
        # One level: every save persisted (level 2), against every failure.
        "coci one-level": cj.plan(
            y, cj.policies.coci(1.0 / (1.0 / m1 + 1.0 / m2), r2, TIME_WEIGHT, total_steps=n),
            step_time_s=tau, checkpoint_cost_s=c2),
        "bound": cj.sim.optimal_schedule(w, **{k: v for k, v in job.items() if k != "n_steps"}),
    }  # fmt: skip
    res = {}
    for name, s in schedules.items():
        e = cj.sim.expected_overhead(s, weights=w, **job)
        levels = np.full(len(s), 2) if not isinstance(s, cj.sim.Schedule) else s.levels
        res[name] = dict(
            weighted_s=e.weighted_s, wall_s=e.wall_s,
            level1_saves=int((levels == 1).sum()), level2_saves=int((levels == 2).sum()),
        )  # fmt: skip
    classic, bound = res["classic two-level"]["weighted_s"], res["bound"]["weighted_s"]
    gain = classic - bound

    def capture(name: str) -> float:
        return (classic - res[name]["weighted_s"]) / gain if gain > 0 else math.nan

    return dict(
        total_steps=n,
        step_time_s=tau,
        res=res,
        bound_red=gain / classic,
        capture=capture("coci two-level"),
        capture_one_level=capture("coci one-level"),
        capture_pattern=capture("pattern"),
        vs_classic=res["coci two-level"]["weighted_s"] / classic - 1.0,
    )


def summarise(rows: list[dict], sets: tuple[str, ...]) -> dict:
    sel = [r for r in rows if r["set"] in sets]
    if not sel:
        return {}
    fin = lambda key: [r[key] for r in sel if math.isfinite(r[key])] or [math.nan]
    return dict(
        cases=len(sel),
        capture_median=statistics.median(fin("capture")),
        capture_min=min(fin("capture")),
        one_level_median=statistics.median(fin("capture_one_level")),
        worst=max(r["vs_classic"] for r in sel),
        bound_red=statistics.median(r["bound_red"] for r in sel),
        pattern_vs_classic=statistics.median(
            r["res"]["pattern"]["weighted_s"] / r["res"]["classic two-level"]["weighted_s"] - 1
            for r in sel
        ),
    )


def targets(s: dict) -> list[tuple[str, str, str]]:
    ok = lambda b: "met" if b else "NOT met"
    return [
        ("coci two-level never worse than the classic two-level rule",
         f"worst {s['worst']:+.2%}", ok(s["worst"] <= 0)),
        ("median capture >= 80% (coci two-level)", f"{s['capture_median']:.0%}",
         ok(s["capture_median"] >= 0.8)),
        ("coci two-level: least capture", f"{s['capture_min']:.0%}", "measure"),
        ("coci one-level (every save level 2): median capture", f"{s['one_level_median']:.0%}",
         "measure"),
        ("Benoit et al.'s pattern against Young per level (median)",
         f"{s['pattern_vs_classic']:+.2%}", "measure"),
        ("the bound's reduction against the classic rule (median)", f"{s['bound_red']:.1%}",
         "measure"),
    ]  # fmt: skip


def cells(r: dict) -> list[str]:
    pct = lambda x: f"{x:.0%}" if math.isfinite(x) else ""
    res = r["res"]
    return [
        r["curve"][:36], r["set"], r["scen"], str(r["total_steps"]),
        *(f"{res[p]['weighted_s']:.0f}" for p in POLICIES),
        f"{res['coci two-level']['level1_saves']}/{res['coci two-level']['level2_saves']}",
        f"{res['bound']['level1_saves']}/{res['bound']['level2_saves']}",
        f"{r['bound_red']:.1%}", pct(r["capture"]), pct(r["capture_one_level"]),
        f"{r['vs_classic']:+.2%}",
    ]  # fmt: skip


COLUMNS = ["curve", "set", "scen", "steps", *POLICIES, "coci saves (L1/L2)",
           "bound saves (L1/L2)", "bound red.", "capture", "capture one-level",
           "coci vs classic"]  # fmt: skip


def run(data: list[tuple[str, str, np.ndarray]], console, json_path: Path | None) -> tuple:
    """Every case of ``data`` under every scenario; the rows and the summaries per group."""
    import jax

    rows = []
    for name, subset, y in data:
        for scen, sc in SCENARIOS.items():
            rows.append(dict(curve=name, set=subset, scen=scen, **run_case(y, sc)))
            jax.clear_caches()  # see policy_bench.main
            r = rows[-1]
            console.print(
                f"{name[:40]:40s} {subset:7s} {scen} capture {r['capture']:6.0%} one-level "
                f"{r['capture_one_level']:6.0%} vs classic {r['vs_classic']:+.2%} "
                f"bound {r['bound_red']:5.1%}",
                highlight=False,
            )
    if json_path is not None:
        cases = [
            dict(curve=r["curve"], set=r["set"], scenario=r["scen"],
                 scenario_inputs=SCENARIOS[r["scen"]], total_steps=r["total_steps"],
                 step_time_s=r["step_time_s"], time_weight=TIME_WEIGHT,
                 **{p.replace(" ", "_").replace("-", "_"): r["res"][p] for p in POLICIES},
                 capture=r["capture"], capture_one_level=r["capture_one_level"])
            for r in rows
        ]  # fmt: skip
        json_path.write_text(json.dumps(cases, indent=1) + "\n")
    summaries = {}
    for title, sets in GROUPS.items():
        for scen in SCENARIOS:
            s = summarise([r for r in rows if r["scen"] == scen], sets)
            if s:
                summaries[f"{title}, {scen}"] = s
    return rows, summaries


def report(data, console, args, machine: str) -> None:
    """Runs the cases of ``data``, prints their tables and, with ``--write``, records them."""
    import time

    from _report import write_section
    from rich.table import Table

    t0 = time.perf_counter()
    rows, summaries = run(data, console, args.json)
    elapsed = time.perf_counter() - t0
    table = Table(
        title=f"policy_bench --two-level: weighted overhead (s), time_weight {TIME_WEIGHT}"
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("curve", "set") else "right")
    for r in rows:
        table.add_row(*cells(r))
    console.print(table)
    print_targets(console, summaries, targets)
    console.print(f"cases ran in {elapsed:.0f} s")
    if not args.write:
        return
    scen = "; ".join(
        f"{k}: process MTBF {v['mtbf_s'] / 3600:g} h, machine MTBF "
        f"{v['machine_mtbf_s'] / 3600:g} h, "
        f"C1 {v['checkpoint_cost_s']:g} s, C2 {v['persist_cost_s']:g} s, R1 {v['recovery_s']:g} s, "
        f"R2 {v['machine_recovery_s']:g} s"
        for k, v in SCENARIOS.items()
    )
    lines = [
        "## Two-level policy benchmark (`benchmarks/policy_bench.py`)",
        "",
        f"Machine: {machine} (a VM whose 2 cores other jobs shared during the run).",
        f"Command: `python benchmarks/policy_bench.py --two-level --write` ({elapsed:.0f} s).",
        "",
        f"Each curve is stretched to an 8-hour job. Scenarios (Poisson failures): {scen}. "
        "Weighted overhead in seconds (time_weight 0.25, hindsight weights), the exact "
        "expectation in the two-level model of `cj.sim`; the bound is the exact two-level "
        "optimum (DP). Capture = (classic two-level - policy) / (classic two-level - bound). "
        "`classic two-level`: `young_two_level`, Young's interval at each level; `pattern`: "
        "the first-order optimal periodic pattern of Benoit et al. (the other classic "
        "candidate); "
        "`coci one-level`: `coci` with "
        "every save level 2 (cost C2), planned for the combined failure rate and R2. Saves are "
        "counted level 1 / level 2. No parameter was tuned for two levels: `coci_two_level` "
        "runs `coci`'s defaults at each level, so the tune and holdout splits are reported "
        "apart as in the one-level tables, not because they differ in use.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(cells(r)) + " |" for r in rows),
    ]
    for title, s in summaries.items():
        lines += ["", f"Targets, {title} ({s['cases']} cases):", "",
                  "| target | measured | status |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {a} | {b} | {c} |" for a, b, c in targets(s)]
    write_section("policy_bench_two_level", "\n".join(lines))
