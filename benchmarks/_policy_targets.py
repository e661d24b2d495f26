"""The policy benchmark's targets: the cases' rows summarised per group, checked."""

from __future__ import annotations

import math
import statistics


def summarise(rows: list[dict], sets: tuple[str, ...], scens: tuple[str, ...]) -> dict:
    """Medians and extremes of the rows of the curve sets ``sets`` and scenarios ``scens``."""
    sel = [r for r in rows if r["set"] in sets and r["scen"] in scens]
    if not sel:
        return {}
    fin = lambda key: [r[key] for r in sel if math.isfinite(r[key])]
    return dict(
        cases=len(sel),
        capture_median=statistics.median(fin("capture")),
        capture_min=min(fin("capture")),
        capture_nt_median=statistics.median(fin("capture_nt")),
        capture_nt_min=min(fin("capture_nt")),
        capture_early_median=statistics.median(fin("capture_early")),
        capture_over_median=statistics.median(fin("capture_over")),
        worst_early=max(r["vs_classic_early"] for r in sel),
        worst_over=max(r["vs_classic_over"] for r in sel),
        capture_trend_median=statistics.median(fin("capture_trend") or [math.nan]),
        capture_trend_min=min(fin("capture_trend") or [math.nan]),
        vs_bound_median=statistics.median(fin("vs_bound")),
        vs_bound_max=max(fin("vs_bound")),
        trend_vs_bound_median=statistics.median(fin("trend_vs_bound") or [math.nan]),
        trend_vs_bound_max=max(fin("trend_vs_bound") or [math.nan]),
        worst=max(r["vs_classic"] for r in sel),
        worst_nt=max(r["vs_classic_nt"] for r in sel),
        wall=max(max(r["wall_vs_young"], r["wall_vs_young_nt"]) for r in sel),
        bound_red=statistics.median(r["bound_red"] for r in sel),
        scratch_median=statistics.median(fin("scratch_vs_told") or [math.nan]),
        scratch_max=max(fin("scratch_vs_told") or [math.nan]),
        scratch_nt_median=statistics.median(fin("scratch_vs_told_nt") or [math.nan]),
        scratch_nt_max=max(fin("scratch_vs_told_nt") or [math.nan]),
    )


def targets(s: dict) -> list[tuple[str, str, str]]:
    """``(target, measured, status)`` of a :func:`summarise` summary."""
    ok = lambda b: "met" if b else "NOT met"
    rows = [
        ("median capture >= 90% (coci)", f"{s['capture_median']:.0%}",
         ok(s["capture_median"] >= 0.9)),
        ("no case below 70% (coci)", f"min {s['capture_min']:.0%}", ok(s["capture_min"] >= 0.7)),
        ("no case worse than best classic (coci)", f"worst {s['worst']:+.2%}", ok(s["worst"] <= 0)),
        (
            "median capture >= 75% (no total)",
            f"{s['capture_nt_median']:.0%}",
            ok(s["capture_nt_median"] >= 0.75),
        ),
        (
            "no case worse than best classic by > 1% (no total)",
            f"worst {s['worst_nt']:+.2%}",
            ok(s["worst_nt"] <= 0.01),
        ),
        ("wall overhead <= 1.4x Young's (both)", f"max {s['wall']:.2f}x", ok(s["wall"] <= 1.4)),
        ("coci's weighted overhead above the bound (median, max)",
         f"{s['vs_bound_median']:+.1%}, max {s['vs_bound_max']:+.1%}", "measure"),
        ("coci told 1.25 N (stopped at 80%): capture (median), worst vs best classic",
         f"{s['capture_early_median']:.0%}, worst {s['worst_early']:+.2%}", "measure"),
        ("coci told 0.8 N (ran 25% over): capture (median), worst vs best classic",
         f"{s['capture_over_median']:.0%}, worst {s['worst_over']:+.2%}", "measure"),
    ]  # fmt: skip
    if math.isfinite(s["capture_trend_median"]):  # A and B: exact expectations
        rows += [
            ("coci from scratch (early save at step 2) within +1% of coci told step time and "
             "cost from step 1 (median; max)",
             f"{s['scratch_median']:+.2%}; max {s['scratch_max']:+.2%}",
             ok(s["scratch_median"] <= 0.01)),
            ("the same, coci no total (median; max)",
             f"{s['scratch_nt_median']:+.2%}; max {s['scratch_nt_max']:+.2%}",
             ok(s["scratch_nt_median"] <= 0.01)),
            ("reference: the trend oracle's capture (median, min)",
             f"{s['capture_trend_median']:.0%}, min {s['capture_trend_min']:.0%}", "reference"),
            ("reference: the trend oracle above the bound (median, max)",
             f"{s['trend_vs_bound_median']:+.1%}, max {s['trend_vs_bound_max']:+.1%}",
             "reference"),
        ]  # fmt: skip
    return rows


def print_targets(console, summaries: dict, targets) -> None:
    """Prints one rich table of ``targets(summary)`` rows per non-empty summary."""
    from rich.table import Table

    for title, s in summaries.items():
        if not s:
            continue
        t = Table(title=f"targets: {title} ({s['cases']} cases)")
        for col in ("target", "measured", "status"):
            t.add_column(col)
        for row in targets(s):
            t.add_row(*row)
        console.print(t)
