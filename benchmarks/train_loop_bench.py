"""What checkpointing costs a training loop: wall time of jitted steps with async saves.

A training step here is one jitted pass over write_bench's tree (a) (1 GiB in 16 leaves) or (c)
(the 160 MiB transformer with its Adam state), with its state donated (``donate_argnums=0``, as
training loops do) or not. Per method the loop runs ``--steps`` steps and saves every
``--every`` steps through ``ocp.AsyncCheckpointer``, then waits for the last save:

* ``no saves``: the loop alone;
* ``cocijax``: ``StripedCheckpointHandler`` (one root, default options);
* ``orbax``: Orbax's ``StandardCheckpointHandler``. On the CPU it holds numpy views of the
  arrays' buffers until its commit instead of copying them, and JAX does not donate a buffer
  that is so held: the step after a save then gets fresh memory for its output.

Shown per method: the loop's wall time, its overhead over ``no saves``, the median time a save
blocked (the copy, and the wait for the previous save's writes) and the median time of the
step right after a save. Repeats are interleaved; medians.

Run: ``python benchmarks/train_loop_bench.py [--repeat N] [--steps N] [--every K] [--write]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import machine_line, write_section
from _write_cases import make_tree

SECTION = "train_loop_bench"
METHODS = ("no saves", "cocijax", "orbax")


def _loop(tree, step, checkpointer, save_args, work: Path, steps: int, every: int) -> dict:
    import jax

    state = jax.block_until_ready(step(jax.tree.map(lambda x: x + 0, tree)))  # compiled
    blocking, after_save = [], []
    start = time.perf_counter()
    for n in range(1, steps + 1):
        t = time.perf_counter()
        state = jax.block_until_ready(step(state))
        if n > every and n % every == 1:
            after_save.append(time.perf_counter() - t)
        if checkpointer is not None and n % every == 0:
            t = time.perf_counter()
            checkpointer.save(work / f"step{n}", args=save_args(state))
            blocking.append(time.perf_counter() - t)
    if checkpointer is not None:
        checkpointer.wait_until_finished()
    out = {"loop_s": time.perf_counter() - start, "after_save_s": statistics.median(after_save)}
    if blocking:
        out["blocking_s"] = statistics.median(blocking)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median kept)")
    parser.add_argument("--steps", type=int, default=24, help="training steps per run")
    parser.add_argument("--every", type=int, default=4, help="save every this many steps")
    parser.add_argument("--trees", default="ac", help="subset of write_bench's trees a, b, c")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    import cocijax as cj

    def update(x):
        return x * 0.999 + 0.001 if jnp.issubdtype(x.dtype, jnp.floating) else x + 1

    rows = []
    for tree_name in args.trees:
        tree = jax.block_until_ready(make_tree(tree_name, quick=False))
        gib = sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**30
        for donate in (True, False):
            step = jax.jit(lambda s: jax.tree.map(update, s), donate_argnums=0 if donate else ())
            runs: dict[str, list[dict]] = {m: [] for m in METHODS}
            for _ in range(args.repeat):
                for method in METHODS:  # interleaved: load drifts hit every method alike
                    work = Path(tempfile.mkdtemp(prefix="cocijax-loop-", dir=args.dir))
                    try:
                        if method == "no saves":
                            ckptr, save_args = None, None
                        elif method == "cocijax":
                            handler = cj.StripedCheckpointHandler([work / "root"])
                            ckptr, save_args = ocp.AsyncCheckpointer(handler), cj.StripedSave
                        else:
                            handler = ocp.StandardCheckpointHandler()
                            ckptr = ocp.AsyncCheckpointer(handler)
                            save_args = ocp.args.StandardSave
                        runs[method].append(
                            _loop(tree, step, ckptr, save_args, work, args.steps, args.every)
                        )
                        if ckptr is not None:
                            ckptr.close()
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
            med = {
                m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()
            }
            base = med["no saves"]["loop_s"]
            for m in METHODS:
                r = med[m]
                rows.append(
                    f"| ({tree_name}) {gib * 1024:.0f} MiB | {'yes' if donate else 'no'} | {m} | "
                    f"{r['loop_s']:.2f} | {r['loop_s'] / base - 1:+.0%} | "
                    + (f"{r['blocking_s'] * 1e3:.0f}" if "blocking_s" in r else "")
                    + f" | {r['after_save_s'] * 1e3:.0f} |"
                )
    lines = [
        f"{args.steps} steps, a save every {args.every}; medians of {args.repeat} interleaved "
        "runs.",
        "",
        "| tree | donated | method | loop s | over no saves | save blocks ms | "
        "step after a save ms |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    if args.write:
        write_section(
            SECTION,
            "\n".join(
                [
                    "## train_loop_bench: what checkpointing costs a training loop",
                    "",
                    "Command: `python benchmarks/train_loop_bench.py`. See the module docstring "
                    "for the loop and the methods.",
                    "",
                    machine_line(str(args.dir), f"jax {jax.__version__}"),
                    "",
                    *lines,
                ]
            ),
        )
        print(f"Updated the {SECTION} section of BENCHMARKS.md.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
