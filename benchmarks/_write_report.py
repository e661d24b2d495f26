"""The write benchmark's report: the machine, the limit and save tables, the targets.

Every figure is a median over a case's repeats; a ratio to the limit is limit time / method
time (``benchmarks/write_bench.py``'s docstring).
"""

from __future__ import annotations

import datetime
import os
import platform
import time

from _report import cpu_and_ram, filesystem
from _write_cases import THREADS, GiB, MiB


def machine_lines(dirs: dict[str, str], when: float | None = None) -> list[str]:
    """The Markdown lines that describe the machine, its directories and the libraries."""
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


def limit_table(results: dict, locations: list[str], trees: list[str]) -> list[list[str]]:
    """The rows of the limit table (``LIMIT_COLS``), one per location and tree."""
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


def save_table(
    results: dict, locations: list[str], trees: list[str], methods: list[str]
) -> list[list[str]]:
    """The rows of the save table (``SAVE_COLS``), one per location, tree and method."""
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


def targets(results: dict, trees: list[str], loc: str, methods: list[str]) -> list[str]:
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


def spread(runs: dict) -> str:
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


def markdown_table(cols: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]
