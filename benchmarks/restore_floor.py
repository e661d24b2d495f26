"""How close restores of the small transformer tree (c) come to reading its files at all.

write_bench's tree (c) (160 MiB: bf16 parameters, float32 Adam moments, ~100 leaves) is saved
once with cocijax (one root) and once with Orbax's ``StandardCheckpointHandler``. Then, per
repeat and with the page cache of every file evicted before each run:

* ``orbax``: Orbax's restore into the abstract tree;
* ``cocijax``: cocijax's restore into the same abstract tree (checksums verified);
* ``plain read``: cocijax's data files (every file of every piece except ``zarr.json``) read with
  32 Python threads into fresh page-aligned buffers: no TensorStore, checksums or jax. This is
  what reading these bytes costs on the machine, the floor for any restore of this layout.

Run: ``python benchmarks/restore_floor.py [--repeat N] [--dir DIR] [--write]``. Prints a table;
``--write`` also rewrites the ``restore_floor`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import machine_line, write_section
from _write_cases import evict_page_cache, make_tree

SECTION = "restore_floor"


def _plain_read(files: list[Path]) -> None:
    import numpy as np

    from cocijax.storage import _io

    def read(path: Path) -> None:
        size = path.stat().st_size
        buf = _io.aligned_empty((size,), np.uint8, 4096)
        with open(path, "rb", buffering=0) as f:
            if f.readinto(memoryview(buf)) != size:
                raise AssertionError(f"short read of {path}")

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(read, files))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per method (median kept)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    args = parser.parse_args(argv)

    import jax
    import orbax.checkpoint as ocp

    import cocijax as cj

    tree = make_tree("c", quick=False)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    work = Path(tempfile.mkdtemp(prefix="cocijax-floor-", dir=args.dir))
    try:
        with ocp.Checkpointer(cj.StripedCheckpointHandler([work / "root"])) as ckptr:
            ckptr.save(work / "cocijax", args=cj.StripedSave(tree))
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            ckptr.save(work / "orbax", args=ocp.args.StandardSave(tree))
        files = [p for p in (work / "root").rglob("*") if p.is_file() and p.name != "zarr.json"]
        nbytes = sum(p.stat().st_size for p in files)
        orbax = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        ours = ocp.Checkpointer(cj.StripedCheckpointHandler([work / "root"]))
        runs = {
            "orbax": lambda: orbax.restore(work / "orbax", args=ocp.args.StandardRestore(abstract)),
            "cocijax": lambda: ours.restore(work / "cocijax", args=cj.StripedRestore(abstract)),
            "plain read": lambda: _plain_read(files),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        with orbax, ours:
            for _ in range(args.repeat):
                for name, run in runs.items():  # interleaved: load drifts hit every method alike
                    evict_page_cache(work)
                    t = time.perf_counter()
                    jax.block_until_ready(run())
                    times[name].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    median = {name: statistics.median(ts) for name, ts in times.items()}
    lines = [
        "| method | median s | min s | max s | GiB/s | Orbax / method |",
        "|---|---|---|---|---|---|",
    ]
    for name, ts in times.items():
        lines.append(
            f"| {name} | {median[name]:.3f} | {min(ts):.3f} | {max(ts):.3f} | "
            f"{nbytes / 2**30 / median[name]:.2f} | {median['orbax'] / median[name]:.2f}x |"
        )
    need = median["orbax"] / 1.5
    verdict = (
        f"1.5x Orbax means restoring in {need:.3f} s; reading cocijax's {len(files)} data files "
        f"({nbytes / 2**20:.0f} MiB) with nothing else took {median['plain read']:.3f} s."
    )
    print("\n".join(lines), "", verdict, sep="\n")
    if args.write:
        write_section(
            SECTION,
            "\n".join(
                [
                    "## restore_floor: restoring tree (c) against reading its files",
                    "",
                    f"Command: `python benchmarks/restore_floor.py` (repeat={args.repeat}, "
                    "interleaved, page cache evicted before every run). See the module "
                    "docstring for the three methods.",
                    "",
                    machine_line(str(args.dir)),
                    "",
                    *lines,
                    "",
                    verdict,
                ]
            ),
        )
        print(f"Updated the {SECTION} section of BENCHMARKS.md.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
