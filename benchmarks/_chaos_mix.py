"""The chaos benchmark's failure mix (``--mix``): process kills and machine failures, two levels.

A process kill leaves the machine (its memory tier and local disk); a machine failure loses
both, so the job restarts from the durable tier. Each run is measured as in the one-level mode
(:mod:`_chaos_runs`), replayed by the two-level :func:`cocijax.sim.replay` (:func:`replay_mix`),
and compared with ``coci-2level`` seed by seed (:func:`paired`); :class:`MixReport` makes the
tables, the targets and the JSON.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import platform
import statistics

import numpy as np
from _chaos_report import SIM_TOLERANCE, Report
from _chaos_runs import PHASES, TIME_WEIGHT, Attempt, Result
from _report import cpu_and_ram

import cocijax as cj

MIX_CONFIGS = ("coci-2level", "young-2level", "coci-1level", "orbax-fixed", "no-failures")
TWO_LEVEL = ("coci-2level", "young-2level")
REFERENCE = "coci-2level"  # every other config's paired difference is to this one
TARGET_RATIO = 0.6  # coci-2level's mean overhead against coci-1level's, at most
CLASSES = ("process", "machine")
QUANTILE = "t" if importlib.util.find_spec("scipy") else "normal"  # of the paired intervals


def commit_delays(attempts: list[Attempt]) -> tuple[float, float]:
    """``(commit_s, persist_commit_s)``: the median seconds from the end of a save's stall to
    its first commit (on any tier), and from a level-2 save's to its durable commit."""
    first, durable = [], []
    for att in attempts:
        for step, _, t1 in att.saves:
            times = [c[step] for c in (att.commits, *att.tier_commits.values()) if step in c]
            first += [min(times) - t1] if times else []
            if att.levels.get(step) == 2 and step in att.tier_commits.get("durable", {}):
                durable.append(att.tier_commits["durable"][step] - t1)
    median = lambda xs: statistics.median(xs) if xs else 0.0
    return median(first), median(durable)


def replay_mix(res: Result, attempts: list[Attempt], n_steps: int) -> None:
    """The run's two-level replay: its schedule (each step at the highest level it was saved
    at), its failures and their classes, each level's mean stall, each class's mean recovery
    and the median commit delays (:func:`commit_delays`). Fills in ``res.sim``, ``sim_s``."""
    m = res.m
    end = attempts[0].ready + m.wall_s  # saves begun after the last step do not count
    levels: dict[int, int] = {}
    stalls = {1: [], 2: []}
    for att in attempts:
        for step, t0, t1 in att.saves:
            if t0 < end:
                levels[step] = max(att.levels[step], levels.get(step, 0))
                stalls[att.levels[step]].append(t1 - t0)
    mean = lambda xs, default: statistics.fmean(xs) if xs else default
    c2 = mean(stalls[2], 0.0)
    rec = {
        k: [sum(r.values()) for r, mk in zip(m.restarts, m.restart_machine, strict=True) if mk == k]
        for k in (False, True)
    }
    r_all = mean(rec[False] + rec[True], 0.0)
    commit_s, persist_commit_s = commit_delays(attempts)
    steps = sorted(levels)
    res.sim = cj.sim.replay(
        cj.sim.Schedule(np.array(steps, np.int64), np.array([levels[s] for s in steps])),
        m.failure_times,
        machine_failures=m.failure_machine,
        n_steps=n_steps,
        step_time_s=m.step_time_s,
        checkpoint_cost_s=mean(stalls[1], c2),
        persist_cost_s=c2,
        recovery_s=mean(rec[False], r_all),
        machine_recovery_s=mean(rec[True], r_all),
        commit_s=commit_s,
        persist_commit_s=persist_commit_s,
        weights=res.job["weights"],
    )
    res.sim_s = res.sim.wall_overhead_s + res.work_beyond_s


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the paired 95% t interval of ``a - b`` over seeds (NaN bounds
    for one seed)."""
    d = np.asarray(a) - np.asarray(b)
    mean = float(d.mean())
    if d.size < 2:
        return mean, math.nan, math.nan
    if QUANTILE == "t":
        from scipy import stats

        q = float(stats.t.ppf(0.975, d.size - 1))
    else:  # without scipy: the normal quantile (a narrower interval; the report says which)
        q = statistics.NormalDist().inv_cdf(0.975)
    half = q * float(d.std(ddof=1)) / math.sqrt(d.size)
    return mean, mean - half, mean + half


class MixReport(Report):
    """The failure mix's tables, targets and JSON (the one-level report's machinery)."""

    def __init__(self, setup: dict, results: list[Result], attempts: dict):
        super().__init__(setup, results)
        self.configs = [c for c in MIX_CONFIGS if c in setup["configs"]]
        self.attempts = attempts  # (config, seed): the run's attempts

    def run_record(self, r: Result) -> dict:
        """What ``--json`` writes of a run."""
        num = lambda x: round(x, 3) if math.isfinite(x) else None
        m = r.m
        levels = [lv for att in self.attempts[r.config, r.seed] for lv in att.levels.values()]
        phases = {
            k: [
                {p: num(v) for p, v in x.items()}
                for x, mk in zip(m.restarts, m.restart_machine, strict=True)
                if mk == (k == "machine")
            ]
            for k in CLASSES
        }
        return {
            "config": r.config,
            "seed": r.seed,
            "wall_s": num(m.wall_s),
            "failures": {
                k: sum(mk == (k == "machine") for mk in m.failure_machine) for k in CLASSES
            },
            "saves": {"level1": levels.count(1), "level2": levels.count(2)},
            "overhead_s": num(r.overhead_s),
            "weighted_overhead_s": num(r.weighted_s),
            "recovery_phases": phases,
            "restored_tiers": [a.tier for a in self.attempts[r.config, r.seed][1:] if a.ready],
            "sim_overhead_s": num(r.sim_s),
            "sim_weighted_overhead_s": num(
                r.sim.weighted_overhead_s + r.work_beyond_s if r.sim else math.nan
            ),
        }

    def intervals(self) -> dict[str, dict[str, list[float]]]:
        """Each config's paired difference to coci-2level: ``{config: {overhead_s: [mean, low,
        high], weighted_overhead_s: [...]}}`` over the seeds both ran."""
        run = {(r.config, r.seed): r for r in self.scored}
        out = {}
        for c in self.by_config():
            seeds = sorted(s for s in self.base if (c, s) in run and (REFERENCE, s) in run)
            if c == REFERENCE or not seeds:
                continue
            out[c] = {
                key: list(
                    paired(
                        [getattr(run[c, s], attr) for s in seeds],
                        [getattr(run[REFERENCE, s], attr) for s in seeds],
                    )
                )
                for key, attr in (
                    ("overhead_s", "overhead_s"),
                    ("weighted_overhead_s", "weighted_s"),
                )
            }
        return out

    def json(self) -> dict:
        num = lambda x: round(x, 3) if math.isfinite(x) else None
        paired_json = {c: {k: [num(x) for x in v] for k, v in d.items()}
                       for c, d in self.intervals().items()}  # fmt: skip
        return {
            "runs": [self.run_record(r) for r in self.results],
            "paired_to": REFERENCE,
            "paired": paired_json,
        }

    def tables(self) -> list[tuple[str, list[str], list[list[str]]]]:
        runs = []
        for r in sorted(self.results, key=lambda r: (r.seed, self.configs.index(r.config))):
            rec, m = self.run_record(r), r.m
            row = [r.config, str(r.seed), f"{m.wall_s:.1f}"]
            if r.config == "no-failures":
                runs.append(row + [""] * 10 + [m.digest or "?"])
                continue
            same = m.digest is not None and m.digest == self.base[r.seed].digest
            row += [
                f"{rec['failures']['process']} / {rec['failures']['machine']}",
                f"{rec['saves']['level1']} / {rec['saves']['level2']}",
                f"{r.overhead_s:.1f}",
                f"{r.weighted_s:.1f}",
                f"{m.stall_s:.1f}",
                f"{m.recompute_s:.1f}",
                f"{m.recovery_s:.1f}",
                f"{r.rest_s:.1f}",
                f"{r.sim_s:.1f}",
                f"{r.sim_error:+.0%}",
                "same" if same else "DIFFERENT",
            ]
            runs.append(row)
        fmt = lambda x: f"{x[0]:+.1f} [{x[1]:+.1f}, {x[2]:+.1f}]"
        ivs, summary = self.intervals(), []
        for c, rs in self.by_config().items():
            recs = [self.run_record(r) for r in rs]
            summary.append(
                [
                    c,
                    *(f"{statistics.fmean(x['failures'][k] for x in recs):.1f}" for k in CLASSES),
                    *(
                        f"{statistics.fmean(x['saves'][k] for x in recs):.1f}"
                        for k in ("level1", "level2")
                    ),
                    f"{statistics.fmean(r.overhead_s for r in rs):.1f}",
                    f"{statistics.fmean(r.weighted_s for r in rs):.1f}",
                    *(
                        (fmt(ivs[c]["overhead_s"]), fmt(ivs[c]["weighted_overhead_s"]))
                        if c in ivs
                        else ("", "")
                    ),
                    f"{statistics.fmean(r.sim_s for r in rs):.1f}",
                ]
            )
        return [
            (
                f"runs: {self.setup['steps']} steps, MTBF {self.setup['mtbf']:g} s "
                f"({self.setup['machine_share']:.0%} machine failures)",
                [
                    "config",
                    "seed",
                    "wall s",
                    "failures process / machine",
                    "saves level 1 / 2",
                    "overhead s",
                    "weighted s",
                    "stall s",
                    "recomputed s",
                    "recovery s",
                    "rest s",
                    "sim s",
                    "sim err",
                    "params",
                ],
                runs,
            ),
            (
                "mean over seeds, and the paired 95% interval of the difference to "
                f"{REFERENCE} (seconds; {QUANTILE} quantile, over seeds)",
                [
                    "config",
                    "process failures",
                    "machine failures",
                    "level-1 saves",
                    "level-2 saves",
                    "overhead s",
                    "weighted s",
                    f"overhead - {REFERENCE}",
                    f"weighted - {REFERENCE}",
                    "sim s",
                ],
                summary,
            ),
            (
                "recovery by failure class (means over the restarts)",
                [
                    "config",
                    "class",
                    "restarts",
                    "restored from",
                    "recovery s",
                    *(f"{k} s" for k in PHASES),
                ],
                self.recoveries(),
            ),
            ("targets", ["target", "measured", "status"], [list(t) for t in self.targets()]),
        ]

    def recoveries(self) -> list[list[str]]:
        rows = []
        for c, rs in self.by_config().items():
            for k in CLASSES:
                got = [
                    (x, att.tier)
                    for r in rs
                    for x, mk, att in zip(
                        r.m.restarts,
                        r.m.restart_machine,
                        [a for a in self.attempts[r.config, r.seed][1:] if a.ready is not None],
                        strict=False,
                    )
                    if mk == (k == "machine")
                ]
                if not got:
                    continue
                tiers = [t or "scratch" for _, t in got]
                where = ", ".join(f"{t} {tiers.count(t)}" for t in sorted(set(tiers)))
                rows.append(
                    [
                        c,
                        k,
                        str(len(got)),
                        where,
                        f"{statistics.fmean(sum(x.values()) for x, _ in got):.1f}",
                        *(f"{statistics.fmean(x[p] for x, _ in got):.2f}" for p in PHASES),
                    ]
                )
        return rows

    def targets(self) -> list[tuple[str, str, str]]:
        rows, by, ivs = [], self.by_config(), self.intervals()
        if by.get(REFERENCE) and by.get("coci-1level") and "coci-1level" in ivs:
            for key, attr, what in (
                ("overhead_s", "overhead_s", "mean overhead"),
                ("weighted_overhead_s", "weighted_s", "mean weighted overhead"),
            ):
                two = statistics.fmean(getattr(r, attr) for r in by[REFERENCE])
                one = statistics.fmean(getattr(r, attr) for r in by["coci-1level"])
                d, lo, hi = ivs["coci-1level"][key]
                ratio = two / one if one > 0 else math.nan
                excludes = lo > 0 or hi < 0
                rows.append(
                    (
                        f"{REFERENCE}'s {what} <= {TARGET_RATIO}x coci-1level's, the paired 95% "
                        "interval excluding 0",
                        f"{two:.1f} s against {one:.1f} s: {ratio:.2f}x; coci-1level - {REFERENCE} "
                        f"{d:+.1f} s [{lo:+.1f}, {hi:+.1f}]",
                        "met" if ratio <= TARGET_RATIO and excludes else "NOT met",
                    )
                )
        if self.scored:
            err = [r.sim_error for r in self.scored]
            within = sum(abs(e) <= SIM_TOLERANCE for e in err)
            e, worst = max(zip(err, self.scored, strict=True), key=lambda x: abs(x[0]))
            rows.append(
                (
                    f"the two-level replay within {SIM_TOLERANCE:.0%} of each run's overhead",
                    f"{within} of {len(err)} runs; worst {e:+.0%} ({worst.config}, "
                    f"seed {worst.seed})",
                    "met" if within == len(err) else "NOT met",
                )
            )
            same = [r for r in self.scored if r.m.digest and r.m.digest == self.base[r.seed].digest]
            rows.append(
                (
                    "final parameters equal the uninterrupted run's",
                    f"{len(same)} of {len(self.scored)} runs",
                    "met" if len(same) == len(self.scored) else "NOT met",
                )
            )
        return rows

    def describe(self) -> str:
        su = self.setup
        return (
            f"{super().describe()}; orbax-fixed's durable manager every {su['every_durable']} "
            f"steps; failure mix: {1 - su['machine_share']:.0%} process kills, "
            f"{su['machine_share']:.0%} machine failures"
        )

    def findings(self) -> list[str]:
        """The machine's noise, where the overhead went, what a restore from each tier cost,
        and where the replay and the run parted, computed from the runs."""
        out = Report.findings(self)[:1]  # the machine's noise
        if not self.scored:
            return out
        parts = []
        for c, rs in self.by_config().items():
            m = {
                k: statistics.fmean(f(r) for r in rs)
                for k, f in (("overhead", lambda r: r.overhead_s), ("stall", lambda r: r.m.stall_s),
                             ("recomputed", lambda r: r.m.recompute_s),
                             ("recovery", lambda r: r.m.recovery_s), ("rest", lambda r: r.rest_s))
            }  # fmt: skip
            split = " + ".join(f"{k} {v:.1f}" for k, v in m.items() if k != "overhead")
            parts.append(f"{c} {m['overhead']:.1f} s = {split}")
        out.append(f"Where the mean overhead went: {'; '.join(parts)}.")
        by_tier: dict[str, list[dict]] = {}
        for r in self.scored:
            attempts = [a for a in self.attempts[r.config, r.seed][1:] if a.ready is not None]
            for x, att in zip(r.m.restarts, attempts, strict=False):
                by_tier.setdefault(att.tier or "scratch", []).append(x)
        each = [
            f"{t} {statistics.fmean(sum(x.values()) for x in xs):.1f} s (restore "
            f"{statistics.fmean(x['restore or init'] for x in xs):.2f} s, process start "
            f"{statistics.fmean(x['start'] for x in xs):.1f} s; {len(xs)} restarts)"
            for t, xs in sorted(by_tier.items())
        ]
        out.append(
            f"Mean restart (kill to training) by the tier it restored from: {'; '.join(each)}."
        )
        calm = [s for s in sorted(self.base)
                if not any(r.m.failure_times for r in self.scored if r.seed == s)]  # fmt: skip
        if calm:
            out.append(
                f"No failure struck any run of seed(s) {', '.join(map(str, calm))} (the jobs "
                "ended before the first failure time): their overheads are the machine's noise, "
                "and they count in the means and the paired intervals as they are."
            )
        drift = [r for r in self.scored if round(r.sim.failures) != len(r.m.failure_times)]
        out.append(
            f"{len(drift)} of {len(self.scored)} replays met another number of failures than "
            "their run: the replayed job (at the run's mean step, stall and recovery times) had "
            "ended, or was elsewhere, when they came."
        )
        return out

    def markdown(self) -> str:
        su = self.setup
        lines = [
            "## Live chaos benchmark under a failure mix (`benchmarks/chaos_bench.py`)",
            "",
            f"Machine: {cpu_and_ram()}; work directory on {su.get('disk', '?')}; memory tier "
            f"on tmpfs; {datetime.date.today().isoformat()}; Python {platform.python_version()}."
            f" Command: `{' '.join(['python', 'benchmarks/chaos_bench.py', *self.command()])}`.",
            "",
            f"{self.describe()}.",
            "",
            f"The job of the live chaos benchmark above ({self.state_mib:.0f} MiB of parameters "
            "and Adam moments), under a seeded mix of failures (the same "
            "times and classes for every configuration of a seed): a process kill (SIGKILL of "
            "the job; the memory tier and the local disk survive) or a machine failure (the "
            "kill, then the job's memory folder and local directory deleted: it restarts from "
            "the durable tier, a directory standing for remote storage). coci-2level and "
            "young-2level: `cj.CheckpointManager(memory=..., durable=...)` with "
            "`coci_two_level` / `young_two_level` (level 1: memory only; level 2: memory, disk "
            "and the durable tier); coci-1level: `coci` with the local disk drained to the "
            "durable tier, no memory tier; orbax-fixed: Orbax's manager on the local disk every "
            "N steps and a second Orbax manager on the durable path every M steps (instead of "
            "the local save at those steps), N and M Young's intervals from a calibration run's "
            "save cost and the MTBF of all failures and of machine failures. The policies are "
            "told the process and machine MTBFs (coci-1level the MTBF of all failures). "
            f"Weighted: recomputed seconds weighted by hindsight progress (time_weight "
            f"{TIME_WEIGHT}). sim: the two-level `cj.sim.replay` of the run (its saves at their "
            "levels, its failures and their classes, its mean step time, each level's mean "
            "stall, each class's mean recovery, the median commit delays to memory or disk and "
            "to the durable tier).",
        ]
        for title, columns, rows in self.tables():
            lines += [
                "",
                f"{title[0].upper()}{title[1:]}:",
                "",
                "| " + " | ".join(columns) + " |",
                "|" + "---|" * len(columns),
            ]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["", "Findings (computed from the tables):", ""]
        lines += [f"- {line}" for line in self.findings()]
        return "\n".join(lines)
