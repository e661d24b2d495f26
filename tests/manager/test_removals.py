"""Deleting dropped steps happens between saves: never while a save is in flight (issue 29.2).

Removing a dropped step while the next save writes slowed that write, which the save after it
waits for; the remover now waits until the save in flight commits, within a bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import jax.numpy as jnp

import cocijax as cj
from cocijax.manager._gc import Remover
from cocijax.storage import _commit

HANG_GUARD_S = 30.0


class Writing:
    """A ``writing`` predicate the test sets, which says when the remover has asked twice."""

    def __init__(self) -> None:
        self.in_flight = True
        self.calls = 0
        self.asked_twice = threading.Event()

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls >= 2:
            self.asked_twice.set()
        return self.in_flight


def tree(folder: Path) -> Path:
    (folder / "a" / "b").mkdir(parents=True)
    for name in ("x", "a/y", "a/b/z"):
        (folder / name).write_bytes(b"data")
    return folder


def gone(path: Path, timeout_s: float = HANG_GUARD_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    return not path.exists()


def test_a_removal_waits_for_the_save_in_flight_and_runs_once_it_commits(tmp_path):
    writing = Writing()
    remover = Remover(writing)
    dropped = tree(tmp_path / "dropped")
    remover.remove([dropped])
    assert writing.asked_twice.wait(HANG_GUARD_S)
    assert (dropped / "a" / "b" / "z").exists()  # asked again after waiting: still there
    writing.in_flight = False  # the save committed
    assert gone(dropped)
    assert remover.wait(HANG_GUARD_S)


def test_an_older_removal_waits_no_more_once_a_newer_one_comes(tmp_path):
    # Saves back to back: never a moment without a save in flight. At most one collection's
    # garbage waits, so the disk holds at most one dropped step more than it keeps.
    writing = Writing()
    remover = Remover(writing)
    older, newer = tree(tmp_path / "older"), tree(tmp_path / "newer")
    remover.remove([older])
    assert writing.asked_twice.wait(HANG_GUARD_S)
    remover.remove([newer])
    assert gone(older)
    writing.calls = 0
    writing.asked_twice.clear()
    assert writing.asked_twice.wait(HANG_GUARD_S)
    assert newer.exists()
    assert remover.wait(HANG_GUARD_S)  # wait() removes at once, a save in flight or not
    assert not newer.exists()


def test_a_removal_waits_while_a_save_starts(tmp_path):
    # Between finding its garbage and Orbax's save being in flight, a save is not "writing"
    # yet; what it found must not start going then.
    writing = Writing()
    writing.in_flight = False
    remover = Remover(writing)
    dropped = tree(tmp_path / "dropped")
    with remover.starting_save():
        remover.remove([dropped])
        time.sleep(0.1)  # the remover's thread has every chance to start meanwhile
        assert (dropped / "a" / "b" / "z").exists()
    assert gone(dropped)


def test_a_removal_does_not_wait_on_a_predicate_that_fails(tmp_path):
    def writing() -> bool:
        raise RuntimeError("the manager is closed")

    remover = Remover(writing)
    dropped = tree(tmp_path / "dropped")
    remover.remove([dropped])
    assert gone(dropped)


def test_the_dropped_step_is_not_removed_while_the_next_save_writes(tmp_path, monkeypatch):
    root = tmp_path / "root"
    entered, release = threading.Event(), threading.Event()
    commit = _commit.Writer.commit

    async def held_commit(self, directory, snapshot):
        # Step 3's save stays in flight until released (or until the stripe of the dropped
        # step 1 is gone, which is the failure this test looks for).
        if Path(directory).parent.name.split(".")[0] == "3":
            entered.set()
            while not release.is_set():
                await asyncio.sleep(0.005)
        return await commit(self, directory, snapshot)

    monkeypatch.setattr(_commit.Writer, "commit", held_commit)
    with cj.CheckpointManager(
        tmp_path / "ckpt", roots=[root], policy=cj.policies.fixed(1), max_to_keep=1
    ) as mngr:
        mngr.save(1, {"w": jnp.ones(4096)}, loss=1.0)
        mngr.wait_until_finished()
        (stripe_1,) = root.rglob("cocijax-stripe-*")
        mngr.save(2, {"w": jnp.ones(4096)}, loss=1.0)
        mngr.save(3, {"w": jnp.ones(4096)}, loss=1.0)  # drops step 1 (committed with 2)
        assert entered.wait(HANG_GUARD_S)
        removed_in_flight = gone(stripe_1, timeout_s=1.0)
        release.set()
        mngr.wait_until_finished()
        assert not removed_in_flight, "step 1's stripe was removed while step 3 was saving"
        assert not stripe_1.exists()  # and removed once step 3 committed
        assert mngr.all_steps() == [3]
