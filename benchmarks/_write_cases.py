"""The write benchmark's cases, each run in a subprocess of its own: the limit, and a save.

:func:`run_limit` measures what the machine allows for a tree's bytes (copies into host memory,
parallel ``O_DIRECT`` writes and cold reads, fio as a cross-check); :func:`run_save` saves the
tree twice with Orbax's or cocijax's handler, restores it cold and checks its values. How and
why: ``benchmarks/write_bench.py``'s docstring.
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20
THREADS = (4, 8, 16, 32)  # parallel O_DIRECT streams of the limit
REQUEST = 8 * MiB  # bytes per O_DIRECT request of the limit
BLOCK = 4096


def make_tree(name: str, quick: bool):
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


def evict_page_cache(path: Path) -> None:
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
            evict_page_cache(directory)
        report = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        out[f"fio_{rw}_gibs"] = report["jobs"][0][rw]["bw_bytes"] / GiB
    shutil.rmtree(directory)
    return out


def run_limit(case: dict) -> dict:
    """The limit case: copy, O_DIRECT write and read times of the tree's bytes (seconds)."""
    import jax
    import numpy as np

    tree = make_tree(case["tree"], case["quick"])
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
        evict_page_cache(directory)
        out[f"read_{threads}_s"] = _direct_read(directory, total, threads)
        out[f"read_prefaulted_{threads}_s"] = _direct_read(directory, total, threads, host)
        shutil.rmtree(directory)
    if shutil.which("fio"):
        out |= _fio(work / "fio", total, 16)
    return out


def run_save(case: dict) -> dict:
    """A save case: blocking, commit and cold restore seconds, and the peak extra memory."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import cocijax as cj

    tree = make_tree(case["tree"], case["quick"])
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
        evict_page_cache(work)
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
