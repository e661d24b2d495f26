"""What every benchmark records beside its numbers: the machine and its BENCHMARKS.md section."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def cpu_and_ram() -> str:
    """``<CPU model>, <n> cores; RAM <n> GiB`` read from /proc (``?`` where unavailable)."""
    cpu, ram = "unknown CPU", "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
        with open("/proc/meminfo") as f:
            ram = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores; RAM {ram}"


def filesystem(path: str) -> str:
    """``fstype on device (mounted at ...)`` for the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) > len(best[0]):
                best = (mnt, dev, fstype)
    mnt, dev, fstype = best
    return f"{fstype} on {dev} (mounted at {mnt})"


def machine_line(directory: str, *versions: str) -> str:
    """``Machine: <CPU, RAM>; <file system of directory>; <UTC time>; Python <x>[, versions].``"""
    stamp = datetime.datetime.now(datetime.UTC)
    python = ", ".join([f"Python {sys.version.split()[0]}", *versions])
    return (
        f"Machine: {cpu_and_ram()}; {filesystem(directory)}; {stamp:%Y-%m-%d %H:%M} UTC; {python}."
    )


def write_section(section: str, text: str) -> None:
    """Replaces the lines between ``<!-- BEGIN section -->`` and ``<!-- END section -->``.

    Other sections of BENCHMARKS.md stay as they are; a missing section is appended.
    """
    begin, end = f"<!-- BEGIN {section} -->", f"<!-- END {section} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    current = BENCH_MD.read_text() if BENCH_MD.exists() else "# Benchmarks\n\n"
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + block + ("\n" + tail if tail else "")
    else:
        new = current.rstrip("\n") + "\n\n" + block
    BENCH_MD.write_text(new)


def run_in_child(script: str, case: dict, *, label: object = None, **run_options) -> dict:
    """Runs ``python script --_case <case as JSON>`` in a fresh process; its last line, parsed.

    A benchmark measures each case in a process of its own (nothing cached, clean memory
    accounting); ``run_options`` go to ``subprocess.run`` (``env``, ``cwd``).

    Raises:
      RuntimeError: the case failed; names it (``label``, default the case) with its stderr.
    """
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), "--_case", json.dumps(case)],
        capture_output=True,
        text=True,
        check=False,
        **run_options,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"case {case if label is None else label} failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])
