"""``_hosts.restore_together``: the processes of a host-local job restore the same step.

The exchange between processes is replaced by the other process's scripted answers (this
process's own answer is the one it would send); the real exchange is tested with real
processes in tests/reliability/test_host_local.py and test_multiprocess_memory.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cocijax.manager import _hosts


class _Manager:
    """What ``restore_together`` uses of a manager: its listing, hidden steps, restored step."""

    def __init__(self, steps: list[int]):
        self._steps = steps
        self._hidden: set[int] = set()
        self._latest_saved: int | None = max(steps)
        self._store_timeout_s = 1.0
        self._directory = "ckpt"
        self.restored_step: int | None = None

    def all_steps(self) -> list[int]:
        return [s for s in self._steps if s not in self._hidden]

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)


def _other(monkeypatch: pytest.MonkeyPatch, answers: list[dict[str, Any]]) -> list[Any]:
    """Process 1 answers ``answers`` in turn; returns what this process (0) sent."""
    sent: list[Any] = []
    theirs: Iterator[dict[str, Any]] = iter(answers)

    def exchange(what: str, payload: Any, *, timeout_s: float) -> list[Any]:
        sent.append(payload)
        return [payload, next(theirs)]

    monkeypatch.setattr(_hosts, "exchange", exchange)
    return sent


def _restoring(mngr: _Manager, restorable: set[int]) -> tuple[Any, list[int]]:
    """This process's restore with fallback: the newest listed step it can restore."""
    reads: list[int] = []

    def restore_newest() -> str:
        step = max(s for s in mngr.all_steps() if s in restorable)
        reads.append(step)
        mngr.restored_step = step
        return f"state {step}"

    return restore_newest, reads


def test_processes_that_restored_different_steps_all_go_to_the_oldest(monkeypatch):
    # This process restores 6; process 1 could only restore 4 (its copies of 6 damaged).
    mngr = _Manager([2, 4, 6])
    sent = _other(
        monkeypatch,
        [
            {"tried": 6, "restored": 4, "fatal": None},
            {"tried": 4, "restored": 4, "fatal": None},
        ],
    )
    restore_newest, reads = _restoring(mngr, {2, 4, 6})
    assert _hosts.restore_together(mngr, restore_newest, damage=()) == "state 4"
    assert reads == [6, 4] and mngr.restored_step == 4
    assert [a["restored"] for a in sent] == [6, 4]
    assert mngr._hidden == {6} and mngr._latest_saved == 4


def test_the_process_on_the_oldest_step_does_not_read_it_again(monkeypatch):
    # This process could restore only 4; process 1 restored 6, then 4.
    mngr = _Manager([2, 4, 6])
    sent = _other(
        monkeypatch,
        [
            {"tried": 6, "restored": 6, "fatal": None},
            {"tried": 4, "restored": 4, "fatal": None},
        ],
    )
    restore_newest, reads = _restoring(mngr, {2, 4})
    assert _hosts.restore_together(mngr, restore_newest, damage=()) == "state 4"
    assert reads == [4]  # once: the second round keeps it
    assert [a["restored"] for a in sent] == [4, 4]


def test_another_process_that_restores_nothing_fails_every_process(monkeypatch):
    mngr = _Manager([2, 4])
    error = "CorruptCheckpointError: no intact step"
    _other(monkeypatch, [{"tried": 4, "restored": None, "fatal": error}])
    restore_newest, _ = _restoring(mngr, {2, 4})
    with pytest.raises(_hosts.HostsError, match=f"process 1 failed to restore step 4.*{error}"):
        _hosts.restore_together(mngr, restore_newest, damage=())
