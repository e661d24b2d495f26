"""What a job pays to resume: open its checkpoint manager and restore the newest step.

A training job that restarts after a failure opens its checkpoint directory and restores the
newest step before it trains again; that time is the recovery cost ``R`` of the Young/Daly and
COCI formulas. For trees (b) (1024 leaves, 256 MiB) and (c) (the small transformer, ~100 leaves,
160 MiB) of ``write_bench``, and (s) (16 leaves of 1 KiB: what opening costs per step kept,
``--trees s --steps 2000``), a directory holding ``--steps`` saved steps is written once per
method, then each repeat runs in a fresh process with the page cache of every file evicted:

* ``orbax``: Orbax's ``CheckpointManager`` with ``StandardCheckpointHandler``;
* ``cocijax``: :class:`cocijax.CheckpointManager` with its defaults (the policy ``coci()``).

``open`` is the manager's constructor on the existing directory, ``restore`` the restore of its
newest step into an abstract tree (``jax.ShapeDtypeStruct`` with a sharding); the imports and the
abstract tree are made before the clock starts. Methods are interleaved, repeat after repeat.

Run: ``python benchmarks/resume_bench.py [--repeat N] [--steps N] [--trees bc] [--dir DIR]
[--write]``. Prints a table; ``--write`` also rewrites the ``resume_bench`` section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import machine_line, run_in_child, write_section
from _write_cases import evict_page_cache
from _write_cases import make_tree as _write_bench_tree

SECTION = "resume_bench"
METHODS = ("orbax", "cocijax")


def _tree(name: str, quick: bool):
    """write_bench's trees, and (s): 16 leaves of 1 KiB (the cost of opening per step kept)."""
    if name != "s":
        return _write_bench_tree(name, quick)
    import jax.numpy as jnp

    return {f"w{i:02d}": jnp.full(256, float(i)) for i in range(16)}


def _manager(method: str, directory: Path, steps: int):
    import orbax.checkpoint as ocp

    import cocijax as cj

    options = ocp.CheckpointManagerOptions(max_to_keep=steps)
    if method == "orbax":
        return ocp.CheckpointManager(
            directory, item_handlers=ocp.StandardCheckpointHandler(), options=options
        )
    return cj.CheckpointManager(directory, options=options)


def _save(case: dict) -> dict:
    import jax
    import orbax.checkpoint as ocp

    tree = jax.block_until_ready(_tree(case["tree"], quick=False))
    with _manager(case["method"], Path(case["dir"]), case["steps"]) as manager:
        for step in range(1, case["steps"] + 1):
            if case["method"] == "orbax":
                manager.save(step, args=ocp.args.StandardSave(tree))
            else:
                manager.save(step, tree, loss=1.0, force=True)
        manager.wait_until_finished()
    return {}


def _resume(case: dict) -> dict:
    import jax
    import orbax.checkpoint as ocp

    from cocijax import CheckpointManager  # noqa: F401 -- imported before the clock starts

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        jax.eval_shape(lambda: _tree(case["tree"], quick=False)),
    )
    evict_page_cache(Path(case["dir"]))
    t0 = time.perf_counter()
    manager = _manager(case["method"], Path(case["dir"]), case["steps"])
    t1 = time.perf_counter()
    if case["method"] == "orbax":
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    else:
        restored = manager.restore(target=abstract)
        step = manager.restored_step
    jax.block_until_ready(restored)
    t2 = time.perf_counter()
    manager.close()
    if step != case["steps"]:
        raise AssertionError(f"{case['method']} restored step {step}, not {case['steps']}")
    return {"open_s": t1 - t0, "restore_s": t2 - t1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (median kept)")
    parser.add_argument("--steps", type=int, default=5, help="steps in the directory")
    parser.add_argument("--trees", default="bc", help="subset of write_bench's trees a, b, c")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    parser.add_argument("--_case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._case:
        case = json.loads(args._case)
        print(json.dumps(_save(case) if case["phase"] == "save" else _resume(case)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="cocijax-resume-", dir=args.dir))
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for tree in args.trees:
            for method in METHODS:
                case = {"tree": tree, "method": method, "steps": args.steps}
                run_in_child(
                    __file__, case | {"phase": "save", "dir": str(work / f"{tree}-{method}")}
                )
        for rep in range(args.repeat):
            for tree in args.trees:
                for method in METHODS:  # interleaved: load drifts hit every method alike
                    case = {"tree": tree, "method": method, "steps": args.steps}
                    directory = str(work / f"{tree}-{method}")
                    result = run_in_child(__file__, case | {"phase": "resume", "dir": directory})
                    runs.setdefault((tree, method), []).append(result)
                    print(f"[{rep + 1}/{args.repeat}] ({tree}) {method}: {result}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = [
        "| tree | method | open s | restore s | open + restore s | Orbax / method |",
        "|---|---|---|---|---|---|",
    ]
    for tree in args.trees:
        total = {
            m: statistics.median(r["open_s"] + r["restore_s"] for r in runs[(tree, m)])
            for m in METHODS
        }
        for method in METHODS:
            rs = runs[(tree, method)]
            lines.append(
                f"| ({tree}) | {method} | {statistics.median(r['open_s'] for r in rs):.3f} | "
                f"{statistics.median(r['restore_s'] for r in rs):.3f} | {total[method]:.3f} | "
                f"{total['orbax'] / total[method]:.2f}x |"
            )
    print("\n".join(lines))
    if args.write:
        write_section(
            SECTION,
            "\n".join(
                [
                    "## resume_bench: opening a checkpoint directory and restoring its newest step",
                    "",
                    f"Command: `python benchmarks/resume_bench.py` (repeat={args.repeat}, "
                    f"{args.steps} steps in the directory, each run a fresh process with the "
                    "page cache evicted, methods interleaved, medians). See the module "
                    "docstring.",
                    "",
                    machine_line(str(args.dir)),
                    "",
                    *lines,
                ]
            ),
        )
        print(f"Updated the {SECTION} section of BENCHMARKS.md.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
