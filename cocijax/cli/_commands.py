"""The commands behind ``cocijax`` (see :mod:`cocijax.cli`); they import JAX when they run."""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.util
import inspect
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cocijax.cli import _units
from cocijax.cli._errors import EXIT_BAD_INPUT, EXIT_DAMAGED, EXIT_OK, CliError

# Layout written by cocijax.CheckpointManager: DIR/<step>/state/ holds the storage manifest
# (and, without external roots, the stripes); cocijax.torch writes DIR/<step>/cocijax.json.
TORCH_METADATA = "cocijax.json"


def _stdout() -> Console:
    # Wide enough for the tables when output is piped (rich assumes 80 columns then).
    return Console(width=None if sys.stdout.isatty() else 120, highlight=False)


def _progress() -> Progress:
    """A progress bar on stderr, only where someone watches it (no stray output in logs)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
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

        names = [p for p in policies.names() if p != "fixed" or args.every is not None]
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


# ------------------------------------------------------------------------------- ls, verify
class StepDir(NamedTuple):
    step: int
    path: Path
    kind: str  # "jax" (cocijax.CheckpointManager) or "torch" (cocijax.torch)


def find_steps(directory: str | Path) -> list[StepDir]:
    """The step directories of a cocijax checkpoint directory, oldest first.

    Raises:
      CliError: (status 2) when ``directory`` is missing or holds steps cocijax did not write.
    """
    from cocijax.manager._directory import STATE_ITEM

    directory = Path(directory)
    if not directory.is_dir():
        raise CliError(f"no such directory: {directory}")
    steps, foreign = [], []
    for entry in directory.iterdir():
        if not (entry.is_dir() and entry.name.isdigit()):
            # Hidden entries are cocijax's own (lock, trash, stripes, running marker);
            # Orbax's temporaries carry its marker. Anything else was put here by someone else.
            if not entry.name.startswith(".") and ".orbax-checkpoint-tmp" not in entry.name:
                foreign.append(entry.name)
            continue
        if (entry / STATE_ITEM).is_dir():
            steps.append(StepDir(int(entry.name), entry, "jax"))
        elif (entry / TORCH_METADATA).is_file():
            steps.append(StepDir(int(entry.name), entry, "torch"))
        elif entry.exists():  # else a writer deleted it meanwhile
            raise CliError(
                f"{entry} is a step directory without a '{STATE_ITEM}' item or "
                f"{TORCH_METADATA}: {directory} is not a cocijax checkpoint directory"
            )
    if not steps and foreign:
        raise CliError(
            f"{directory} is not a cocijax checkpoint directory (it holds {sorted(foreign)[:3]} "
            "and no step directories)"
        )
    return sorted(steps)


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _item(step: StepDir) -> Path:
    from cocijax.manager._directory import STATE_ITEM

    return step.path / STATE_ITEM


def _step_size(step: StepDir) -> int:
    """Bytes of a step, with its stripes on external local roots (each directory counted once;
    stripes on an object store are not listed here)."""
    from cocijax import storage

    size = _tree_size(step.path)
    if step.kind == "jax":
        try:
            extra = storage.referenced_stripe_dirs(_item(step))
        except (ValueError, OSError):
            extra = []
        # Stripes inside the step itself (roots=()) are not listed: _tree_size counted them.
        size += sum(_tree_size(d) for d in extra if isinstance(d, Path) and d.is_dir())
    return size


def _step_time(step: StepDir) -> float:
    from cocijax import storage

    marker = (
        _item(step) / storage.MANIFEST_NAME if step.kind == "jax" else step.path / TORCH_METADATA
    )
    return (marker if marker.exists() else step.path).stat().st_mtime


def _root_options(args: argparse.Namespace) -> dict[str, str] | None:
    """Kvstore options for object stores from ``--endpoint`` and ``--region``."""
    options = {}
    if args.endpoint:
        options["endpoint"] = args.endpoint
    if args.region:
        options["aws_region"] = args.region
    return options or None


# The longest the command line waits for one answer of an object store.
_STORE_TIMEOUT_S = 30.0


def _durable_root(args: argparse.Namespace):
    """The durable tier DIR names, or ``None`` for a local checkpoint directory.

    A durable tier is an ``s3://`` or ``gs://`` URL, or a local path (or ``file://`` URL) laid
    out as one: step folders holding a ``cocijax_step.json`` record (a drain in flight is a
    step folder without a manifest: not listed, not damage).
    """
    from cocijax import storage
    from cocijax.manager._tier_layout import STEP_FILES

    try:
        root = storage.KvPath.parse(args.directory, _root_options(args))
    except (TypeError, ValueError) as e:
        raise CliError(str(e)) from None
    if not root.is_local:
        return root.with_timeout(_STORE_TIMEOUT_S)
    if storage.is_url(args.directory):
        args.directory = root.key
    directory = Path(root.key)
    steps = [d for d in directory.iterdir() if d.name.isdigit()] if directory.is_dir() else []
    if steps and any((d / STEP_FILES).is_file() for d in steps):
        return root
    return None


def _durable_steps(root, step: int | None = None) -> list[int]:
    """The committed steps of a durable tier (only ``step`` when given)."""
    from cocijax.manager._tier_layout import scan

    try:
        committed, _ = scan(root.for_probe())
    except (ValueError, OSError) as e:
        raise CliError(f"cannot list {root.url}: {e}") from None
    if step is not None:
        if step not in committed:
            raise CliError(f"no step {step} in {root.url}; steps: {committed}")
        return [step]
    return committed


def _durable_row(root, step: int, check: bool) -> tuple[int, float | None, list | None]:
    """Size (files and pieces as stored in memory), commit time, and problems when checked."""
    import jax.numpy as jnp

    from cocijax import storage
    from cocijax.manager._directory import STATE_ITEM
    from cocijax.manager._tier_layout import step_files, verify_durable_step

    prefix = root / str(step)
    manifest = storage.read_manifest(prefix / STATE_ITEM)
    size = sum(
        math.prod(p.shape) * jnp.dtype(manifest.leaves[p.leaf].dtype).itemsize
        for p in manifest.pieces
    )
    size += sum(len(data or b"") for _, data, _ in step_files(prefix, step))
    try:
        meta = json.loads((prefix / "_CHECKPOINT_METADATA").read_text())
        when = meta["commit_timestamp_nsecs"] / 1e9
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        when = None
    return size, when, verify_durable_step(root, step) if check else None


def _ls_durable(args: argparse.Namespace, root) -> int:
    steps = _durable_steps(root)
    out = _stdout()
    if not steps:
        out.print(f"{root.url}: no checkpoints", markup=False)
        return EXIT_OK
    table = _step_table(root.url)
    damaged = False
    for step in steps:
        size, when, problems = _durable_row(root, step, not args.no_verify)
        damaged |= bool(problems)
        table.add_row(str(step), _units.format_size(size), _when(when), _status(problems))
    out.print(table)
    return EXIT_DAMAGED if damaged else EXIT_OK


def _step_table(title: str) -> Table:
    table = Table(title=escape(title))
    for name, justify in (("step", "right"), ("size", "right"), ("time", "left")):
        table.add_column(name, justify=justify)
    table.add_column("verified")
    return table


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def _status(problems: list | None) -> str:
    if problems is None:
        return "-"
    if problems:
        return f"[red]DAMAGED[/red] ({len(problems)} problem(s))"
    return "[green]ok[/green]"


class _DeletedMeanwhile(Exception):
    """The step's writer deleted it while it was being read (see :func:`_reading`)."""


@contextlib.contextmanager
def _reading(step: StepDir) -> Iterator[None]:
    """Turns a file of ``step`` missing while the block reads it into :class:`_DeletedMeanwhile`
    when the step's directory is gone too (else the error stands: damage).

    A writer renames a step away before it removes any of its data (Orbax's trash, and
    ``cocijax.torch``'s): a file missing from a step whose directory is gone means the step was
    deleted during the read, not that it is damaged.
    """
    try:
        yield
    except FileNotFoundError:
        if step.path.exists():
            raise
        raise _DeletedMeanwhile from None


def _problems(step: StepDir, options: dict[str, str] | None) -> list:
    """The checksum problems of a JAX step (or of an item directory given directly).

    Raises:
      _DeletedMeanwhile: the step was deleted by its writer while it was verified.
    """
    from cocijax import storage

    item = step.path if step.kind == "item" else _item(step)
    problems = storage.verify(item, root_options=options)  # a missing file is a problem
    if problems and not step.path.exists():
        raise _DeletedMeanwhile  # see _reading
    return problems


def _skipped(where: str, doing: str) -> None:
    print(f"{where}: deleted while it was {doing} (by its writer); skipped", flush=True)


def ls(args: argparse.Namespace) -> int:
    if (root := _durable_root(args)) is not None:
        return _ls_durable(args, root)
    steps = find_steps(args.directory)
    out = _stdout()
    if not steps:
        out.print(f"{args.directory}: no checkpoints", markup=False)
        return EXIT_OK
    table = _step_table(str(args.directory))
    damaged = False
    deleted = []
    options = _root_options(args)
    with _progress() as progress:
        task = progress.add_task("reading", total=len(steps))
        for st in steps:
            progress.advance(task)
            try:
                if args.no_verify:
                    status = "-"
                elif st.kind == "torch":
                    status = "n/a (torch: no checksums)"
                else:
                    problems = _problems(st, options)
                    damaged |= bool(problems)
                    status = _status(problems)
                with _reading(st):
                    size, when = _step_size(st), _step_time(st)
            except _DeletedMeanwhile:
                deleted.append(st)
                continue
            table.add_row(str(st.step), _units.format_size(size), _when(when), status)
    out.print(table)
    for st in deleted:
        _skipped(f"step {st.step}", "listed")
    return EXIT_DAMAGED if damaged else EXIT_OK


def _verify_durable(args: argparse.Namespace, root) -> int:
    from cocijax.manager._tier_layout import verify_durable_step

    steps = _durable_steps(root, args.step)
    bad = 0
    for step in steps:
        for p in verify_durable_step(root, step):
            bad += 1
            leaf = p.leaf_path or "(no leaf)"
            print(f"step {step}: leaf {leaf}, file {p.file}: {p.what}", flush=True)
    if bad:
        print(f"cocijax verify: {bad} problem(s) in {root.url}", file=sys.stderr)
        return EXIT_DAMAGED
    what = f"OK: {len(steps)} step(s) verified in" if steps else "no checkpoints in"
    _stdout().print(f"{what} {root.url}", markup=False)
    return EXIT_OK


def verify(args: argparse.Namespace) -> int:
    from cocijax import storage

    if (root := _durable_root(args)) is not None:
        return _verify_durable(args, root)
    directory = Path(args.directory)
    options = _root_options(args)
    if directory.is_dir() and (directory / storage.MANIFEST_NAME).is_file():
        steps = [StepDir(-1, directory, "item")]  # DIR/<step>/state given directly
    else:
        steps = find_steps(directory)
        if args.step is not None:
            steps = [s for s in steps if s.step == args.step]
            if not steps:
                raise CliError(
                    f"no step {args.step} in {directory}; steps: "
                    f"{[s.step for s in find_steps(directory)]}"
                )
    out = _stdout()
    torch_steps = [s.step for s in steps if s.kind == "torch"]
    steps = [s for s in steps if s.kind != "torch"]
    bad = 0
    deleted = []
    with _progress() as progress:
        task = progress.add_task("verifying", total=len(steps))
        for st in steps:
            where = str(st.path) if st.kind == "item" else f"step {st.step}"
            try:
                problems = _problems(st, options)
            except _DeletedMeanwhile:
                deleted.append(st)
                _skipped(where, "verified")
                problems = []
            for p in problems:
                bad += 1
                # One unwrapped line per problem (for grep and logs): leaf, file, what.
                leaf = p.leaf_path or "(no leaf)"
                print(f"{where}: leaf {leaf}, file {p.file}: {p.what}", flush=True)
            progress.advance(task)
    steps = [s for s in steps if s not in deleted]
    if torch_steps:
        out.print(f"steps {torch_steps}: PyTorch checkpoints have no checksums", markup=False)
    if bad:
        print(f"cocijax verify: {bad} problem(s) in {directory}", file=sys.stderr)
        return EXIT_DAMAGED
    if not steps:
        if not torch_steps:
            out.print(f"{directory}: no checkpoints", markup=False)
        return EXIT_OK
    label = "item" if steps[0].kind == "item" else f"{len(steps)} step(s)"
    out.print(f"OK: {label} verified in {directory}", markup=False)
    return EXIT_OK


# ------------------------------------------------------------------------------------ bench
def _find_write_bench() -> Path | None:
    # The benchmark lives in the source tree next to the package, not inside it.
    candidate = Path(__file__).resolve().parents[2] / "benchmarks" / "write_bench.py"
    return candidate if candidate.is_file() else None


def bench(argv: list[str]) -> int:
    path = _find_write_bench()
    if path is None:
        raise CliError(
            "the write benchmark is not available: it ships in the source tree "
            "(benchmarks/write_bench.py); run from a git checkout installed with pip install -e",
            code=EXIT_BAD_INPUT,
        )
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # for the benchmarks' shared _report module
    spec = importlib.util.spec_from_file_location("cocijax_write_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The benchmark's argparse takes its program name from argv[0]: show how it was invoked.
    saved, sys.argv[0] = sys.argv[0], "cocijax bench"
    try:
        status = module.main(argv)
    finally:
        sys.argv[0] = saved
    return int(status or 0)
