"""Policy benchmark: every policy on every shared loss curve, scored by the simulator.

Each curve of ``../shared/loss_curves`` (relative to the repository root) is stretched to an
8-hour job (step time = 8 h / rows). Each policy runs online through :func:`cocijax.plan` (it sees
only the history so far, and ``total_steps`` for ``coci``), and its schedule is scored by
:func:`cocijax.sim.simulate` with the hindsight weights of
:func:`cocijax.sim.progress_weights` (time_weight 0.25) and the same failure draws for every
policy (common random numbers). The hindsight bound is the best scale factor of the optimal
density shape ``sqrt(lambda w / 2C)`` computed from the whole curve.

Run: ``python benchmarks/policy_bench.py [--trials 1000] [--no-write]``. Prints a table,
rewrites the ``policy_bench`` section of BENCHMARKS.md, writes plots to ``benchmarks/out/`` and
``docs/policy_bench.png``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import platform
import statistics
import subprocess
import time
import zlib
from pathlib import Path

import jax
import numpy as np
from _report import cpu_and_ram, write_section
from rich.console import Console
from rich.table import Table

import cocijax as cj
from cocijax.policies import _convergence

ROOT = Path(__file__).resolve().parents[1]
CURVES = ROOT.parent / "shared" / "loss_curves"
OUT = ROOT / "benchmarks" / "out"
DOC_PNG = ROOT / "docs" / "policy_bench.png"
SECTION = "policy_bench"
JOB_S = 8 * 3600.0
TIME_WEIGHT = 0.25
SCENARIOS = {
    "A": dict(mtbf_s=7200.0, checkpoint_cost_s=30.0, recovery_s=120.0, weibull_shape=1.0),
    "B": dict(mtbf_s=2880.0, checkpoint_cost_s=10.0, recovery_s=60.0, weibull_shape=1.0),
    "C": dict(mtbf_s=7200.0, checkpoint_cost_s=30.0, recovery_s=120.0, weibull_shape=0.7),
}
CLASSIC = ("young", "daly", "checkfreq")
SCALES = np.geomspace(0.25, 4.0, 41)


def load_curve(path: Path) -> np.ndarray:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return np.array([float(r["loss"]) if r["loss"] not in ("", None) else np.nan for r in rows])


def policies_for(n: int, sc: dict) -> dict[str, cj.policies.Policy]:
    m, r = sc["mtbf_s"], sc["recovery_s"]
    return {
        "young": cj.policies.young(m),
        "daly": cj.policies.daly(m),
        "checkfreq": cj.policies.checkfreq(0.05),
        "coci_paper": cj.policies.coci_paper(m),
        "coci": cj.policies.coci(m, r, TIME_WEIGHT, total_steps=n),
        "coci_no_total": cj.policies.coci(m, r, TIME_WEIGHT),
    }


def density_schedule(density: np.ndarray, tau: float, scale: float) -> np.ndarray:
    """Save steps where the integral of ``scale * density`` since the last save reaches 1."""
    steps, acc = [], 0.0
    for i, d in enumerate(scale * density * tau):
        acc += d
        if acc >= 1.0 - 0.5 * d:
            steps.append(i + 1)
            acc = 0.0
    return np.asarray(steps, np.int64)


def run_case(y, sc, trials, seed):
    n = y.size
    tau = JOB_S / n
    w = cj.sim.progress_weights(y, TIME_WEIGHT)
    sim_kw = dict(
        n_steps=n,
        step_time_s=tau,
        checkpoint_cost_s=sc["checkpoint_cost_s"],
        recovery_s=sc["recovery_s"],
        mtbf_s=sc["mtbf_s"],
        weibull_shape=sc["weibull_shape"],
        weights=w,
        trials=trials,
        seed=seed,
    )
    res, sched = {}, {}
    for name, pol in policies_for(n, sc).items():
        s = cj.plan(y, pol, step_time_s=tau, checkpoint_cost_s=sc["checkpoint_cost_s"])
        sched[name] = s
        res[name] = cj.sim.simulate(s, **sim_kw)
    dens = np.sqrt(w / (2.0 * sc["checkpoint_cost_s"] * sc["mtbf_s"]))
    best = None
    for a in SCALES:
        s = density_schedule(dens, tau, a)
        r = cj.sim.simulate(s, **sim_kw)
        if best is None or r.weighted_overhead_s < best[1].weighted_overhead_s:
            best = (s, r)
    sched["hindsight"], res["hindsight"] = best
    return res, sched, w


FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75)
NOTE = (
    "Notes: `coci_paper` follows the COCI artifact, whose loss decrement `pc` is in minutes "
    "but compared with the loss, so on these curves it plans few or no saves after its first "
    "fit and its overhead is off the scale: beating it says little. Capture is not "
    "meaningful where the bound's own reduction is near 0 (resnet50, B). The hindsight bound "
    "picks its scale factor on the same draws it is scored on, so it is slightly optimistic. "
    "Standard errors (±) are of the mean overhead; differences between policies are much "
    "tighter thanks to the common random numbers."
)


def forecast_errors(y: np.ndarray) -> list[float]:
    """Error of the forecast drop still to come, as a fraction of the curve's whole drop.

    At each fraction f of the job the convergence model is fitted on the first f n points (as
    ``coci`` does online) and its forecast drop to step n is compared with the true drop of the
    hindsight envelope (centred moving average, best so far). Negative = too little forecast.
    """
    n = y.size
    h = max(3, n // 200)
    ok = np.isfinite(y)
    cs = np.concatenate([[0.0], np.cumsum(np.where(ok, y, 0.0))])
    cc = np.concatenate([[0], np.cumsum(ok)])
    lo, hi = np.clip(np.arange(n) - h, 0, n), np.clip(np.arange(n) + h + 1, 0, n)
    env = np.minimum.accumulate((cs[hi] - cs[lo]) / np.maximum(cc[hi] - cc[lo], 1))
    out = []
    for f in FRACTIONS:
        m = max(8, int(f * n))
        fit = _convergence.fit_points(np.arange(1, m + 1), y[:m])
        pred = (
            float(_convergence.predict(fit, m) - _convergence.predict(fit, n))
            if bool(fit.ok)
            else 0.0
        )
        out.append((pred - (env[m - 1] - env[-1])) / (env[0] - env[-1]))
    return out


def update_cost_us(calls: int = 2000) -> dict[str, float]:
    """Median wall time of one jitted ``update`` call, eagerly dispatched as in training."""
    out = {}
    for name, pol in {
        "young": cj.policies.young(7200.0),
        "coci": cj.policies.coci(7200.0, 120.0, 0.25, total_steps=20000),
        "coci_paper": cj.policies.coci_paper(7200.0),
    }.items():
        upd = jax.jit(pol.update)
        st = pol.init()
        rng = np.random.default_rng(0)
        times = []
        for s in range(1, calls + 1):
            loss = float(3.0 + 5.0 / math.sqrt(s) + 0.05 * rng.standard_normal())
            t0 = time.perf_counter()
            save, st = upd(st, step=s, loss=loss, step_time_s=1.0, checkpoint_cost_s=30.0)
            bool(save)  # the caller needs the decision: include the device-to-host sync
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[100:]) * 1e6
    return out


def speed_checks() -> dict[str, float]:
    """Seconds for a 20k-step plan (after compilation) and a 1000-trial x 20k-step simulation."""
    n = 20000
    rng = np.random.default_rng(0)
    y = 3.0 + 5.0 / np.sqrt(np.arange(1, n + 1)) + 0.05 * rng.standard_normal(n)
    pol = cj.policies.coci(7200.0, 120.0, 0.25, total_steps=n)
    cj.plan(y, pol, step_time_s=1.44, checkpoint_cost_s=30.0)  # compile
    t0 = time.perf_counter()
    steps = cj.plan(y, pol, step_time_s=1.44, checkpoint_cost_s=30.0)
    t_plan = time.perf_counter() - t0
    w = cj.sim.progress_weights(y, TIME_WEIGHT)
    t0 = time.perf_counter()
    cj.sim.simulate(
        steps,
        n_steps=n,
        step_time_s=1.44,
        checkpoint_cost_s=30.0,
        recovery_s=120.0,
        mtbf_s=2880.0,
        weights=w,
        trials=1000,
        seed=0,
    )
    t_sim = time.perf_counter() - t0
    return {"plan_20k_s": t_plan, "simulate_1000x20k_s": t_sim}


def machine() -> str:
    try:
        fs = (
            subprocess.run(["df", "-T", str(ROOT)], capture_output=True, text=True, check=False)
            .stdout.splitlines()[-1]
            .split()[1]
        )
    except (OSError, IndexError):
        fs = "?"
    return (
        f"{cpu_and_ram()}, filesystem {fs}; "
        f"{datetime.date.today().isoformat()}; Python {platform.python_version()}, "
        f"jax {jax.__version__}, numpy {np.__version__}"
    )


def plot(cases, marks_case) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    DOC_PNG.parent.mkdir(parents=True, exist_ok=True)
    names = ["young", "daly", "checkfreq", "coci_paper", "coci", "hindsight"]
    fig = plt.figure(figsize=(15, 6))
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1], width_ratios=[1, 1.3])
    curve, scen, y, sched = marks_case
    hours = np.arange(1, y.size + 1) * JOB_S / y.size / 3600.0
    ax = fig.add_subplot(grid[0, 0])
    ax.plot(hours, y, lw=0.6, color="0.4")
    ax.set_ylim(np.nanpercentile(y, 0.5), np.nanpercentile(y, 99.5))
    ax.set_ylabel("loss")
    ax.set_title(f"{curve}, scenario {scen}")
    marks = fig.add_subplot(grid[1, 0], sharex=ax)
    for i, name in enumerate(names):
        s = sched[name]
        marks.plot(hours[s - 1], np.full(s.size, i), "|", ms=9)
    marks.set_yticks(range(len(names)), names, fontsize=7)
    marks.set_xlabel("hours (checkpoint marks per policy)")
    bars = fig.add_subplot(grid[:, 1])
    labels = [f"{c[:16]}/{s}" for c, s, _ in cases]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ratio = [
            r[name].weighted_overhead_s / min(r[k].weighted_overhead_s for k in CLASSIC)
            for _, _, r in cases
        ]
        bars.bar(np.arange(len(cases)) + i * width, ratio, width, label=name)
    bars.axhline(1.0, color="k", lw=0.5)
    bars.set_ylim(0.5, 1.3)
    bars.set_xticks(np.arange(len(cases)) + 0.4, labels, rotation=90, fontsize=6)
    bars.set_ylabel("weighted overhead / best of young, daly, checkfreq (coci_paper off scale)")
    bars.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(OUT / "policy_bench.png", dpi=110)
    fig.savefig(DOC_PNG, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--curves", nargs="*", help="substrings of curve names to run")
    args = ap.parse_args()
    paths = sorted(CURVES.glob("*.csv"))
    if args.curves:
        paths = [p for p in paths if any(c in p.name for c in args.curves)]
    if not paths:
        raise SystemExit(f"No loss curves found under {CURVES}.")
    console = Console(width=180)
    t_start = time.perf_counter()
    cases, best_case, rows, fc_rows = [], None, [], []
    for path in paths:
        # The failure draws depend on the curve only: the same for every policy and every run.
        seed = zlib.crc32(path.stem.encode())
        y = load_curve(path)
        for sname, sc in SCENARIOS.items():
            res, sched, _ = run_case(y, sc, args.trials, seed)
            cases.append((path.stem, sname, res))
            classic = min(res[k].weighted_overhead_s for k in CLASSIC)
            red = 1.0 - res["coci"].weighted_overhead_s / classic
            hred = 1.0 - res["hindsight"].weighted_overhead_s / classic
            row = dict(
                curve=path.stem,
                scen=sname,
                n=y.size,
                classic=classic,
                coci=res["coci"].weighted_overhead_s,
                nototal=res["coci_no_total"].weighted_overhead_s,
                paper=res["coci_paper"].weighted_overhead_s,
                hind=res["hindsight"].weighted_overhead_s,
                red=red,
                hred=hred,
                capture=red / hred if hred > 0 else float("nan"),
                wall=res["coci"].wall_overhead_s / res["young"].wall_overhead_s,
                se=res["coci"].weighted_overhead_se,
                saves=len(sched["coci"]),
                hsaves=len(sched["hindsight"]),
            )
            rows.append(row)
            # The marks plot shows the longest curve (per-step, most detail), scenario A.
            if sname == "A" and (best_case is None or y.size > best_case[0]):
                best_case = (y.size, (path.stem, sname, y, sched))
        row_fc = forecast_errors(y)
        fc_rows.append((path.stem, row_fc))
    elapsed = time.perf_counter() - t_start
    cost = update_cost_us()
    speed = speed_checks()

    table = Table(
        title=f"policy_bench: weighted overhead (s), time_weight {TIME_WEIGHT}, "
        f"{args.trials} trials"
    )
    for col in (
        "curve",
        "scen",
        "rows",
        "best classic",
        "coci",
        "coci no total",
        "coci_paper",
        "hindsight",
        "coci red.",
        "bound red.",
        "capture",
        "wall/young",
        "saves c/h",
    ):
        table.add_column(col, justify="right" if col not in ("curve",) else "left")
    for r in rows:
        table.add_row(
            r["curve"][:34],
            r["scen"],
            str(r["n"]),
            f"{r['classic']:.0f}",
            f"{r['coci']:.0f}",
            f"{r['nototal']:.0f}",
            f"{r['paper']:.0f}",
            f"{r['hind']:.0f}",
            f"{100 * r['red']:.1f}%",
            f"{100 * r['hred']:.1f}%",
            f"{100 * r['capture']:.0f}%",
            f"{r['wall']:.2f}",
            f"{r['saves']}/{r['hsaves']}",
        )
    console.print(table)

    reds = [r["red"] for r in rows]
    reds_ab = [r["red"] for r in rows if r["scen"] in ("A", "B")]
    hreds_ab = [r["hred"] for r in rows if r["scen"] in ("A", "B")]
    caps = [r["capture"] for r in rows if math.isfinite(r["capture"])]
    walls = [r["wall"] for r in rows]
    beat_paper = sum(r["coci"] < r["paper"] for r in rows)
    us = cost["coci"]
    ok = lambda b: "met" if b else "NOT met"
    targets = [
        (
            "median reduction vs best classic >= 15%",
            f"{100 * statistics.median(reds):.1f}%",
            ok(statistics.median(reds) >= 0.15),
        ),
        # The issue requires scenarios A and B; C (Weibull) is an addition, so report both.
        (
            "  same, scenarios A+B only",
            f"{100 * statistics.median(reds_ab):.1f}% "
            f"(bound {100 * statistics.median(hreds_ab):.1f}%)",
            ok(statistics.median(reds_ab) >= 0.15),
        ),
        ("best reduction >= 25%", f"{100 * max(reds):.1f}%", ok(max(reds) >= 0.25)),
        ("no case worse by more than 5%", f"worst {100 * min(reds):.1f}%", ok(min(reds) >= -0.05)),
        (
            "median capture of the hindsight reduction >= 70%",
            f"{100 * statistics.median(caps):.0f}%",
            ok(statistics.median(caps) >= 0.70),
        ),
        (
            "wall overhead <= 1.4x Young's in every case",
            f"max {max(walls):.2f}x",
            ok(max(walls) <= 1.4),
        ),
        (
            "lower weighted overhead than coci_paper in most cases",
            f"{beat_paper}/{len(rows)}",
            ok(beat_paper > len(rows) / 2),
        ),
        ("update <= 200 us per call after jit", f"{us:.0f} us", ok(us <= 200)),
    ]
    summary = Table(title="targets")
    for col in ("target", "measured", "status"):
        summary.add_column(col)
    for t in targets:
        summary.add_row(*t)
    console.print(summary)
    fc = Table(title="forecast error of the drop still to come / whole drop, at fraction of job")
    fc.add_column("curve")
    for f in FRACTIONS:
        fc.add_column(f"{f:g}", justify="right")
    for name, errs in fc_rows:
        fc.add_row(name[:34], *(f"{e:+.2f}" for e in errs))
    med = np.median(np.abs([e for _, e in fc_rows]), axis=0)
    fc.add_row("median |error|", *(f"{e:.2f}" for e in med))
    console.print(fc)
    console.print(f"update cost (median us/call): {cost}; cases ran in {elapsed:.0f} s; {speed}")

    if args.no_write:
        return
    plot([(c, s, r) for c, s, r in cases], best_case[1])
    lines = [
        "## Policy benchmark (`benchmarks/policy_bench.py`)",
        "",
        f"Machine: {machine()}.",
        f"Command: `python benchmarks/policy_bench.py --trials {args.trials}` "
        f"({elapsed:.0f} s for the cases).",
        "",
        "Each curve of `../shared/loss_curves` is stretched to an 8-hour job; scenarios "
        "A: MTBF 2 h, C 30 s, R 120 s (Poisson); B: MTBF 48 min, C 10 s, R 60 s (Poisson); "
        "C: as A with Weibull shape 0.7. Weighted overhead in seconds (time_weight 0.25, "
        "hindsight weights), mean over the same failure draws for every policy. "
        "`coci` gets `total_steps`; `coci no total` does not. Reductions are against the best "
        "of young/daly/checkfreq per case; capture = coci reduction / hindsight-bound reduction.",
        "",
        "| curve | scen | rows | best classic | coci | coci no total | coci_paper | hindsight "
        "| coci red. | bound red. | capture | coci wall / young wall | saves coci/bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['curve']} | {r['scen']} | {r['n']} | {r['classic']:.0f} | {r['coci']:.0f} "
            f"± {r['se']:.0f} | {r['nototal']:.0f} | {r['paper']:.0f} | {r['hind']:.0f} "
            f"| {100 * r['red']:.1f}% | {100 * r['hred']:.1f}% | {100 * r['capture']:.0f}% "
            f"| {r['wall']:.2f} | {r['saves']}/{r['hsaves']} |"
        )
    lines += ["", NOTE]
    lines += [
        "",
        "Targets (issue 2), `coci(time_weight=0.25, total_steps=n)`:",
        "",
        "| target | measured | status |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in targets]
    lines += [
        "",
        "Forecast error of the convergence model (forecast drop still to come minus "
        "the hindsight drop, over the whole drop; fitted on the first f of the curve, "
        "negative = too little):",
        "",
        "| curve | " + " | ".join(f"f={f:g}" for f in FRACTIONS) + " |",
        "|---|" + "---|" * len(FRACTIONS),
    ]
    lines += [
        f"| {name} | " + " | ".join(f"{e:+.2f}" for e in errs) + " |" for name, errs in fc_rows
    ]
    lines += ["| median abs | " + " | ".join(f"{e:.2f}" for e in med) + " |"]
    lines += [
        "",
        "`update` cost, median of 1900 jitted eager calls incl. the host sync: "
        + ", ".join(f"{k} {v:.0f} µs" for k, v in cost.items())
        + ".",
        "",
        f"`cj.plan` of `coci` over 20,000 steps after compilation: "
        f"{speed['plan_20k_s']:.3f} s; `cj.sim.simulate`, 1000 trials x 20,000 steps "
        f"(MTBF 48 min): {speed['simulate_1000x20k_s']:.2f} s.",
        "",
        "![policy benchmark](docs/policy_bench.png)",
    ]
    write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
