"""A refused writer is told who holds the directory: process, host and since when.

The lock is the ``flock``; the holder's record in the lock file is information only, and a
record left by a writer that died blocks nobody.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cocijax as cj
from cocijax.core._lock import DirectoryLock
from cocijax.manager import DirectoryLockedError

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from cocijax.core._lock import DirectoryLock

    DirectoryLock(Path(sys.argv[1])).acquire()
    print("locked", flush=True)
    time.sleep(600)
    """
)


def _holder(directory: Path) -> subprocess.Popen[str]:
    """A process holding the lock of ``directory`` until it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _refusal(directory: Path) -> str:
    with pytest.raises(DirectoryLockedError) as info:
        DirectoryLock(directory).acquire()
    return str(info.value)


def test_the_error_names_the_holding_process_host_and_time(tmp_path):
    holder = _holder(tmp_path)
    try:
        message = _refusal(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert f"by another CheckpointManager: process {holder.pid} on host " in message, message
    assert f"on host {socket.gethostname()} since " in message
    assert re.search(r"since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", message), message
    assert str(tmp_path / ".cocijax.lock") in message and "this process" not in message


def test_a_dead_holders_record_blocks_nobody(tmp_path):
    holder = _holder(tmp_path)
    holder.send_signal(signal.SIGKILL)  # no release: its record stays in the lock file
    holder.wait()
    assert f'"pid": {holder.pid}' in (tmp_path / ".cocijax.lock").read_text()
    lock = DirectoryLock(tmp_path)
    lock.acquire()  # the kernel freed the flock; the stale record is overwritten
    try:
        message = _refusal(tmp_path)
        assert f"process {os.getpid()} (this process) on host" in message, message
        assert str(holder.pid) not in message
    finally:
        lock.release()
    DirectoryLock(tmp_path).acquire()


def test_a_manager_refused_by_a_writer_of_this_process_says_so(tmp_path):
    with (
        cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)),
        pytest.raises(DirectoryLockedError, match=r"\(this process\) on host"),
    ):
        cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1))


def test_an_unreadable_record_still_gives_the_error(tmp_path):
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    try:
        lock.path.write_text("not json")  # e.g. a holder that has not written its record yet
        assert "by another CheckpointManager: a process that did not record" in _refusal(tmp_path)
    finally:
        lock.release()
