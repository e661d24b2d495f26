"""Write and restore benchmark: cocijax and Orbax against the device limit measured in the same run.

Trees (issue 3): (a) 1 GiB as 16 x 64 MiB float32, (b) 256 MiB as 1024 small float32 leaves,
(c) a small transformer with bf16 parameters and its float32 Adam state. Per tree, the methods
run interleaved, repeat after repeat, each in a fresh subprocess (nothing cached, clean memory
accounting):

* ``limit``: what the machine allows for the same bytes, measured the way fio measures a device.
  The tree is copied into host memory that was faulted in beforehand (the *pre-faulted copy*,
  one ``np.copyto`` per leaf in one thread: the reference for the blocking time), and into fresh
  memory (for comparison). Then the bytes are written with ``O_DIRECT`` from that page-aligned
  buffer by T threads, one file each, in 8 MiB requests, each file fsynced and the directory
  too (fio ``--direct=1 --numjobs=T --end_fsync=1``, file creation included); then, the page
  cache evicted (``posix_fadvise DONTNEED``), read back with parallel ``O_DIRECT`` reads into
  fresh page-aligned buffers (what a restore has to fill) and into the pre-faulted buffer (the
  device alone). T = 4, 8, 16 and 32; the limit is the best T (its median over the repeats).
  With ``fio`` on the PATH it is also run once per case as a cross-check (not used by the
  targets).
* ``orbax``: Orbax's ``StandardCheckpointHandler`` under ``ocp.AsyncCheckpointer``.
* ``cocijax-N``: ``StripedCheckpointHandler`` over N root directories (default options).
* ``cocijax-N-overlap`` (N the first root count): the same with ``write_while_copying=True``:
  chunk files start writing while the rest of the tree is still being copied, which shortens
  the commit and lengthens the blocking copy. Shown beside the targets, which hold the
  defaults (``--no-overlap`` leaves it out).

A save case warms its checkpointer up with a tiny save, then saves the tree twice (as a
training job does): the first save's blocking time is shown, the second save (same shapes) is
the one the targets use: ``save`` (blocking) and ``save`` to ``wait_until_finished`` (durable
commit). Its resident set size is sampled every millisecond in a thread: the peak minus the RSS
before the first save is the extra host memory of saving (buffers kept between saves
included). Then the page cache of every file is evicted and a restore into an abstract tree
(``jax.ShapeDtypeStruct`` with the saved sharding) is timed, and its values checked. The
restore is held to the faster of the limit's two reads (the target), and shown against the
read into fresh buffers too: a restore returns memory the process did not hold, and faulting
in fresh memory is not free (the "fresh copy" against the "pre-faulted copy" column).

Run: ``python benchmarks/write_bench.py [--quick] [--dir DIR] [--tmpfs DIR] [--roots 1,2]
[--trees abc] [--repeat N] [--no-overlap] [--write] [--from-json FILE]``. Prints the tables;
``--write`` also rewrites the ``write_bench`` section of BENCHMARKS.md and keeps every raw run in
``benchmarks/out/write_bench.json`` (``--from-json`` re-renders the section from it).

Here: the runs and the output; ``_write_cases`` holds what each case's subprocess measures,
``_write_report`` the tables and targets.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _report import BENCH_MD, run_in_child, write_section
from _write_cases import run_limit, run_save
from _write_report import (
    LIMIT_COLS,
    SAVE_COLS,
    limit_table,
    machine_lines,
    markdown_table,
    save_table,
    spread,
    targets,
)

SECTION = "write_bench"
RESULTS_JSON = Path(__file__).resolve().parent / "out" / "write_bench.json"  # every raw run


def _one(case: dict) -> dict:
    work = Path(tempfile.mkdtemp(prefix="cocijax-bench-", dir=case["base"]))
    try:
        return run_in_child(__file__, dict(case, dir=str(work)), label=case)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; see the module docstring. Returns a process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: small trees, once (about a minute)"
    )
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk")
    parser.add_argument("--tmpfs", default="none", help="a tmpfs directory for a second pass")
    parser.add_argument("--trees", default="abc", help="subset of the trees a, b, c")
    parser.add_argument("--roots", default="1,2", help="root counts of the cocijax cases")
    parser.add_argument(
        "--no-overlap", action="store_true", help="leave out the cocijax-1-overlap case"
    )
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (median kept)")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    parser.add_argument(
        "--from-json",
        help="re-render the tables and section from the results file of an earlier run "
        "(benchmarks/out/write_bench.json) instead of measuring",
    )
    parser.add_argument("--_case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 1
    if args._case:
        case = json.loads(args._case)
        print(json.dumps(run_limit(case) if case["method"] == "limit" else run_save(case)))
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    locations = {"disk": args.dir}
    if args.tmpfs != "none":
        locations["tmpfs"] = args.tmpfs
    trees = list(args.trees)
    methods = ["orbax", *(f"cocijax-{n}" for n in args.roots.split(","))]
    if not args.no_overlap:
        methods.append(f"{methods[1]}-overlap")
    runs: dict[tuple[str, str, str], list[dict]] = {}
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        runs = {tuple(k): v for k, v in saved["runs"]}
        machine, locations = saved["machine"], saved["locations"]
        trees = sorted({k[1] for k in runs})
        methods = [m for m in dict.fromkeys(k[2] for k in runs) if m != "limit"]
        args.repeat, args.quick = len(next(iter(runs.values()))), saved["quick"]
    else:
        # Repeats outermost: on a shared machine, load drifts; interleaving spreads it evenly.
        for rep in range(args.repeat):
            for loc, base in locations.items():
                for tree in trees:
                    for method in ["limit", *methods]:
                        case = {"tree": tree, "method": method, "quick": args.quick, "base": base}
                        result = _one(case)
                        runs.setdefault((loc, tree, method), []).append(result)
                        console.log(f"[{rep + 1}/{args.repeat}] {loc} ({tree}) {method}: {result}")
        machine = machine_lines(locations)
        if args.write:  # The raw runs behind the BENCHMARKS.md section.
            RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
            saved = {
                "runs": [[list(k), v] for k, v in runs.items()],
                "machine": machine,
                "locations": locations,
                "quick": args.quick,
            }
            RESULTS_JSON.write_text(json.dumps(saved, indent=1))
    results = {key: _median(r) for key, r in runs.items()}

    limit_rows = limit_table(results, list(locations), trees)
    save_rows = save_table(results, list(locations), trees, methods)
    for title, cols, rows in (
        ("write_bench: the limit", LIMIT_COLS, limit_rows),
        ("write_bench: saves and restores", SAVE_COLS, save_rows),
    ):
        table = Table(title=title + (" (--quick)" if args.quick else ""))
        for c in cols:
            table.add_column(c, justify="left" if c in ("where", "tree", "method") else "right")
        for r in rows:
            table.add_row(*r)
        console.print(table)
    verdicts = []
    if args.quick:
        # The targets are stated for the full trees; small ones measure per-file overheads.
        verdicts.append("(--quick: a smoke run on small trees; targets apply to the full run)")
    else:
        for loc in locations:
            verdicts.append(f"\nTargets on {loc} (issue 15; every root count must hold):\n")
            verdicts.extend(targets(results, trees, loc, methods))
    console.print("\n".join(verdicts))
    if args.write:
        cmd = "python benchmarks/write_bench.py" + (" --quick" if args.quick else "")
        text = "\n".join(
            [
                "## write_bench: checkpoint writes and restores against the device limit",
                "",
                f"Command: `{cmd}` (repeat={args.repeat}, interleaved, medians). The limit is "
                "measured in the same run, the way fio measures a device: the same bytes "
                "written with O_DIRECT by T threads (one file each, 8 MiB requests, each file "
                "fsynced, then the directory) from a page-aligned buffer, and read back cold "
                "with parallel O_DIRECT reads; the best T counts. The pre-faulted copy is the "
                "tree copied by one thread into host memory faulted in beforehand. Figures of "
                "a save are its second save of the tree (the first one's blocking is shown "
                "beside it); a ratio to the limit is limit time / method time. `cocijax-N` "
                "stripes over N root directories with the default options, "
                "`cocijax-N-overlap` adds write_while_copying=True; all roots share one "
                "device here. See the module docstring for every detail.",
                "",
                f"Noise: this is a shared virtual machine; {spread(runs)}",
                "",
                "Machine:",
                *machine,
                "",
                "The limit (medians; GiB/s per thread count T):",
                "",
                *markdown_table(LIMIT_COLS, limit_rows),
                "",
                "Saves and restores (medians):",
                "",
                *markdown_table(SAVE_COLS, save_rows),
                *verdicts,
            ]
        )
        write_section(SECTION, text)
        console.print(f"Updated the {SECTION} section of {BENCH_MD.name}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
