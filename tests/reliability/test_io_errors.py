"""Injected I/O errors: libfiu makes file calls fail at random while a manager saves.

Each chain is one process started with ``fiu-run -x`` (libfiu's POSIX wrappers preloaded) that
runs seeded trials on one checkpoint directory; ``_fiu_worker.py`` says what a trial does and
checks. This test collects the trials' JSON lines and fails on any problem, on a process that
did not finish its trials (a crash or a hang: the worker dumps its threads and exits after
``trial_timeout_s``), and on a trial run that injected no error at all.

``COCIJAX_FIU_TRIALS`` sets the number of trials (default 200, over four chains: ``make test``
runs the first two, ``make test-long`` the others), ``COCIJAX_FIU_SEED`` the seed. Needs
``fiu-run`` (Debian's ``fiu-utils``, installed by ``make test`` where it can); skipped without
it, except under CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from reliability_helpers import HERE, child_env, ci_share, require_tool

TRIALS = int(os.environ.get("COCIJAX_FIU_TRIALS", "200"))
SEED = int(os.environ.get("COCIJAX_FIU_SEED", "20261207"))
CHAINS = 4
PROBABILITIES = [0.002, 0.005, 0.01, 0.02, 0.03]


@pytest.mark.parametrize("chain", ci_share(range(CHAINS), 1))
def test_io_errors_surface_named_and_lose_nothing(tmp_path: Path, chain: int) -> None:
    fiu_run = require_tool("fiu-run", "injects I/O errors with libfiu")
    trials = TRIALS // CHAINS + (1 if chain < TRIALS % CHAINS else 0)
    base = tmp_path / "fiu"
    base.mkdir()
    cfg = {
        "base": str(base),
        "trials": trials,
        "seed": SEED + chain,
        "probabilities": PROBABILITIES,
        "trial_timeout_s": 120,
    }
    started = time.monotonic()
    done = subprocess.run(
        [fiu_run, "-x", sys.executable, str(HERE / "_fiu_worker.py"), json.dumps(cfg)],
        cwd=HERE,
        env=child_env(1),
        capture_output=True,
        text=True,
        timeout=120 + 30 * trials,
    )
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(records) == trials, (
        f"the worker ended with status {done.returncode} after {len(records)} of {trials} "
        f"trials: {done.stderr[-4000:]}"
    )
    problems = [(r["trial"], r["seed"], p) for r in records for p in r["problems"]]
    # The first trial with a problem in full (its errors, log and directory) to diagnose it.
    first = next((r for r in records if r["problems"]), None)
    assert not problems, "\n".join(map(str, problems[:10])) + "\n" + json.dumps(first, indent=1)
    errors = Counter(f"{e['where']}: {e['type']}" for r in records for e in r["errors"])
    faulted = sum(bool(r["errors"]) for r in records)
    assert faulted > trials // 2, f"only {faulted} of {trials} trials saw an injected error"
    print(
        f"\nlibfiu chain {chain}: {trials} trials in {time.monotonic() - started:.0f} s, "
        f"{faulted} with errors ({sum(errors.values())} raised: {dict(errors.most_common(6))}), "
        "0 problems"
    )


def _scenarios(script: str, tmp_path: Path, count: int) -> dict[str, dict]:
    """Runs a scenario script under ``fiu-run``; its records by scenario, all completed."""
    fiu_run = require_tool("fiu-run", "injects I/O errors with libfiu")
    done = subprocess.run(
        [fiu_run, "-x", sys.executable, str(HERE / script), str(tmp_path)],
        cwd=HERE,
        env=child_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    records = {
        r["scenario"]: r
        for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    }
    assert len(records) == count, f"status {done.returncode}: {done.stderr[-4000:]}"
    for name, r in records.items():
        assert "crashed" not in r, f"{name}: {r['crashed']}"
    return records


def test_close_under_faults_releases_the_lock_and_keeps_failures_counted(tmp_path: Path) -> None:
    """A close that fails (a failed save, a marker that cannot be removed) still unlocks.

    ``_fiu_close.py`` runs three scenarios in one process under ``fiu-run``; after each, the
    same process opens the directory again. What the next run must count: nothing after a
    failed save (the run did close); one failure after a marker that could not be removed
    (it cannot tell); after a crash, the crash once, until a committed save records it.
    """
    records = _scenarios("_fiu_close.py", tmp_path, 3)
    for name, r in records.items():
        assert r["errors"], f"{name}: no injected error surfaced"
        assert all(str(tmp_path / name) in e for e in r["errors"]), r["errors"]
        assert r["lock_free"], f"{name}: the failed close kept the lock"
        assert r["steps"] == [1] and r["restores"], r
        assert not r["marker_after_clean_close"], r
    # A failed save, then close: the run ended, no failure.
    assert records["failed-save"]["failures"] == 0
    assert not records["failed-save"]["marker_left"]
    # The marker could not be removed: the error names it; the next run counts one failure.
    unlink = records["marker-unlink-fails"]
    assert any(".cocijax-running" in e for e in unlink["errors"]), unlink["errors"]
    assert unlink["marker_left"] and unlink["failures"] == 1
    # The crash is in no committed checkpoint yet: its marker stays and it is counted once,
    # by the next run and, after that run's save records it, by the one after.
    crash = records["crash-then-failed-save"]
    assert crash["failures_at_open"] == 1 and crash["marker_left"]
    assert crash["failures"] == 1 and crash["failures_after_clean_close"] == 1


def test_aimed_faults_never_delete_a_committed_step_or_commit_without_manifest(
    tmp_path: Path,
) -> None:
    """The two irreversible decisions the random trials caught going wrong, with certain faults.

    ``_fiu_aimed.py``: garbage collection asks which stripes two committed steps reference
    while every ``open`` fails with ENOENT (it must answer "unknown", and nothing is removed);
    the handler merges a manifest part while every ``opendir`` fails with EACCES (it must
    raise, not report "nothing to merge", which let Orbax commit a step without a manifest).
    """
    records = _scenarios("_fiu_aimed.py", tmp_path, 2)
    gc = records["gc-open-enoent"]
    assert gc["garbage"] is None, f"collected a committed step's stripes: {gc['garbage']}"
    assert gc["intact"] == [True, True]
    merge = records["merge-opendir-eacces"]
    assert merge["merge"].startswith("PermissionError") and str(tmp_path) in merge["merge"], merge
    assert not merge["manifest_after_fault"] and merge["verifies_after_merge"], merge
