"""What a job pays to resume, phase by phase, from a fresh process to its first training step.

A training job that restarts after a failure starts Python and imports its libraries, opens its
checkpoint directory, restores the newest step, compiles its training step and runs it; that
time is the recovery cost ``R`` of the Young/Daly and COCI formulas. For trees (b) (1024 leaves,
256 MiB) and (c) (the small transformer, ~100 leaves, 160 MiB) of ``write_bench``, and (s) (16
leaves of 1 KiB: what opening costs per step kept, ``--trees s --steps 2000``), a directory
holding ``--steps`` saved steps is written once per method, then each repeat runs in a fresh
process with the page cache of the directory's files evicted:

* ``orbax``: Orbax's ``CheckpointManager`` with ``StandardCheckpointHandler``;
* ``cocijax``: :class:`cocijax.CheckpointManager` with its defaults (the policy ``coci()``);
* ``memory``: the same, saved with ``memory=`` (a folder on ``--memory``, a tmpfs) whose copy is
  still there: the restart after a process failure, restored from the memory tier;
* ``memory+cache``: ``memory`` with ``compilation_cache=True``, the cache filled by one run
  before the repeats: what reusing compiled programs saves at a restart.

The phases: ``start`` (from the parent's spawn to ``main``: the interpreter and the imports of
jax, orbax and cocijax), ``open`` (the manager's constructor on the existing directory, with
cocijax's policy set-up), ``restore`` (the newest step into an abstract tree with a sharding),
``compile`` (``lower().compile()`` of a jitted SGD step on the restored tree) and ``step`` (its
first run). The abstract tree is made and the page cache evicted between ``start`` and ``open``.

In the memory runs, the limit is measured in the same process after the first step: the
memory tier's files of the restored step read into preallocated NumPy buffers, a memcpy from
tmpfs (into fresh pages, as a restarted process has them; and again into the same pages,
faulted in, the copy alone). The restore's throughput (the tree's bytes over ``restore``) over
the memcpy's (the files' bytes over its time) is the target ratio (>= 0.8). cocijax's own
share of a restart, ``open + restore``, is compared with Orbax's manager on the same tree
(target <= 1). Methods are interleaved, repeat after repeat; medians are reported.

Run: ``python benchmarks/resume_bench.py [--repeat N] [--steps N] [--trees bc] [--dir DIR]
[--memory DIR] [--quick] [--json PATH] [--write]``. Prints the tables; ``--json`` writes every
run and the medians; ``--write`` also rewrites the ``resume_bench`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
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
METHODS = ("orbax", "cocijax", "memory", "memory+cache")
PHASES = ("start", "open", "restore", "compile", "step")
# The directory each method restores: the two memory methods share one (and its tmpfs copy).
_SAVED_AS = {"orbax": "orbax", "cocijax": "cocijax", "memory": "memory", "memory+cache": "memory"}


def _tree(name: str, quick: bool):
    """write_bench's trees, and (s): 16 leaves of 1 KiB (the cost of opening per step kept)."""
    if name != "s":
        return _write_bench_tree(name, quick)
    import jax.numpy as jnp

    return {f"w{i:02d}": jnp.full(256, float(i)) for i in range(16)}


def _manager(case: dict):
    import orbax.checkpoint as ocp

    import cocijax as cj

    options = ocp.CheckpointManagerOptions(max_to_keep=case["steps"])
    method = case["method"]
    if method == "orbax":
        return ocp.CheckpointManager(
            case["dir"], item_handlers=ocp.StandardCheckpointHandler(), options=options
        )
    return cj.CheckpointManager(
        case["dir"],
        options=options,
        memory=case.get("memory"),
        compilation_cache=method == "memory+cache",
    )


def _save(case: dict) -> dict:
    import jax
    import orbax.checkpoint as ocp

    tree = jax.block_until_ready(_tree(case["tree"], case["quick"]))
    with _manager(case) as manager:
        for step in range(1, case["steps"] + 1):
            if case["method"] == "orbax":
                manager.save(step, args=ocp.args.StandardSave(tree))
            else:
                manager.save(step, tree, loss=1.0, force=True)
        manager.wait_until_finished()
    return {}


def _train_step(params):
    """One SGD step on the sum of squares of the floating-point leaves (the others kept)."""
    import jax
    import jax.numpy as jnp

    def loss_fn(p):
        floats = [x for x in jax.tree.leaves(p) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in floats)

    def update(p, g):
        if not jnp.issubdtype(p.dtype, jnp.inexact):
            return p
        return (p - 1e-3 * g).astype(p.dtype)

    loss, grads = jax.value_and_grad(loss_fn, allow_int=True)(params)
    return jax.tree.map(update, params, grads), loss


def _memcpy_s(memory: Path, step: int) -> dict:
    """Reads the memory tier's files of ``step`` into preallocated NumPy buffers, twice.

    ``memcpy_s``: into fresh private anonymous mappings, as a fresh process has its memory:
    the copy faults their pages in, as a restore's must (``np.empty`` may hand back pages the
    process freed before, which made this limit swing from run to run). ``memcpy_faulted_s``:
    into the same buffers again, their pages in place: the copy alone.
    """
    import mmap

    import numpy as np

    def fresh(nbytes: int) -> np.ndarray:
        pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(pages, np.uint8)[:nbytes]

    files = sorted(f for f in memory.glob(f"*/{step}/state/**/*") if f.is_file())
    buffers = [fresh(f.stat().st_size) for f in files]
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        for path, buffer in zip(files, buffers, strict=True):
            with open(path, "rb", buffering=0) as f:
                f.readinto(buffer)
        seconds.append(time.perf_counter() - t0)
    return {
        "memcpy_s": seconds[0],
        "memcpy_faulted_s": seconds[1],
        "memcpy_bytes": sum(b.nbytes for b in buffers),
    }


def _resume(case: dict) -> dict:
    import jax
    import orbax.checkpoint as ocp

    # Before main, as a job imports them: Orbax's manager comes with `orbax.checkpoint`,
    # cocijax's with its first use (`cocijax` imports its submodules lazily), made here.
    from cocijax import CheckpointManager  # noqa: F401

    started = time.time()  # the imports are done: what the process took to reach main
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        jax.eval_shape(lambda: _tree(case["tree"], case["quick"])),
    )
    evict_page_cache(Path(case["dir"]))
    t0 = time.perf_counter()
    manager = _manager(case)
    t1, cpu1 = time.perf_counter(), time.process_time()
    if case["method"] == "orbax":
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    else:
        restored = manager.restore(target=abstract)
        step = manager.restored_step
    jax.block_until_ready(restored)
    t2, cpu2 = time.perf_counter(), time.process_time()
    compiled = jax.jit(_train_step).lower(restored).compile()
    t3 = time.perf_counter()
    jax.block_until_ready(compiled(restored))
    t4 = time.perf_counter()
    tier = None if case["method"] == "orbax" else manager.restored_tier
    manager.close()
    if step != case["steps"]:
        raise AssertionError(f"{case['method']} restored step {step}, not {case['steps']}")
    if case.get("memory") and tier != "memory":
        raise AssertionError(f"{case['method']} restored from the {tier} tier, not memory")
    result = {
        "start_s": started - case["spawned_at"],
        "open_s": t1 - t0,
        "restore_s": t2 - t1,
        # CPU time of every thread of the process: far below restore_s, the restore waits.
        "restore_cpu_s": cpu2 - cpu1,
        "compile_s": t3 - t2,
        "step_s": t4 - t3,
        "tree_bytes": sum(x.nbytes for x in jax.tree.leaves(restored)),
    }
    if case.get("memory"):
        result |= _memcpy_s(Path(case["memory"]), step)
    return result


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _tables(runs: dict[tuple[str, str], list[dict]], trees: str) -> list[str]:
    """The phases table, then the memory restore against memcpy, then the compile saving."""
    lines = [
        "| tree | method | start s | open s | restore s | compile s | first step s | total s "
        "| open + restore s | / Orbax's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tree in trees:
        own = {m: _median(runs[(tree, m)], "own_s") for m in METHODS}
        for method in METHODS:
            rows = runs[(tree, method)]
            phases = " | ".join(f"{_median(rows, f'{p}_s'):.3f}" for p in PHASES)
            lines.append(
                f"| ({tree}) | {method} | {phases} | {_median(rows, 'total_s'):.3f} | "
                f"{own[method]:.3f} | {own[method] / own['orbax']:.2f} |"
            )
    lines += [
        "",
        "| tree | MiB | memory restore GB/s | memcpy GB/s | restore / memcpy (target >= 0.8) "
        "| memcpy, pages faulted GB/s | restore / that |",
        "|---|---|---|---|---|---|---|",
    ]
    for tree in trees:
        rows = runs[(tree, "memory")] + runs[(tree, "memory+cache")]
        restore = _median(rows, "restore_gbps")
        memcpy = _median(rows, "memcpy_gbps")
        faulted = _median(rows, "memcpy_faulted_gbps")
        lines.append(
            f"| ({tree}) | {rows[0]['tree_bytes'] / 2**20:.0f} | {restore:.2f} | {memcpy:.2f} | "
            f"{statistics.median(r['restore_gbps'] / r['memcpy_gbps'] for r in rows):.2f} | "
            f"{faulted:.2f} | "
            f"{statistics.median(r['restore_gbps'] / r['memcpy_faulted_gbps'] for r in rows):.2f} |"
        )
    lines += [
        "",
        "| tree | compile s (memory) | compile s (memory+cache) | saved s |",
        "|---|---|---|---|",
    ]
    for tree in trees:
        cold = _median(runs[(tree, "memory")], "compile_s")
        warm = _median(runs[(tree, "memory+cache")], "compile_s")
        lines.append(f"| ({tree}) | {cold:.3f} | {warm:.3f} | {cold - warm:.3f} |")
    return lines


def _derived(result: dict) -> dict:
    """A run's sums and throughputs, beside its phases."""
    result["own_s"] = result["open_s"] + result["restore_s"]
    result["total_s"] = sum(result[f"{p}_s"] for p in PHASES)
    if "memcpy_s" in result:
        result["restore_gbps"] = result["tree_bytes"] / result["restore_s"] / 1e9
        result["memcpy_gbps"] = result["memcpy_bytes"] / result["memcpy_s"] / 1e9
        result["memcpy_faulted_gbps"] = result["memcpy_bytes"] / result["memcpy_faulted_s"] / 1e9
    return result


def _run(case: dict) -> dict:
    """One resume in a fresh process, without a compilation cache inherited from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return _derived(run_in_child(__file__, case | {"spawned_at": time.time()}, env=env))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (median kept)")
    parser.add_argument("--steps", type=int, default=5, help="steps in the directory")
    parser.add_argument("--trees", default="bc", help="subset of write_bench's trees a, b, c")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk")
    parser.add_argument("--memory", default="/dev/shm", help="a tmpfs, for the memory tier")
    parser.add_argument("--quick", action="store_true", help="write_bench's small trees")
    parser.add_argument("--json", help="write every run and the tables to this file")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    parser.add_argument("--_case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._case:
        case = json.loads(args._case)
        print(json.dumps(_save(case) if case["phase"] == "save" else _resume(case)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="cocijax-resume-", dir=args.dir))
    memory = Path(tempfile.mkdtemp(prefix="cocijax-resume-", dir=args.memory))
    runs: dict[tuple[str, str], list[dict]] = {}
    try:

        def case(tree: str, method: str, phase: str) -> dict:
            saved = _SAVED_AS[method]
            return {
                "tree": tree, "method": method, "steps": args.steps, "quick": args.quick,
                "phase": phase, "dir": str(work / f"{tree}-{saved}"),
                "memory": str(memory / tree) if saved == "memory" else None,
            }  # fmt: skip

        for tree in args.trees:
            for method in ("orbax", "cocijax", "memory"):
                run_in_child(__file__, case(tree, method, "save"))
            _run(case(tree, "memory+cache", "resume"))  # fills the compilation cache
        for rep in range(args.repeat):
            for tree in args.trees:
                for method in METHODS:  # interleaved: load drifts hit every method alike
                    result = _run(case(tree, method, "resume"))
                    runs.setdefault((tree, method), []).append(result)
                    phases = ", ".join(f"{p} {result[f'{p}_s']:.3f}" for p in PHASES)
                    print(f"[{rep + 1}/{args.repeat}] ({tree}) {method}: {phases}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)

    lines = _tables(runs, args.trees)
    print("\n".join(lines))
    if args.json:
        rows = [
            {"tree": tree, "method": method, "repeat": i} | result
            for (tree, method), results in runs.items()
            for i, result in enumerate(results)
        ]
        Path(args.json).write_text(json.dumps({"runs": rows, "tables": lines}, indent=1))
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
