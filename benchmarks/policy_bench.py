"""Policy benchmark: every policy on every loss curve, scored against the exact optimum.

Curves: the ten shared real curves (``../shared/loss_curves`` from the repository root, or
``--shared DIR``) and the curves this project trained itself (``benchmarks/curves``, split into
``tune`` and ``holdout`` by ``index.csv``; see its SOURCES.md). Each curve is stretched to an
8-hour job (step time = 8 h / rows). Each policy runs online through :func:`cocijax.plan` (it
sees only the history so far, and ``total_steps`` for ``coci``; ``coci no total`` does not).
Two more runs of ``coci`` are told a wrong length: 1.25 times the curve's (an exploratory job
stopped at 80% of its plan) and 0.8 times (a job that runs 25% past its plan).

**From scratch.** ``cj.plan`` tells a policy the step time and the save cost from the first step
on. A manager starting a job knows neither: its first step is not timed (compilation), and no
cost is known until a save is timed, so it saves early, after the first timed step (step 2), to
measure one. ``coci, from scratch`` (and ``coci no total, from scratch``) are the saves of the
managers' own driver on the same curve (``_policy_cases.from_scratch``): what starting from
nothing, the early save included, costs or saves against ``coci`` told everything from step 1.

Scores are weighted overheads (hindsight weights of :func:`cocijax.sim.progress_weights`,
time_weight 0.25). Scenarios A and B have Poisson failures: every schedule is scored by its
exact expectation (:func:`cocijax.sim.expected_overhead`, no sampling noise) and the bound is
the exact optimum (:func:`cocijax.sim.optimal_schedule`, dynamic programming). Scenario C has
Weibull failures (shape 0.7): schedules are scored by Monte Carlo with common random numbers,
and the bound is a heuristic (the best scale of the first-order density ``sqrt(w)``), since the
DP is optimal for Poisson failures only.

Capture = (best classic - policy) / (best classic - bound): the share of the achievable
reduction a policy gets. Not meaningful where the bound itself is within a few percent of the
best classic policy.

The bound knows every step's weight in advance, noise included: on a noisy loss the hindsight
weights come in bursts (the envelope drops when the smoothed loss happens to reach a new best),
and the optimum saves right after them. How much of the bound no online policy can reach is
shown by a reference, the **trend oracle**: the exact optimum of the weights averaged over one
Young interval (``sqrt(2 C M)``) around each step, scored on the true weights. It knows the
future's trend (a coming drop of the learning rate, a sudden phase change) but not its noise,
which is more than any policy can know from the loss so far.

The split ``fresh`` holds curves trained after every parameter of ``coci`` was fixed (see
``benchmarks/curves/SOURCES.md``).

Run: ``python benchmarks/policy_bench.py [--trials 1000] [--write]``; ``--write`` records the
tables in BENCHMARKS.md and the figure in docs/policy_bench.png. ``--two-level [--json PATH]``
runs the two-level benchmark instead (``_policy_levels``).

Here: the curves, the speed checks, the tables and the figure; ``_policy_cases`` runs and
scores one case, ``_policy_targets`` summarises the cases and checks the targets.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import statistics
import time
import zlib
from pathlib import Path

import _policy_levels
import jax
import jax.numpy as jnp
import numpy as np
from _policy_cases import SCENARIOS, TIME_WEIGHT, run_case
from _policy_targets import print_targets, summarise, targets
from _report import cpu_and_ram, write_section
from rich.console import Console
from rich.table import Table

import cocijax as cj
from cocijax.policies import _horizon

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("COCIJAX_SHARED_CURVES", ROOT.parent / "shared" / "loss_curves"))
OWN = ROOT / "benchmarks" / "curves"
DOC_PNG = ROOT / "docs" / "policy_bench.png"
SECTION = "policy_bench"


def load_curve(path: Path) -> np.ndarray:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return np.array([float(r["loss"]) if r["loss"] not in ("", None) else np.nan for r in rows])


def curves(shared: Path) -> list[tuple[str, str, np.ndarray]]:
    """``(name, set, losses)``: set is ``shared``, ``tune`` or ``holdout``."""
    out = [(p.stem, "shared", load_curve(p)) for p in sorted(shared.glob("*.csv"))]
    index = OWN / "index.csv"
    if index.is_file():
        with index.open() as f:
            for row in csv.DictReader(f):
                out.append((row["name"], row["split"], load_curve(OWN / f"{row['name']}.csv")))
    return out


def replan_ms(repeats: int = 50) -> float:
    """Median milliseconds of one coci re-plan (bins, then the backward DP), jitted, on CPU."""
    costs = _horizon.costs(1.5, 30.0, 120.0, 7200.0)

    @jax.jit
    def plan(step):
        dens = lambda s: jnp.sqrt(costs.lam * (0.25 + 4.0 * (step / s) ** 1.5) / 60.0) * 1.5
        edges, _ = _horizon.edges_for(step, 20000.0, dens)
        weights = 0.25 + 4.0 * (step / (0.5 * (edges[1:] + edges[:-1]))) ** 1.5
        return _horizon.values(
            _horizon.Plan(edges, weights, jnp.zeros_like(edges), costs), end_without_save=True
        ).values

    jax.block_until_ready(plan(100.0))
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(plan(100.0 + i))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def speed_checks() -> dict[str, float]:
    """Seconds of a 20k-step coci plan and of the 20k-step optimal schedule."""
    n = 20000
    rng = np.random.default_rng(0)
    y = 3.0 + 5.0 / np.sqrt(np.arange(1, n + 1)) + 0.05 * rng.standard_normal(n)
    pol = cj.policies.coci(7200.0, 120.0, 0.25, total_steps=n)
    cj.plan(y, pol, step_time_s=1.44, checkpoint_cost_s=30.0)  # compile
    t0 = time.perf_counter()
    cj.plan(y, pol, step_time_s=1.44, checkpoint_cost_s=30.0)
    t_plan = time.perf_counter() - t0
    w = cj.sim.progress_weights(y, TIME_WEIGHT)
    t0 = time.perf_counter()
    cj.sim.optimal_schedule(
        w, step_time_s=1.44, checkpoint_cost_s=30.0, recovery_s=120.0, mtbf_s=7200.0
    )
    return {
        "plan_20k_s": t_plan,
        "optimal_20k_s": time.perf_counter() - t0,
        "replan_ms": replan_ms(),
    }


def machine() -> str:
    return (
        f"{cpu_and_ram()}; {datetime.date.today().isoformat()}; Python "
        f"{platform.python_version()}, jax {jax.__version__}, numpy {np.__version__}"
    )


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    DOC_PNG.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, key, title in (
        (axes[0], "capture", "coci (total_steps given)"),
        (axes[1], "capture_nt", "coci without total_steps"),
    ):
        for marker, subset in (("o", "shared"), ("s", "tune"), ("^", "holdout"), ("D", "fresh")):
            for scen, color in (("A", "C0"), ("B", "C1")):
                sel = [r for r in rows if r["set"] == subset and r["scen"] == scen]
                ax.scatter(
                    [r["bound_red"] for r in sel], [np.clip(r[key], -0.5, 1.05) for r in sel],
                    marker=marker, color=color, s=22, label=f"{subset} {scen}",
                )  # fmt: skip
        ax.axhline(0.9, color="k", lw=0.5, ls="--")
        ax.axhline(0.0, color="k", lw=0.5)
        ax.set_xlabel("optimum's reduction against the best classic policy")
        ax.set_title(title)
    axes[0].set_ylabel("capture of the optimum's reduction (clipped to [-0.5, 1.05])")
    axes[0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(DOC_PNG, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000, help="Monte Carlo trials (scenario C)")
    ap.add_argument("--shared", type=Path, default=SHARED, help="the shared curves' directory")
    ap.add_argument("--curves", nargs="*", help="substrings of curve names to run")
    ap.add_argument("--write", action="store_true", help="record the tables in BENCHMARKS.md")
    ap.add_argument("--two-level", action="store_true", help="the two-level benchmark instead")
    ap.add_argument("--json", type=Path, help="--two-level: write each case to this JSON file")
    args = ap.parse_args()
    data = curves(args.shared)
    if args.curves:
        data = [c for c in data if any(s in c[0] for s in args.curves)]
    if not data:
        raise SystemExit(f"No loss curves found under {args.shared} or {OWN}.")
    console = Console(width=200)
    if args.two_level:
        return _policy_levels.report(data, console, args, machine())
    t_start = time.perf_counter()
    rows = []
    for name, subset, y in data:
        seed = zlib.crc32(name.encode())  # the same failure draws for every policy and run
        for sname, sc in SCENARIOS.items():
            rows.append(
                dict(curve=name, set=subset, scen=sname, **run_case(y, sc, args.trials, seed))
            )
            # Each case builds new policies, each compiled anew: without dropping them, the
            # compiled code of ~800 policies exceeds the process's memory maps and LLVM fails.
            jax.clear_caches()
            r = rows[-1]
            console.print(
                f"{name[:40]:40s} {subset:7s} {sname} capture {r['capture']:6.0%} "
                f"no-total {r['capture_nt']:6.0%} bound {r['bound_red']:5.1%}",
                highlight=False,
            )
    elapsed = time.perf_counter() - t_start
    speed = speed_checks()

    table = Table(title=f"policy_bench: weighted overhead (s), time_weight {TIME_WEIGHT}")
    cols = ["curve", "set", "scen", "rows", "best classic", "coci", "coci no total", "coci_paper",
            "bound", "bound red.", "capture", "capture no total", "capture told 1.25 N",
            "capture told 0.8 N", "trend oracle capture", "coci wall / young",
            "from scratch / coci", "from scratch / coci no total"]  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("curve", "set") else "right")
    pct = lambda x: f"{x:.0%}" if math.isfinite(x) else ""
    signed = lambda x: f"{x:+.2%}" if math.isfinite(x) else ""
    cells = [
        [r["curve"], r["set"], r["scen"], str(r["n"]), f"{r['classic']:.0f}",
         f"{r['res']['coci'][0]:.0f}", f"{r['res']['coci no total'][0]:.0f}",
         f"{r['res']['coci_paper'][0]:.3g}", f"{r['bound']:.0f}", f"{r['bound_red']:.1%}",
         pct(r["capture"]), pct(r["capture_nt"]), pct(r["capture_early"]),
         pct(r["capture_over"]), pct(r["capture_trend"]),
         f"{r['wall_vs_young']:.2f}", signed(r["scratch_vs_told"]),
         signed(r["scratch_vs_told_nt"])]
        for r in rows
    ]  # fmt: skip
    for row in cells:
        table.add_row(row[0][:36], *row[1:])
    console.print(table)
    groups = {
        "shared curves, A+B (the issue's targets)": (("shared",), ("A", "B")),
        "own curves, tune split, A+B": (("tune",), ("A", "B")),
        "own curves, holdout split, A+B (not in estimator tuning)": (("holdout",), ("A", "B")),
        "own curves, fresh split, A+B (trained after coci was fixed)": (("fresh",), ("A", "B")),
        "all curves, C (Weibull; heuristic bound)": (
            ("shared", "tune", "holdout", "fresh"),
            ("C",),
        ),
    }
    summaries = {k: summarise(rows, *v) for k, v in groups.items()}
    print_targets(console, summaries, targets)
    console.print(f"cases ran in {elapsed:.0f} s; {speed}")
    if not args.write:
        return
    plot(rows)
    lines = [
        "## Policy benchmark (`benchmarks/policy_bench.py`)",
        "",
        f"Machine: {machine()}.",
        f"Command: `python benchmarks/policy_bench.py --trials {args.trials} --write` "
        f"({elapsed:.0f} s for the cases).",
        "",
        "Each curve is stretched to an 8-hour job. A: MTBF 2 h, C 30 s, R 120 s (Poisson); "
        "B: MTBF 48 min, C 10 s, R 60 s (Poisson); C: as A with Weibull shape 0.7. Weighted "
        "overhead in seconds (time_weight 0.25, hindsight weights). A and B are exact "
        "expectations and their bound is the exact optimum (DP); C is Monte Carlo (common "
        "random numbers) against a heuristic bound. Capture = (best classic - policy) / "
        "(best classic - bound). `coci` gets `total_steps`; `coci no total` does not; `told "
        "1.25 N` is told a length 25% too long (a job stopped at 80% of its plan), `told 0.8 N` "
        "one 20% too short (a job that runs 25% past it). The trend "
        "oracle (A and B) is the exact optimum of the weights averaged over one Young interval: "
        "it knows the future's trend but not its noise, more than any online policy knows (see "
        "the module docstring). Split `fresh`: curves trained after every parameter of `coci` "
        "was fixed. `from scratch / coci`: the weighted overhead of `coci` as the managers' "
        "driver runs it from scratch (first step not timed, no cost known until the early save "
        "after step 2 measures it) over that of `coci` told step time and cost from step 1.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(row) + " |" for row in cells),
    ]
    for title, s in summaries.items():
        if not s:
            continue
        lines += ["", f"Targets, {title} ({s['cases']} cases):", "",
                  "| target | measured | status |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {a} | {b} | {c} |" for a, b, c in targets(s)]
    lines += [
        "",
        f"`cj.plan` of `coci` over 20,000 steps after compilation: {speed['plan_20k_s']:.2f} s; "
        f"one coci re-plan (jitted, 128 bins): {speed['replan_ms']:.2f} ms (median); "
        f"`cj.sim.optimal_schedule` of 20,000 steps: {speed['optimal_20k_s']:.2f} s.",
        "",
        "![policy benchmark](docs/policy_bench.png)",
    ]
    write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
