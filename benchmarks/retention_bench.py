"""What retention costs a training loop: ``save()`` blocking and the policy's cost estimate.

``cj.CheckpointManager`` saves a tree of many small pieces every step (``fixed(1)``), with
``max_to_keep=1`` (each save drops the step before, with its stripes) and without retention, on
a local root and on an S3 root (moto's server on 127.0.0.1, in a process of its own, started
and stopped by this script). On an S3 root dropping a step deletes every object of its stripe
folder, one request each.

Each case runs in a fresh process against a code tree: the current one, and with ``--before
DIR`` also an older checkout (``git worktree add DIR <commit>``), interleaved round by round
(the order rotates), so that both are measured on the same machine in the same minutes. A case
saves ``--saves`` steps of the tree and records, for every save after the second, how long
``save`` blocked and the cost the policy was given at the next step
(``measurements.cost_estimate_s``). The table shows medians over saves and rounds.

Run: ``python benchmarks/retention_bench.py [--before DIR] [--quick] [--repeat N] [--write]``.
``--write`` also rewrites the ``retention_bench`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import machine_line, run_in_child, write_section
from tier_bench import AWS_ENV, BUCKET, _empty_bucket, _options, _start_moto

SECTION = "retention_bench"
ROOTS = ("local", "s3")
KEEPS = (None, 1)


def _tree(quick: bool) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    # Many pieces: 64 leaves of 1 MiB (16 of 256 KiB with --quick), each a zarr array of its
    # own above the packing threshold, so dropping a step removes many files or objects.
    n, size = (16, 1 << 16) if quick else (64, 1 << 18)
    return {f"w{i:02d}": rng.standard_normal(size).astype(np.float32) for i in range(n)}


def _commit(checkout: str) -> str:
    """The commit ``checkout`` is at (short hash), or "unknown"."""
    import subprocess

    done = subprocess.run(
        ["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def _run_case(case: dict) -> dict:
    import cocijax as cj

    work = Path(case["work"])
    tree = _tree(case["quick"])
    if case["root"] == "s3":
        roots = [f"s3://{BUCKET}/root-{case['round']}-{case['code']}"]
        handler_options = {"root_options": _options(case["endpoint"]), "small_bytes": 1 << 10}
    else:
        roots = [work / "root"]
        handler_options = {"small_bytes": 1 << 10}
    blocking, estimate = [], []
    with cj.CheckpointManager(
        work / "ckpt",
        roots=roots,
        policy=cj.policies.fixed(1),
        max_to_keep=case["keep"],
        handler_options=handler_options,
        preemption_signals=(),
    ) as mngr:
        for step in range(1, case["saves"] + 1):
            time.sleep(case["step_s"])  # a training step: a save in flight commits meanwhile
            start = time.perf_counter()
            mngr.save(step, tree, loss=1.0)
            blocking.append(time.perf_counter() - start)
            estimate.append(mngr.measurements.cost_estimate_s)  # fed at this step: the last
        mngr.wait_until_finished()
    # The first two saves fault in buffers and compile; the estimate lags one save.
    return {"blocking": blocking[2:], "estimate": estimate[3:]}


def _one(case: dict, code: str) -> dict:
    env = {**os.environ, **AWS_ENV, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": code}
    return run_in_child(__file__, case, label=case, env=env, cwd=Path(__file__).resolve().parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="a checkout of the code to compare with")
    parser.add_argument("--quick", action="store_true", help="a small tree, one round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians kept)")
    parser.add_argument("--saves", type=int, default=12, help="saves per case")
    parser.add_argument(
        "--step-s", type=float, default=0.05, help="seconds of 'training' between two saves"
    )
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where local data goes")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    parser.add_argument("--_case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._case:
        print(json.dumps(_run_case(json.loads(args._case))))
        return 0

    from rich.console import Console
    from rich.table import Table

    here = str(Path(__file__).resolve().parents[1])
    codes = {"now": here} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    repeat = 1 if args.quick else args.repeat
    os.environ.update(AWS_ENV)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cases = [(r, k, c) for r in ROOTS for k in KEEPS for c in codes]
    samples: dict[tuple, dict[str, list[float]]] = {
        c: {"blocking": [], "estimate": []} for c in cases
    }
    server, endpoint = _start_moto()
    try:
        for rnd in range(repeat):
            order = cases[rnd % len(cases) :] + cases[: rnd % len(cases)]
            for root, keep, code in order:
                work = Path(tempfile.mkdtemp(prefix="retention_bench-", dir=args.dir))
                case = {"root": root, "keep": keep, "code": code, "round": rnd}
                case |= {"quick": args.quick, "saves": args.saves, "work": str(work)}
                case["step_s"] = args.step_s
                case["endpoint"] = endpoint
                try:
                    out = _one(case, codes[code])
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                    _empty_bucket(endpoint)
                for key in ("blocking", "estimate"):
                    samples[(root, keep, code)][key] += out[key]
                print(f"round {rnd + 1}/{repeat} {root} keep={keep} {code}: done", file=sys.stderr)
    finally:
        server.terminate()
        server.wait()

    med = {c: {k: statistics.median(v) for k, v in s.items()} for c, s in samples.items()}
    table = Table(title=f"retention_bench (medians over saves 3-{args.saves}, {repeat} rounds)")
    for col in (
        "root",
        "code",
        "max_to_keep",
        "save() blocks (ms)",
        "cost estimate (ms)",
        "blocks / no retention",
    ):
        table.add_column(col)
    for root in ROOTS:
        for code in codes:
            base = med[(root, None, code)]["blocking"]
            for keep in KEEPS:
                m = med[(root, keep, code)]
                table.add_row(
                    root, code, str(keep), f"{1e3 * m['blocking']:.1f}",
                    f"{1e3 * m['estimate']:.1f}", f"{m['blocking'] / base:.2f}x",
                )  # fmt: skip
    console = Console(record=True, width=110)
    console.print(table)
    machine = machine_line(args.dir)
    console.print(machine)
    if args.write:
        text = console.export_text()
        before = ""
        if args.before:
            before = f", `before`: the checkout given by `--before`, {_commit(args.before)}"
        heading = (
            "## retention_bench: what deleting old steps costs a save\n\n"
            f"Command: `python benchmarks/retention_bench.py` (repeat={args.repeat}, "
            f"{args.saves} saves per case{before}; see the module docstring).\n\n"
        )
        write_section(SECTION, f"{heading}```\n{text}```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
