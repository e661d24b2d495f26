"""Profile of a restore from the memory tier against a memcpy of the same tmpfs files.

Run from the repository root: ``PYTHONPATH=$PWD:$PWD/benchmarks python notes/memrestore_profile.py
save|time [--trees bc] [--repeat 7] [--memory /dev/shm/x] [--dir /tmp/x]``. ``save`` writes one
step of ``write_bench``'s trees with ``memory=``; ``time`` (one process) alternates, for each
tree and repeat: a memcpy of the step's memory files into fresh ``np.empty`` buffers, a
``CheckpointManager`` restore of it (opened once, outside the timing; ``restored_tier`` checked)
and the handler's restore of the memory item alone; prints medians of wall and CPU time
(``time.process_time``: every thread of the process).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from _write_cases import make_tree

import cocijax as cj


def _memcpy(files: list[Path]) -> None:
    buffers = [np.empty(f.stat().st_size, np.uint8) for f in files]
    for path, buffer in zip(files, buffers, strict=True):
        with open(path, "rb", buffering=0) as f:
            f.readinto(buffer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["save", "time"])
    parser.add_argument("--trees", default="bc")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--memory", default="/dev/shm/memrestore-profile")
    parser.add_argument("--dir", default="/tmp/memrestore-profile")
    args = parser.parse_args()
    for name in args.trees:
        mem, disk = Path(args.memory) / name, Path(args.dir) / name
        if args.what == "save":
            tree = jax.block_until_ready(make_tree(name, False))
            with cj.CheckpointManager(disk, memory=mem) as m:
                m.save(1, tree, loss=1.0, force=True)
                m.wait_until_finished()
    if args.what == "save":
        return
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rows: dict[tuple[str, str], list[float]] = {}
    managers, targets, files, nbytes, items = {}, {}, {}, {}, {}
    for name in args.trees:
        mem, disk = Path(args.memory) / name, Path(args.dir) / name
        targets[name] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            jax.eval_shape(lambda n=name: make_tree(n, False)),
        )
        managers[name] = cj.CheckpointManager(disk, memory=mem)
        files[name] = sorted(f for f in mem.glob("*/1/state/**/*") if f.is_file())
        items[name] = next(mem.glob("*/1/state"))
        nbytes[name] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(targets[name]))
    handler = cj.StripedCheckpointHandler()
    for rep in range(args.repeat + 1):
        for name in args.trees:
            for method in ("memcpy", "manager", "handler"):
                t0, c0 = time.perf_counter(), time.process_time()
                if method == "memcpy":
                    _memcpy(files[name])
                elif method == "manager":
                    out = managers[name].restore(target=targets[name])
                    assert managers[name].restored_tier == "memory"
                else:
                    out = handler.restore(items[name], cj.StripedRestore(targets[name]))
                if method != "memcpy":
                    jax.block_until_ready(out)
                    del out
                seconds = (time.perf_counter() - t0, time.process_time() - c0)
                if rep:  # the first round warms up
                    rows.setdefault((name, method), []).append(seconds)
    for (name, method), runs in rows.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        memcpy = rows[(name, "memcpy")]
        print(
            f"({name}) {method:8s} n={len(runs)} median wall {wall:.3f} s "
            f"({nbytes[name] / wall / 1e9:.2f} GB/s), CPU {cpu:.3f} s; memcpy over this: "
            f"wall {statistics.median(w for w, _ in memcpy) / wall:.2f}, "
            f"CPU {statistics.median(c for _, c in memcpy) / cpu:.2f}"
        )
    for m in managers.values():
        m.close()
    handler.close()


if __name__ == "__main__":
    main()
