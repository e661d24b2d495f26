"""Power loss: every crash state of a recorded save is opened by a new manager and checked.

A real run (``_powerloss_writer.py``: a :class:`cocijax.CheckpointManager` with two external
roots and ``max_to_keep=2`` saving five steps of five leaves, garbage collection included) is
recorded with ``strace -f``; ``crash_states`` computes, before every ``fsync``, ``fdatasync``
and ``rename`` of the run and at its end, the states a power loss can leave under two models
(POSIX: unsynced data and unsynced directory entries lost; journal: namespace operations kept in
order, unsynced data lost; see its docstring). Each distinct state is rebuilt in place (the
manifests record absolute paths) and checked:

* every step ``all_steps()`` lists restores bit-exact;
* the newest step whose ``wait_until_finished`` had returned before the crash point is listed
  (or ``max_to_keep`` newer ones, which retention keeps instead);
* :func:`cocijax.storage.verify` finds no problem in exactly the listed steps (a step directory
  it passes is listed, a listed one passes);
* the next save succeeds and restores, and leaves no stripe directory that no step references.

``COCIJAX_POWERLOSS_STATES`` limits how many distinct states are checked per recording
(default: all); ``COCIJAX_POWERLOSS_RECORDINGS`` records and checks the run that many times
(default 2): its threads interleave differently each time, so each recording orders the
writes, syncs and renames of the pieces, manifests and commits its own way. ``make test`` checks
the first recording, ``make test-long`` the others.
Needs ``strace`` (installed by ``make test`` where it can); skipped without it, except under CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _powerloss_writer import MAX_TO_KEEP as MAX
from _powerloss_writer import open_manager, state
from crash_states import CrashState, crash_states, rebuild, strace_command
from reliability_helpers import (
    HERE,
    child_env,
    ci_share,
    item_dir,
    orphaned_stripes,
    pieces,
    require_tool,
)

from cocijax import storage

pytestmark = pytest.mark.xdist_group("reliability-power-loss")

LIMIT = int(os.environ.get("COCIJAX_POWERLOSS_STATES", "0")) or None
RECORDINGS = int(os.environ.get("COCIJAX_POWERLOSS_RECORDINGS", "2"))
NEXT_STEP = 100


def _record(tmp_path: Path) -> tuple[str, Path]:
    base = tmp_path / "base"
    base.mkdir()
    trace = tmp_path / "trace.txt"
    done = subprocess.run(
        [*strace_command(trace), sys.executable, str(HERE / "_powerloss_writer.py"), str(base)],
        cwd=HERE,
        env=child_env(1, PYTHONPATH=str(HERE)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return trace.read_text(), base


def _same(restored: dict, want: dict) -> bool:
    import jax

    got_leaves = jax.tree.leaves(restored)
    want_leaves = jax.tree.leaves(want)
    return len(got_leaves) == len(want_leaves) and all(
        np.asarray(a).dtype == np.asarray(b).dtype
        and np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(got_leaves, want_leaves, strict=True)
    )


def check_state(crash: CrashState, base: Path) -> list[str]:
    """The invariants of one crash state, rebuilt at ``base``; returns the problems found."""
    problems: list[str] = []
    directory = base / "ckpt"
    mngr = open_manager(base)
    try:
        steps = mngr.all_steps()
        newest = crash.committed
        # Retention may have dropped it only once max_to_keep newer steps were committed.
        if newest is not None and newest not in steps and sum(s > newest for s in steps) < MAX:
            problems.append(f"step {newest} committed before the crash; listed: {steps}")
        on_disk = (
            sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
            if directory.is_dir()
            else []
        )
        for step in on_disk:
            intact = storage.verify(item_dir(directory, step)) == []
            if intact != (step in steps):
                problems.append(f"step {step}: verify says intact={intact}, listed={step in steps}")
        for step in steps:
            try:
                restored = mngr.restore(step)
            except Exception as e:
                problems.append(f"listed step {step} does not restore: {type(e).__name__}: {e}")
                continue
            if not _same(restored, state(step)):
                problems.append(f"listed step {step} restored a different tree")
        try:
            mngr.save(NEXT_STEP, state(NEXT_STEP), loss=1.0, force=True)
            mngr.wait_until_finished()
        except Exception as e:
            problems.append(f"the next save failed: {type(e).__name__}: {e}")
            return problems
        if NEXT_STEP not in mngr.all_steps() or not _same(
            mngr.restore(NEXT_STEP), state(NEXT_STEP)
        ):
            problems.append("the next save did not commit a restorable step")
        if orphans := orphaned_stripes(mngr):
            problems.append(f"orphaned stripes after the next save: {orphans}")
    finally:
        mngr.close()
    return problems


@pytest.mark.parametrize("recording", ci_share(range(RECORDINGS), 1))
def test_every_crash_state_of_a_save_opens_restores_and_saves_again(
    tmp_path: Path, recording: int
) -> None:
    require_tool("strace", "records the file-system operations of a save")
    started = time.monotonic()
    trace, base = _record(tmp_path)
    recorded = time.monotonic()
    states, replay = crash_states(trace, base, HERE)
    # The model must account for every byte the run left, or its states could be wrong.
    replay.check_against(base)
    assert "committed/5" in replay.marks and "closed" in replay.marks, replay.marks
    distinct: dict[str, CrashState] = {}
    for crash in states:
        distinct.setdefault(crash.digest(), crash)
    checked = list(distinct.values())[:LIMIT]
    failures = []
    for crash in checked:
        rebuild(crash, base)
        problems = check_state(crash, base)
        if problems:
            failures.append((crash.model, crash.boundary, crash.before, problems))
            if os.environ.get("COCIJAX_POWERLOSS_KEEP"):
                shutil.copytree(base, tmp_path / f"failed-{crash.model}-{crash.boundary}")
    shutil.rmtree(base)
    boundaries = len({(s.boundary) for s in states})
    kinds = Counter(s.before.split("@")[0] for s in states if s.model == "posix")
    print(
        f"\npower loss, recording {recording}: {len(states)} crash states ({boundaries} "
        f"boundaries: {dict(kinds)}; x 2 models), {len(distinct)} distinct, {len(checked)} "
        f"checked, {len(failures)} with problems; recording {recorded - started:.1f} s, "
        f"checks {time.monotonic() - recorded:.1f} s"
    )
    assert not failures, "\n".join(map(str, failures[:10]))


def test_the_state_checker_reports_damage(tmp_path: Path) -> None:
    """``check_state`` is what every crash state relies on: it must see a lost step and bad data."""
    base = tmp_path / "base"
    crash = CrashState("posix", 0, "end", ("committed/1", "committed/2"), {})
    for damaged in (False, True):
        if base.exists():
            shutil.rmtree(base)
        with open_manager(base) as mngr:
            for step in (1, 2):
                mngr.save(step, state(step), loss=1.0, force=True)
        if not damaged:
            assert check_state(crash, base) == []
    # A committed step gone, and a chunk file of the other one cut short.
    shutil.rmtree(base / "ckpt" / "2")
    chunk = pieces(item_dir(base / "ckpt", 1))[0].files[-1]
    chunk.write_bytes(chunk.read_bytes()[:-8])
    text = "\n".join(check_state(crash, base))
    assert "step 2 committed before the crash; listed: [1]" in text, text
    assert "step 1: verify says intact=False, listed=True" in text, text
    assert "listed step 1 does not restore" in text, text
