"""``cocijax plan``: the saves each policy would take on a loss curve, and what they cost."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import inspect
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
from rich.table import Table

from cocijax.cli import _units
from cocijax.cli._console import _progress, _stdout
from cocijax.cli._errors import EXIT_OK, CliError


class LossHistory(NamedTuple):
    """A ``step,loss`` CSV: ``steps`` as logged, ``losses`` with NaN where the cell was empty."""

    steps: np.ndarray  # shape=(n,), int64
    losses: np.ndarray  # shape=(n,), float64


def read_losses(path: str | Path) -> LossHistory:
    """Reads a CSV with a header holding a ``loss`` column (and optionally ``step``).

    Empty cells and ``nan`` are missing values (NaN). Without a ``step`` column rows count 1, 2, ...

    Raises:
      CliError: (status 2) when the file is missing or a directory, is not text, has no
        ``loss`` column, no rows, or a cell that is not a number; the message names the file
        (and line).
    """
    path = Path(path)
    if path.is_dir():
        raise CliError(
            f"{path} is a directory: plan expects a CSV file of losses (a header with a 'loss' "
            "column); 'cocijax ls' and 'cocijax verify' take checkpoint directories"
        )
    if not path.is_file():
        raise CliError(f"no such file: {path}")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        raise CliError(f"{path}: not a CSV text file ({e.__class__.__name__})") from None
    header = [h.strip().lower() for h in (rows[0] if rows else [])]
    if "loss" not in header:
        raise CliError(f"{path}: expected a header with a 'loss' column, got {header}")
    li = header.index("loss")
    si = header.index("step") if "step" in header else None
    steps, losses = [], []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        try:
            cell = row[li].strip() if li < len(row) else ""
            losses.append(float(cell) if cell else math.nan)
            steps.append(int(float(row[si])) if si is not None else len(losses))
        except (ValueError, IndexError):
            raise CliError(f"{path}:{lineno}: not a number in row {row}") from None
    if not losses:
        raise CliError(f"{path}: no data rows")
    return LossHistory(np.asarray(steps, np.int64), np.asarray(losses, np.float64))


def make_policy(name: str, args: argparse.Namespace, n_steps: int):
    """The policy ``name`` from the registry, given the arguments of ``plan`` it takes."""
    from cocijax import policies

    candidates = {
        "mtbf_s": args.mtbf,
        "recovery_s": args.recovery,
        "time_weight": args.time_weight,
        "total_steps": n_steps,
        "max_overhead": args.max_overhead,
        "every": args.every,
        # The stall is known here, so it also serves as the prior before the first "save".
        "cost_prior_s": args.ckpt_cost,
    }
    params = inspect.signature(getattr(policies, name)).parameters
    return policies.by_name(name, **{k: v for k, v in candidates.items() if k in params})


class PlanRow(NamedTuple):
    policy: str
    save_steps: np.ndarray  # 1-based rows after which the policy saves
    wall_overhead_s: float
    weighted_overhead_s: float
    finished: float  # fraction of simulated jobs that finished (see cj.sim.SimResult)


OPTIMAL = "hindsight optimum (weighted)"
# What the columns of the plan table mean, and what the hindsight optimum minimises: it can
# lose more wall time than a policy, which looks wrong unless said (found by a user review).
LEGEND = (
    "wall overhead: expected time lost to saves, redone steps and restarts (share of the job)",
    "weighted overhead: the same, each redone step weighted by the loss progress it made (mean 1)",
    "hindsight optimum: least weighted overhead, knowing the whole curve; its wall overhead may "
    "be higher",
)


def plan_policies(history: LossHistory, names, args: argparse.Namespace) -> list[PlanRow]:
    """Plans and simulates each named policy, then the exact optimum (Poisson failures only)."""
    import cocijax as cj

    n = len(history.losses)
    weights = cj.sim.progress_weights(history.losses, args.time_weight)
    job = dict(
        n_steps=n,
        step_time_s=args.step_time,
        checkpoint_cost_s=args.ckpt_cost,
        recovery_s=args.recovery,
        mtbf_s=args.mtbf,
    )

    def score(name: str, saves: np.ndarray) -> PlanRow:
        res = cj.sim.simulate(
            saves,
            weibull_shape=args.weibull_shape,
            weights=weights,
            trials=args.trials,
            seed=args.seed,
            **job,
        )
        return PlanRow(
            name, saves, res.wall_overhead_s, res.weighted_overhead_s, float(res.finished)
        )

    rows = []
    with _progress() as progress:
        task = progress.add_task("planning", total=len(names) + 1)
        for name in names:
            progress.update(task, description=f"planning {name}")
            policy = make_policy(name, args, n)
            saves = np.asarray(
                cj.plan(
                    history.losses,
                    policy,
                    step_time_s=args.step_time,
                    checkpoint_cost_s=args.ckpt_cost,
                )
            )
            rows.append(score(name, saves))
            progress.advance(task)
        if args.weibull_shape == 1.0:
            progress.update(task, description="optimal schedule")
            kw = {k: job[k] for k in ("step_time_s", "checkpoint_cost_s", "recovery_s", "mtbf_s")}
            rows.append(score(OPTIMAL, cj.sim.optimal_schedule(weights, **kw)))
        progress.advance(task)
    return rows


def plan(args: argparse.Namespace) -> int:
    if args.policy == "fixed" and args.every is None:
        raise CliError("cocijax plan: error: --policy fixed needs --every N")
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise CliError(
                "--plot needs matplotlib, which is not installed: pip install 'cocijax[plot]'"
            )
        if not Path(args.plot).resolve().parent.is_dir():
            raise CliError(f"cannot write --plot {args.plot}: no such directory")
    history = read_losses(args.losses)
    if args.policy == "all":
        from cocijax import policies

        names = [p for p in policies.names(levels=1) if p != "fixed" or args.every is not None]
    else:
        names = [args.policy]
    rows = plan_policies(history, names, args)

    n = len(history.losses)
    job_s = n * args.step_time
    out = _stdout()
    shape = "Poisson" if args.weibull_shape == 1.0 else f"Weibull k={args.weibull_shape:g}"
    fmt = _units.format_duration
    out.print(
        f"{args.losses}: {n} steps x {fmt(args.step_time)} = {fmt(job_s)} job\n"
        f"MTBF {fmt(args.mtbf)} ({shape}), checkpoint {fmt(args.ckpt_cost)}, recovery "
        f"{fmt(args.recovery)}, time weight {args.time_weight:g}, {args.trials} simulated "
        "jobs per policy",
        markup=False,
    )
    table = Table(title="Expected overhead per policy (lower is better)")
    for col, justify in (
        ("policy", "left"),
        ("checkpoints", "right"),
        ("mean interval", "right"),
        ("wall overhead", "right"),
        ("weighted overhead", "right"),
    ):
        table.add_column(col, justify=justify)
    finishing = [r.weighted_overhead_s for r in rows if r.finished == 1.0 and r.policy != OPTIMAL]
    best = min(finishing, default=math.nan)
    for r in rows:
        k = len(r.save_steps)
        interval = fmt(job_s / k) if k else "-"
        if r.finished < 1.0:
            # Abandoned jobs would only show a lower bound: say what it means instead.
            wall = weighted = f"cannot finish ({r.finished:.0%} of jobs did)"
        else:
            wall = f"{fmt(r.wall_overhead_s)} ({r.wall_overhead_s / job_s:.1%})"
            weighted = fmt(r.weighted_overhead_s)
            if r.weighted_overhead_s == best and len(finishing) > 1:
                weighted = f"[bold]{weighted}[/bold]"
        table.add_row(r.policy, str(k), interval, wall, weighted)
    out.print(table)
    legend = LEGEND if any(r.policy == OPTIMAL for r in rows) else LEGEND[:2]
    out.print("\n".join(legend), markup=False)
    if any(r.finished < 1.0 for r in rows):
        out.print(
            "A schedule that cannot finish needs about exp(segment / MTBF) restarts per "
            "segment: at this failure rate it must save more often.",
            markup=False,
        )
    if args.weibull_shape != 1.0:
        out.print("(no optimal row: the exact optimum is computed for Poisson failures only)")
    if args.plot is not None:
        plot_plan(history, rows, args.plot)
        out.print(f"wrote {args.plot}", markup=False)
    return EXIT_OK


def plot_plan(history: LossHistory, rows: list[PlanRow], path: str) -> None:
    """Loss curve with each policy's checkpoint marks, and cumulative checkpoints per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_pol = len(rows)
    fig, (ax_loss, ax_marks, ax_cum) = plt.subplots(
        3,
        1,
        figsize=(9, 8),
        sharex=True,
        gridspec_kw={"height_ratios": [3, 0.35 * n_pol + 0.5, 2]},
    )
    x = history.steps
    ok = np.isfinite(history.losses)
    ax_loss.plot(x[ok], history.losses[ok], color="0.25", lw=1.2)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("Loss, checkpoints of each policy, and checkpoints so far")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(rows):
        color = "k" if r.policy == OPTIMAL else colors[i % len(colors)]
        idx = r.save_steps.astype(int) - 1
        # The marks sit under the curve on a shared step axis, one row per policy.
        ax_marks.eventplot(x[idx], lineoffsets=n_pol - 1 - i, linelengths=0.7, colors=color)
        cum = np.zeros(len(x))
        cum[idx] = 1
        style = "--" if r.policy == OPTIMAL else "-"
        ax_cum.step(x, np.cumsum(cum), style, where="post", color=color, label=r.policy)
    ax_marks.set_yticks(range(n_pol), [r.policy for r in reversed(rows)], fontsize=8)
    ax_marks.set_ylim(-0.6, n_pol - 0.4)
    ax_cum.set_xlabel("step")
    ax_cum.set_ylabel("checkpoints so far")
    ax_cum.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
