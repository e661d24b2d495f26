"""``cocijax ls`` and ``cocijax verify``: what a checkpoint directory or durable tier holds."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from rich.markup import escape
from rich.table import Table

from cocijax.cli import _units
from cocijax.cli._console import _progress, _stdout
from cocijax.cli._errors import EXIT_DAMAGED, EXIT_OK, CliError

# Layout written by cocijax.CheckpointManager: DIR/<step>/state/ holds the storage manifest
# (and, without external roots, the stripes); cocijax.torch writes DIR/<step>/cocijax.json.
TORCH_METADATA = "cocijax.json"


class StepDir(NamedTuple):
    step: int
    path: Path
    kind: str  # "jax" (cocijax.CheckpointManager), "torch" (cocijax.torch) or "orbax"


def find_steps(directory: str | Path) -> list[StepDir]:
    """The step directories of a cocijax checkpoint directory, oldest first.

    Raises:
      CliError: (status 2) when ``directory`` is missing or holds steps cocijax did not write.
    """
    from cocijax.manager._directory import STATE_ITEM
    from cocijax.manager._orbax_steps import find_orbax_step

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
        if find_orbax_step(entry) is not None:  # Orbax's own manager wrote it (a ported job)
            steps.append(StepDir(int(entry.name), entry, "orbax"))
        elif (entry / STATE_ITEM).is_dir():
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


# Steps without cocijax's checksums, and why.
_UNCHECKED = {"torch": "PyTorch checkpoints have no checksums", "orbax": "written by Orbax"}


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _item(step: StepDir) -> Path:
    from cocijax.manager._directory import STATE_ITEM

    return step.path / STATE_ITEM


def _step_size(step: StepDir) -> int:
    """Bytes of a step, with its stripes on external local roots (each directory counted once;
    stripes on an object store are not listed here)."""
    from cocijax.storage._stripes import referenced_stripe_dirs

    size = _tree_size(step.path)
    if step.kind == "jax":
        try:
            extra = referenced_stripe_dirs(_item(step))
        except (ValueError, OSError):
            extra = []
        # Stripes inside the step itself (roots=()) are not listed: _tree_size counted them.
        size += sum(_tree_size(d) for d in extra if isinstance(d, Path) and d.is_dir())
    return size


def _step_time(step: StepDir) -> float:
    from cocijax.storage._records import MANIFEST_NAME

    marker = _item(step) / MANIFEST_NAME if step.kind == "jax" else step.path / TORCH_METADATA
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
    from cocijax.storage._kvpath import is_url

    try:
        root = storage.KvPath.parse(args.directory, _root_options(args))
    except (TypeError, ValueError) as e:
        raise CliError(str(e)) from None
    if not root.is_local:
        return root.with_timeout(_STORE_TIMEOUT_S)
    if is_url(args.directory):
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
                elif st.kind in _UNCHECKED:
                    status = f"n/a ({_UNCHECKED[st.kind]})"
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
    from cocijax.storage._records import MANIFEST_NAME

    if (root := _durable_root(args)) is not None:
        return _verify_durable(args, root)
    directory = Path(args.directory)
    options = _root_options(args)
    if directory.is_dir() and (directory / MANIFEST_NAME).is_file():
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
    unchecked = {kind: [s.step for s in steps if s.kind == kind] for kind in _UNCHECKED}
    steps = [s for s in steps if s.kind not in _UNCHECKED]
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
    for kind, numbers in unchecked.items():
        if numbers:
            out.print(f"steps {numbers}: not verified ({_UNCHECKED[kind]})", markup=False)
    if bad:
        print(f"cocijax verify: {bad} problem(s) in {directory}", file=sys.stderr)
        return EXIT_DAMAGED
    if not steps:
        if not any(unchecked.values()):
            out.print(f"{directory}: no checkpoints", markup=False)
        return EXIT_OK
    label = "item" if steps[0].kind == "item" else f"{len(steps)} step(s)"
    out.print(f"OK: {label} verified in {directory}", markup=False)
    return EXIT_OK
