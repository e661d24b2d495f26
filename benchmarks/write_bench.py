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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _report import BENCH_MD, cpu_and_ram, filesystem, run_in_child, write_section

GiB = 1 << 30
MiB = 1 << 20
SECTION = "write_bench"
RESULTS_JSON = Path(__file__).resolve().parent / "out" / "write_bench.json"  # every raw run
THREADS = (4, 8, 16, 32)  # parallel O_DIRECT streams of the limit
REQUEST = 8 * MiB  # bytes per O_DIRECT request of the limit
BLOCK = 4096

# --------------------------------------------------------------------------- the subprocess


def _tree(name: str, quick: bool):
    import jax
    import jax.numpy as jnp
    import optax

    key = jax.random.key(0)
    if name == "a":  # 16 x 64 MiB float32
        n = (4 if quick else 64) * MiB // 4
        keys = jax.random.split(key, 16)
        return {f"w{i:02d}": jax.random.normal(k, (n // 1024, 1024)) for i, k in enumerate(keys)}
    if name == "b":  # 1024 x 256 KiB float32
        count, n = (256, 16 * 1024) if quick else (1024, 64 * 1024)
        data = jax.random.normal(key, (count, n))
        return {f"leaf{i:04d}": data[i] for i in range(count)}
    # (c): bf16 transformer parameters + float32 Adam moments + int32 step count.
    d, layers, vocab = (128, 2, 1024) if quick else (512, 4, 8192)
    shapes = {"embed": (vocab, d)}
    for i in range(layers):
        shapes |= {
            f"l{i}/qkv": (d, 3 * d), f"l{i}/out": (d, d), f"l{i}/up": (d, 4 * d),
            f"l{i}/down": (4 * d, d), f"l{i}/ln1": (d,), f"l{i}/ln2": (d,),
            f"l{i}/b_up": (4 * d,), f"l{i}/b_down": (d,),
        }  # fmt: skip
    keys = jax.random.split(key, len(shapes))
    params = {
        k: (0.02 * jax.random.normal(kk, s)).astype(jnp.bfloat16)
        for (k, s), kk in zip(shapes.items(), keys, strict=True)
    }
    opt = optax.adam(1e-3)
    opt_state = opt.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
    # Non-zero moments, as after training.
    opt_state = jax.tree.map(lambda x: x + 0.5 if x.dtype == jnp.float32 else x, opt_state)
    return {"params": params, "opt_state": opt_state}


class _RssSampler:
    """Peak resident set size, sampled from /proc every millisecond in a thread."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __enter__(self):
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _evict(path: Path) -> None:
    """Drops the page cache of every file under ``path`` so the next read comes from the device."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _fresh(nbytes: int):
    """A page-aligned buffer no page of which has been touched (an anonymous mapping)."""
    import numpy as np

    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes]


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` block-aligned ``(offset, length)`` ranges covering ``total`` bytes."""
    per = -(-total // parts // BLOCK) * BLOCK
    return [(o, min(per, total - o)) for o in range(0, total, per)]


def _direct_write(directory: Path, buf, threads: int) -> float:
    """Seconds to write ``buf`` as ``threads`` files with O_DIRECT, fsyncing each and the dir."""
    directory.mkdir()

    def job(i: int, offset: int, length: int) -> None:
        fd = os.open(directory / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            for o in range(0, length, REQUEST):
                view = memoryview(buf[offset + o : offset + min(o + REQUEST, length)])
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], o + done)
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(job, i, *r) for i, r in enumerate(_split(len(buf), threads))]
        for f in futures:
            f.result()
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def _direct_read(directory: Path, total: int, threads: int, into=None) -> float:
    """Seconds to read the files of :func:`_direct_write` with O_DIRECT, one thread each.

    Into fresh page-aligned buffers, one per file (what a restore has to fill), or ``into``.
    """
    ranges = _split(total, threads)

    def job(i: int, offset: int, length: int) -> None:
        dest = _fresh(length) if into is None else into[offset : offset + length]
        fd = os.open(directory / f"f{i}", os.O_RDONLY | os.O_DIRECT)
        try:
            for o in range(0, length, REQUEST):
                view = memoryview(dest[o : min(o + REQUEST, length)])
                done = 0
                while done < len(view):
                    got = os.preadv(fd, [view[done:]], o + done)
                    if not got:
                        raise AssertionError(f"short read of {directory}/f{i}")
                    done += got
        finally:
            os.close(fd)

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(job, i, *r) for i, r in enumerate(ranges)]
        for f in futures:
            f.result()
    return time.perf_counter() - t


def _fio(directory: Path, nbytes: int, threads: int) -> dict[str, float]:
    """fio's sequential O_DIRECT write (with end fsync) and read rates, GiB/s (a cross-check)."""
    directory.mkdir()
    size = max(BLOCK, nbytes // threads // BLOCK * BLOCK)
    out = {}
    for rw in ("write", "read"):
        cmd = [
            "fio", "--name=limit", f"--directory={directory}", f"--rw={rw}",
            f"--bs={min(REQUEST, size)}",
            "--direct=1", "--ioengine=psync", f"--numjobs={threads}", f"--size={size}",
            "--end_fsync=1", "--group_reporting", "--output-format=json",
        ]  # fmt: skip
        if rw == "read":
            _evict(directory)
        report = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        out[f"fio_{rw}_gibs"] = report["jobs"][0][rw]["bw_bytes"] / GiB
    shutil.rmtree(directory)
    return out


def _run_limit(case: dict) -> dict:
    import jax
    import numpy as np

    tree = _tree(case["tree"], case["quick"])
    leaves = [np.asarray(x) for x in jax.block_until_ready(jax.tree.leaves(tree))]
    nbytes = sum(x.nbytes for x in leaves)
    work = Path(case["dir"])
    # Every leaf starts on a page of its own, as the snapshot's buffers do.
    offsets, total = [], 0
    for x in leaves:
        offsets.append(total)
        total += -(-x.nbytes // BLOCK) * BLOCK
    out: dict[str, float] = {"bytes": nbytes}

    def copy_into(buf) -> float:
        t = time.perf_counter()
        for x, o in zip(leaves, offsets, strict=True):
            np.copyto(buf[o : o + x.nbytes].view(x.dtype).reshape(x.shape), x)
        return time.perf_counter() - t

    host = _fresh(total)
    out["copy_fresh_s"] = copy_into(host)
    host[:] = 0  # (already faulted in; the zeroing keeps the first copy out of the cache)
    out["copy_s"] = copy_into(host)  # the pre-faulted copy
    for threads in THREADS:
        directory = work / f"t{threads}"
        out[f"write_{threads}_s"] = _direct_write(directory, host, threads)
        _evict(directory)
        out[f"read_{threads}_s"] = _direct_read(directory, total, threads)
        out[f"read_prefaulted_{threads}_s"] = _direct_read(directory, total, threads, host)
        shutil.rmtree(directory)
    if shutil.which("fio"):
        out |= _fio(work / "fio", total, 16)
    return out


def _run_save(case: dict) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import cocijax as cj

    tree = _tree(case["tree"], case["quick"])
    jax.block_until_ready(tree)
    leaves = jax.tree.leaves(tree)
    work = Path(case["dir"])
    out = {"bytes": sum(x.nbytes for x in leaves)}
    if case["method"] == "orbax":
        make = ocp.StandardCheckpointHandler
        save_args, restore_args = ocp.args.StandardSave, ocp.args.StandardRestore
    else:
        n_roots = int(case["method"].split("-")[1])
        roots = [work / f"root{i}" for i in range(n_roots)]
        overlap = case["method"].endswith("-overlap")
        make = lambda: cj.StripedCheckpointHandler(roots, write_while_copying=overlap)
        save_args, restore_args = cj.StripedSave, cj.StripedRestore
    with ocp.AsyncCheckpointer(make()) as ckptr:
        warm = {"w": jax.numpy.ones((256, 256))}
        ckptr.save(work / "warmup", args=save_args(warm))
        ckptr.wait_until_finished()
        with _RssSampler() as rss:
            before = rss.now()
            for name in ("first", "second"):
                t0 = time.perf_counter()
                ckptr.save(work / name, args=save_args(tree))
                t1 = time.perf_counter()
                ckptr.wait_until_finished()
                t2 = time.perf_counter()
                out[f"{name}_blocking_s"] = t1 - t0
            out |= {"blocking_s": t1 - t0, "commit_s": t2 - t0, "peak_extra": rss.peak - before}
        _evict(work)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        t = time.perf_counter()
        restored = ckptr.restore(work / "second", args=restore_args(abstract))
        jax.block_until_ready(restored)
        out["restore_s"] = time.perf_counter() - t
    del out["second_blocking_s"]
    for a, b in zip(leaves, jax.tree.leaves(restored), strict=True):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError(f"{case['method']}: restored values differ")
    return out


# ------------------------------------------------------------------------------ the driver


def _one(case: dict) -> dict:
    work = Path(tempfile.mkdtemp(prefix="cocijax-bench-", dir=case["base"]))
    try:
        return run_in_child(__file__, dict(case, dir=str(work)), label=case)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _machine(dirs: dict[str, str], when: float | None = None) -> list[str]:
    from importlib.metadata import version

    stamp = datetime.datetime.fromtimestamp(when or time.time(), datetime.UTC)

    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"- Date: {stamp:%Y-%m-%d %H:%M} UTC",
        f"- CPU: {cpu_and_ram()}; load average at the end of the run (1/5/15 min): {load}",
    ]
    for label, d in dirs.items():
        lines.append(f"- {label} ({d}): {filesystem(d)}")
    libs = ["jax", "orbax-checkpoint", "tensorstore", "numpy"]
    lines.append(
        f"- Python {platform.python_version()}, "
        + ", ".join(f"{name} {version(name)}" for name in libs)
    )
    return lines


def _limits(limit: dict) -> dict[str, float]:
    """Seconds of the best write and read (over thread counts and buffers) of a limit case."""
    writes = {t: limit[f"write_{t}_s"] for t in THREADS}
    reads = {t: limit[f"read_{t}_s"] for t in THREADS}
    reads_pre = {t: limit[f"read_prefaulted_{t}_s"] for t in THREADS}
    return {
        "write_s": min(writes.values()),
        "read_s": min(min(reads.values()), min(reads_pre.values())),
        # What a restore has to do: it returns memory it did not hold before.
        "read_fresh_s": min(reads.values()),
    }


def _cell(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _limit_table(results: dict, locations: list[str], trees: list[str]) -> list[list[str]]:
    rows = []
    for loc in locations:
        for tree in trees:
            r = results[(loc, tree, "limit")]
            gib = r["bytes"] / GiB
            best = _limits(r)
            rows.append(
                [
                    loc, f"({tree}) {r['bytes'] / MiB:.0f} MiB",
                    f"{r['copy_s']:.3f}", f"{r['copy_fresh_s']:.3f}",
                    " / ".join(f"{gib / r[f'write_{t}_s']:.2f}" for t in THREADS),
                    " / ".join(f"{gib / r[f'read_{t}_s']:.2f}" for t in THREADS),
                    " / ".join(f"{gib / r[f'read_prefaulted_{t}_s']:.2f}" for t in THREADS),
                    f"{gib / best['write_s']:.2f}", f"{gib / best['read_s']:.2f}",
                    _cell(r.get("fio_write_gibs"), ".2f"), _cell(r.get("fio_read_gibs"), ".2f"),
                ]
            )  # fmt: skip
    return rows


LIMIT_COLS = [
    "where", "tree", "pre-faulted copy s", "fresh copy s",
    f"O_DIRECT write GiB/s (T={'/'.join(map(str, THREADS))})",
    "cold O_DIRECT read GiB/s, fresh buffers", "same, pre-faulted buffers",
    "write limit GiB/s", "read limit GiB/s", "fio write GiB/s", "fio read GiB/s",
]  # fmt: skip
SAVE_COLS = [
    "where", "tree", "method", "1st save blocking s", "blocking s", "blocking / pre-faulted copy",
    "commit s", "commit GiB/s", "commit / write limit", "Orbax / commit", "restore s",
    "restore GiB/s", "restore / read limit", "restore / read into fresh buffers",
    "Orbax / restore", "peak extra / tree",
]  # fmt: skip


def _save_table(
    results: dict, locations: list[str], trees: list[str], methods: list[str]
) -> list[list[str]]:
    rows = []
    for loc in locations:
        for tree in trees:
            limit = results[(loc, tree, "limit")]
            best = _limits(limit)
            orbax = results[(loc, tree, "orbax")]
            for method in methods:
                r = results[(loc, tree, method)]
                gib = r["bytes"] / GiB
                rows.append(
                    [
                        loc, f"({tree}) {r['bytes'] / MiB:.0f} MiB", method,
                        f"{r['first_blocking_s']:.3f}", f"{r['blocking_s']:.3f}",
                        f"{r['blocking_s'] / limit['copy_s']:.2f}",
                        f"{r['commit_s']:.3f}", f"{gib / r['commit_s']:.2f}",
                        f"{best['write_s'] / r['commit_s']:.2f}",
                        f"{orbax['commit_s'] / r['commit_s']:.2f}",
                        f"{r['restore_s']:.3f}", f"{gib / r['restore_s']:.2f}",
                        f"{best['read_s'] / r['restore_s']:.2f}",
                        f"{best['read_fresh_s'] / r['restore_s']:.2f}",
                        f"{orbax['restore_s'] / r['restore_s']:.2f}",
                        f"{r['peak_extra'] / r['bytes']:.2f}",
                    ]
                )  # fmt: skip
    return rows


def _targets(results: dict, trees: list[str], loc: str, methods: list[str]) -> list[str]:
    """The issue-15 targets, checked for every cocijax root count (all must hold).

    They hold the default options; ``cocijax-1-overlap`` is shown as the trade-off it is.
    """
    out = []
    ours = [m for m in methods if m.startswith("cocijax") and not m.endswith("-overlap")]
    for tree in trees:
        limit = results[(loc, tree, "limit")]
        best = _limits(limit)
        rs = {m: results[(loc, tree, m)] for m in ours}
        checks = [
            ("durable commit >= 0.8 of the write limit", 0.8, "ge",
             {m: best["write_s"] / r["commit_s"] for m, r in rs.items()}),
            ("cold restore >= 0.8 of the read limit", 0.8, "ge",
             {m: best["read_s"] / r["restore_s"] for m, r in rs.items()}),
            ("blocking <= 1.0x the pre-faulted copy", 1.0, "le",
             {m: r["blocking_s"] / limit["copy_s"] for m, r in rs.items()}),
            ("peak extra host memory <= 1.3x the tree", 1.3, "le",
             {m: r["peak_extra"] / r["bytes"] for m, r in rs.items()}),
        ]  # fmt: skip
        for label, bound, kind, values in checks:
            ok = all(v >= bound if kind == "ge" else v <= bound for v in values.values())
            shown = ", ".join(f"{m} {v:.2f}" for m, v in values.items())
            out.append(f"- {'MET' if ok else 'NOT MET'}: ({tree}) {label}: {shown}")
        fresh = ", ".join(f"{m} {best['read_fresh_s'] / r['restore_s']:.2f}" for m, r in rs.items())
        out.append(
            f"- reference, not a target: ({tree}) cold restore / the read into fresh buffers: "
            f"{fresh}"
        )
        if f"{ours[0]}-overlap" in methods:
            shown = []
            for m in (ours[0], f"{ours[0]}-overlap"):
                r = results[(loc, tree, m)]
                shown.append(
                    f"{m} commit {best['write_s'] / r['commit_s']:.2f} of the write limit, "
                    f"blocking {r['blocking_s'] / limit['copy_s']:.2f}x the pre-faulted copy"
                )
            shown = "; ".join(shown)
            out.append(f"- trade-off, not a target: ({tree}) write_while_copying: {shown}")
    return out


def _spread(runs: dict) -> str:
    """The widest max/min ratio of commit times over the repeats of one case."""
    worst, case = 1.0, None
    for key, rs in runs.items():
        times = [r["commit_s"] for r in rs if "commit_s" in r]
        if times and min(times) > 0 and max(times) / min(times) > worst:
            worst, case = max(times) / min(times), key
    if case is None:
        return "one run per case."
    return (
        f"the commit times of one case varied by up to {worst:.1f}x between repeats "
        f"({case[0]} ({case[1]}) {case[2]}), hence interleaved repeats and same-run ratios."
    )


def _markdown(cols: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


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
        print(json.dumps(_run_limit(case) if case["method"] == "limit" else _run_save(case)))
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
        machine = _machine(locations)
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

    limit_rows = _limit_table(results, list(locations), trees)
    save_rows = _save_table(results, list(locations), trees, methods)
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
            verdicts.extend(_targets(results, trees, loc, methods))
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
                f"Noise: this is a shared virtual machine; {_spread(runs)}",
                "",
                "Machine:",
                *machine,
                "",
                "The limit (medians; GiB/s per thread count T):",
                "",
                *_markdown(LIMIT_COLS, limit_rows),
                "",
                "Saves and restores (medians):",
                "",
                *_markdown(SAVE_COLS, save_rows),
                *verdicts,
            ]
        )
        write_section(SECTION, text)
        console.print(f"Updated the {SECTION} section of {BENCH_MD.name}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
