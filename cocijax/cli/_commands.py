"""The commands behind ``cocijax`` (see :mod:`cocijax.cli`), imported lazily."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cocijax import _units
from cocijax.cli import POLICY_NAMES, CliError


def _stdout() -> Console:
    # Wide enough for the tables when output is piped (rich assumes 80 columns then).
    return Console(width=None if sys.stdout.isatty() else 120, highlight=False)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


# ------------------------------------------------------------------------------------- plan
class LossHistory(NamedTuple):
    """A ``step,loss`` CSV: ``steps`` as logged, ``losses`` with NaN where the cell was empty."""

    steps: np.ndarray  # shape=(n,), int64
    losses: np.ndarray  # shape=(n,), float64


def read_losses(path: str | Path) -> LossHistory:
    """Reads a CSV with a header holding a ``loss`` column (and optionally ``step``).

    Empty cells and ``nan`` are missing values (NaN). Without a ``step`` column rows count 1, 2, ...

    Raises:
      CliError: (status 2) when the file is missing, has no ``loss`` column, no rows, or a
        cell that is not a number; the message names the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise CliError(f"no such file: {path}", code=2)
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip().lower() for h in next(reader, [])]
        if "loss" not in header:
            raise CliError(f"{path}: expected a header with a 'loss' column, got {header}", 2)
        li = header.index("loss")
        si = header.index("step") if "step" in header else None
        steps, losses = [], []
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            try:
                cell = row[li].strip() if li < len(row) else ""
                losses.append(float(cell) if cell else math.nan)
                steps.append(int(float(row[si])) if si is not None else len(losses))
            except (ValueError, IndexError):
                raise CliError(f"{path}:{lineno}: not a number in row {row}", code=2) from None
    if not losses:
        raise CliError(f"{path}: no data rows", code=2)
    return LossHistory(np.asarray(steps, np.int64), np.asarray(losses, np.float64))


def _make_policy(name: str, args: argparse.Namespace, n_steps: int):
    import cocijax as cj

    ctor = getattr(cj.policies, name, None)
    if ctor is None:
        raise CliError(f"policy {name!r} is not available in this cocijax", code=2)
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
    params = inspect.signature(ctor).parameters
    return ctor(**{k: v for k, v in candidates.items() if k in params})


class PlanRow(NamedTuple):
    policy: str
    save_steps: np.ndarray  # 1-based rows after which the policy saves
    wall_overhead_s: float
    weighted_overhead_s: float


def plan_policies(history: LossHistory, names, args: argparse.Namespace) -> list[PlanRow]:
    """Runs ``cj.plan`` and ``cj.sim.simulate`` for each named policy (with a progress bar)."""
    import cocijax as cj
    from cocijax import sim

    n = len(history.losses)
    weights = sim.progress_weights(history.losses, args.time_weight)
    rows = []
    with _progress() as progress:
        task = progress.add_task("planning", total=len(names))
        for name in names:
            progress.update(task, description=f"planning {name}")
            policy = _make_policy(name, args, n)
            saves = np.asarray(
                cj.plan(
                    history.losses,
                    policy,
                    step_time_s=args.step_time,
                    checkpoint_cost_s=args.ckpt_cost,
                )
            )
            res = sim.simulate(
                saves,
                n_steps=n,
                step_time_s=args.step_time,
                checkpoint_cost_s=args.ckpt_cost,
                recovery_s=args.recovery,
                mtbf_s=args.mtbf,
                weibull_shape=args.weibull_shape,
                weights=weights,
                trials=args.trials,
                seed=args.seed,
            )
            rows.append(
                PlanRow(name, saves, float(res.wall_overhead_s), float(res.weighted_overhead_s))
            )
            progress.advance(task)
    return rows


def plan(args: argparse.Namespace) -> int:
    if args.policy == "fixed" and args.every is None:
        raise CliError("cocijax plan: error: --policy fixed needs --every N", code=2)
    if args.plot is not None and not Path(args.plot).resolve().parent.is_dir():
        raise CliError(f"cannot write --plot {args.plot}: no such directory", code=2)
    history = read_losses(args.losses)
    if args.policy == "all":
        names = [p for p in POLICY_NAMES if p != "fixed" or args.every is not None]
    else:
        names = [args.policy]
    rows = plan_policies(history, names, args)

    n = len(history.losses)
    job_s = n * args.step_time
    out = _stdout()
    shape = "Poisson" if args.weibull_shape == 1.0 else f"Weibull k={args.weibull_shape:g}"
    out.print(
        f"{args.losses}: {n} steps x {_units.format_duration(args.step_time)} = "
        f"{_units.format_duration(job_s)} job\nMTBF {_units.format_duration(args.mtbf)} "
        f"({shape}), checkpoint {_units.format_duration(args.ckpt_cost)}, recovery "
        f"{_units.format_duration(args.recovery)}, time weight {args.time_weight:g}, "
        f"{args.trials} simulated jobs per policy",
        markup=False,
    )
    table = Table(title="Expected overhead per policy (lower is better)")
    table.add_column("policy")
    table.add_column("checkpoints", justify="right")
    table.add_column("mean interval", justify="right")
    table.add_column("wall overhead", justify="right")
    table.add_column("weighted overhead", justify="right")
    best = min(r.weighted_overhead_s for r in rows)
    for r in rows:
        k = len(r.save_steps)
        interval = _units.format_duration(job_s / k) if k else "-"
        wall = f"{_units.format_duration(r.wall_overhead_s)} ({r.wall_overhead_s / job_s:.1%})"
        weighted = _units.format_duration(r.weighted_overhead_s)
        if r.weighted_overhead_s == best and len(rows) > 1:
            weighted = f"[bold]{weighted}[/bold]"
        table.add_row(r.policy, str(k), interval, wall, weighted)
    out.print(table)
    if args.plot is not None:
        plot_plan(history, rows, args.plot)
        out.print(f"wrote {args.plot}", markup=False)
    return 0


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
        color = colors[i % len(colors)]
        idx = r.save_steps.astype(int) - 1
        # The marks sit under the curve on a shared step axis, one row per policy.
        ax_marks.eventplot(x[idx], lineoffsets=n_pol - 1 - i, linelengths=0.7, colors=color)
        cum = np.zeros(len(x))
        cum[idx] = 1
        ax_cum.step(x, np.cumsum(cum), where="post", color=color, label=r.policy)
    ax_marks.set_yticks(range(n_pol), [r.policy for r in reversed(rows)], fontsize=8)
    ax_marks.set_ylim(-0.6, n_pol - 0.4)
    ax_cum.set_xlabel("step")
    ax_cum.set_ylabel("checkpoints so far")
    ax_cum.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------- ls, verify
# Layout written by cocijax.CheckpointManager: DIR/<step>/state/ holds the storage manifest
# (and, without external roots, the stripes); cocijax.torch writes DIR/<step>/cocijax.json.
STATE_ITEM = "state"
TORCH_METADATA = "cocijax.json"


class StepDir(NamedTuple):
    step: int
    path: Path
    kind: str  # "jax" (cocijax.CheckpointManager) or "torch" (cocijax.torch)


def _is_item_dir(path: Path) -> bool:
    from cocijax import storage

    return (path / storage.MANIFEST_NAME).is_file()


def find_steps(directory: str | Path) -> list[StepDir]:
    """The step directories of a cocijax checkpoint directory, oldest first.

    Raises:
      CliError: (status 2) when ``directory`` is missing or holds steps cocijax did not write.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CliError(f"no such directory: {directory}", code=2)
    steps = []
    for entry in directory.iterdir():
        if not (entry.is_dir() and entry.name.isdigit()):
            continue  # Orbax temporaries, lock, trash, stripe directories
        if (entry / STATE_ITEM).is_dir():
            steps.append(StepDir(int(entry.name), entry, "jax"))
        elif (entry / TORCH_METADATA).is_file():
            steps.append(StepDir(int(entry.name), entry, "torch"))
        else:
            raise CliError(
                f"{entry} is a step directory without a '{STATE_ITEM}' item or "
                f"{TORCH_METADATA}: {directory} was not written by cocijax",
                code=2,
            )
    return sorted(steps)


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _step_size(step: StepDir) -> int:
    """Bytes of a step, with its stripes on external roots (each directory counted once)."""
    from cocijax import storage

    size = _tree_size(step.path)
    if step.kind == "jax":
        try:
            extra = storage.referenced_stripe_dirs(step.path / STATE_ITEM)
        except (ValueError, OSError):
            extra = []
        # Stripes inside the step itself (roots=()) are not listed: _tree_size counted them.
        size += sum(_tree_size(d) for d in extra if d.is_dir())
    return size


def _step_time(step: StepDir) -> float:
    from cocijax import storage

    marker = (
        step.path / STATE_ITEM / storage.MANIFEST_NAME
        if step.kind == "jax"
        else step.path / TORCH_METADATA
    )
    return (marker if marker.exists() else step.path).stat().st_mtime


def _problems(step: StepDir) -> list:
    """``cj.storage.verify`` problems of a JAX step; ``None`` for torch steps (no checksums)."""
    from cocijax import storage

    if step.kind == "torch":
        return None
    return storage.verify(step.path / STATE_ITEM)


def ls(args: argparse.Namespace) -> int:
    import datetime

    steps = find_steps(args.directory)
    out = _stdout()
    if not steps:
        out.print(f"{args.directory}: no checkpoints", markup=False)
        return 0
    table = Table(title=escape(str(args.directory)))
    for name, justify in (
        ("step", "right"),
        ("size", "right"),
        ("time", "left"),
        ("verified", "left"),
    ):
        table.add_column(name, justify=justify)
    with _progress() as progress:
        task = progress.add_task("reading", total=len(steps))
        for st in steps:
            if args.no_verify:
                status = "-"
            else:
                problems = _problems(st)
                if problems is None:
                    status = "n/a (torch: no checksums)"
                elif problems:
                    status = f"[red]DAMAGED[/red] ({len(problems)} problem(s))"
                else:
                    status = "[green]ok[/green]"
            when = datetime.datetime.fromtimestamp(_step_time(st)).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(str(st.step), _units.format_size(_step_size(st)), when, status)
            progress.advance(task)
    out.print(table)
    return 0


def verify(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    if directory.is_dir() and _is_item_dir(directory):
        steps = [StepDir(-1, directory, "item")]  # DIR/<step>/state given directly
    else:
        steps = find_steps(directory)
        if args.step is not None:
            chosen = [s for s in steps if s.step == args.step]
            if not chosen:
                raise CliError(
                    f"no step {args.step} in {directory}; steps: {[s.step for s in steps]}", code=2
                )
            steps = chosen
        steps = [s for s in steps if s.kind != "torch"]
        if not steps:
            raise CliError(f"no cocijax checkpoint with checksums in {directory}", code=1)
    from cocijax import storage

    out = _stdout()
    bad = 0
    with _progress() as progress:
        task = progress.add_task("verifying", total=len(steps))
        for st in steps:
            item = st.path if st.kind == "item" else st.path / STATE_ITEM
            where = str(item) if st.kind == "item" else f"step {st.step}"
            for p in storage.verify(item):
                bad += 1
                # Plain print: one unwrapped line per problem, for grep and logs.
                leaf = p.leaf_path or "(no leaf)"
                print(f"{where}: leaf {leaf}, file {p.file}: {p.message}", flush=True)
            progress.advance(task)
    if bad:
        print(f"cocijax verify: {bad} problem(s) in {directory}", file=sys.stderr)
        return 1
    label = "item" if steps[0].kind == "item" else f"{len(steps)} step(s)"
    out.print(f"OK: {label} verified in {directory}", markup=False)
    return 0


# ------------------------------------------------------------------------------------ bench
def _find_write_bench() -> Path | None:
    # The benchmark lives in the source tree next to the package, not inside it.
    candidate = Path(__file__).resolve().parent.parent / "benchmarks" / "write_bench.py"
    return candidate if candidate.is_file() else None


def bench(argv: list[str]) -> int:
    path = _find_write_bench()
    if path is None:
        raise CliError(
            "the write benchmark is not available: it ships in the source tree "
            "(benchmarks/write_bench.py); run from a git checkout installed with pip install -e",
            code=1,
        )
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # for the benchmarks' shared _report module
    spec = importlib.util.spec_from_file_location("cocijax_write_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "main"):
        raise CliError(f"{path} has no main(argv) function", code=1)
    # The benchmark's argparse takes its program name from argv[0]: show how it was invoked.
    saved, sys.argv[0] = sys.argv[0], "cocijax bench"
    try:
        status = module.main(argv)
    finally:
        sys.argv[0] = saved
    return int(status or 0)
