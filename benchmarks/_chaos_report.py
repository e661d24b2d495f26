"""The chaos benchmark's report: its tables (printed, and for BENCHMARKS.md), targets and figure."""

from __future__ import annotations

import datetime
import math
import platform
import statistics
from pathlib import Path

import numpy as np
from _chaos_runs import CONFIGS, PHASES, TIME_WEIGHT, Result
from _report import cpu_and_ram
from rich.console import Console
from rich.table import Table

import cocijax as cj

SIM_TOLERANCE = 0.15


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
