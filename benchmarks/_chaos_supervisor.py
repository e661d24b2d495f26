"""The chaos benchmark's supervisor: runs the training job, kills it at failure times, restarts it.

The job (``benchmarks/chaos_job.py``) appends a JSON record per event to its log; the supervisor
follows the log (:class:`LogTail`) to start the failure clock with training, and appends its own
``spawn`` and ``kill`` records (:func:`append`) while no job process is alive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np


def poisson_failures(seed: int, mtbf_s: float):
    """Failure times in seconds (an endless increasing sequence), the same for every config."""
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        t += float(rng.exponential(mtbf_s))
        yield t


def mixed_failures(seed: int, mtbf_s: float, machine_share: float):
    """The failures of :func:`poisson_failures` (the same times), each with its class:
    ``(t, machine)`` pairs, a machine failure with probability ``machine_share``, drawn from a
    generator of its own so that the classes are the same for every config of a seed."""
    classes = np.random.default_rng((seed, 1))
    for t in poisson_failures(seed, mtbf_s):
        yield t, bool(classes.random() < machine_share)


def append(log: Path, record: dict) -> None:
    """Adds a supervisor record to the job's log (only while no job process is alive)."""
    with log.open("a+b") as f:
        # A line the killed job was writing may be torn: end it, so that ours stays whole.
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(json.dumps(record).encode() + b"\n")


def records(lines: list[bytes] | list[str]):
    """The JSON records of a log's lines, without the lines a kill tore."""
    for line in lines:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


class LogTail:
    """Follows the records a running job appends to its log."""

    def __init__(self, path: Path, n_steps: int):
        self.path, self.n_steps, self.offset = path, n_steps, 0
        self.ready: float | None = None  # the first process's start of training
        self.trained = False  # the last step is logged

    def update(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        for r in records(data[:end].splitlines()):
            if r.get("event") == "ready" and self.ready is None:
                self.ready = r["t"]
            self.trained = self.trained or r.get("step") == self.n_steps


def supervise(
    cmd: list[str],
    log: Path,
    failures,
    n_steps: int,
    timeout_s: float,
    env: dict | None = None,
    lose_machine=None,
) -> None:
    """Runs ``cmd`` until it has trained ``n_steps``, killing it at the given failure times.

    ``failures`` yields seconds after the first process's ``ready`` record (the start of
    training), or ``(seconds, machine)`` pairs; a failure due after the last step was logged is
    not delivered. After the kill of a machine failure, ``lose_machine()`` deletes what the
    machine held (the memory tier, the local disk) before the restart. Each kill (``machine``
    says its class) and each start is appended to the log (``kill`` and ``spawn`` records).

    Raises:
      RuntimeError: the job exited with an error of its own, or ran past ``timeout_s``.
    """
    stderr = log.with_suffix(".stderr")
    tail = LogTail(log, n_steps)
    deadline = time.monotonic() + timeout_s

    def spawn() -> subprocess.Popen:
        append(log, {"event": "spawn", "t": time.monotonic()})
        with stderr.open("a") as err:
            # A session of its own: the kill takes the job's whole process group, as a node
            # failure would.
            return subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env
            )

    def kill(proc: subprocess.Popen) -> float:
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return t

    def wait(proc: subprocess.Popen, until: float) -> bool:
        """Waits until ``until``; False if the process ended first (raises on an error)."""
        try:
            proc.wait(timeout=max(0.0, min(until, deadline) - time.monotonic()))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                kill(proc)
                raise RuntimeError(f"chaos_job ran past {timeout_s:.0f} s: {log}") from None
            return True
        if proc.returncode != 0:
            text = stderr.read_text()[-3000:] if stderr.exists() else ""
            raise RuntimeError(f"chaos_job exited with {proc.returncode}: {cmd}\n{text}")
        return False

    proc = spawn()
    try:
        while tail.ready is None:  # the failure clock starts with training
            if not wait(proc, time.monotonic() + 0.02):
                return
            tail.update()
        for failure in failures:
            offset, machine = failure if isinstance(failure, tuple) else (failure, False)
            if not wait(proc, tail.ready + offset):
                return
            tail.update()
            if tail.trained:  # nothing left to destroy
                break
            t = kill(proc)
            if machine:
                lose_machine()
            append(log, {"event": "kill", "t": t, "machine": machine})
            proc = spawn()
        wait(proc, deadline)
    finally:
        if proc.poll() is None:  # interrupted (e.g. Ctrl-C): leave no job running
            kill(proc)
