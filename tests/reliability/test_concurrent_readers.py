"""Readers in other processes while a writer saves and deletes (``max_to_keep=1``).

A read-only manager never returns a mixed or partial tree. When the step it reads is deleted
under it, ``restore()`` starts again with the newest step, ``restore(step)`` raises
``StepDeletedError`` naming the step, and ``cocijax verify`` skips the step (exit status 0).

Two kinds of tests, both with real processes (the scripts are in ``_readers.py``):

* **Aimed**: a reader is stopped with SIGSTOP as soon as it has a file of the step's stripes
  open (read from ``/proc/PID/fd``), the writer (this process) saves the next step, which
  deletes that one and removes its stripes, and the reader is let go on with SIGCONT. Each of
  the three outcomes above is shown every time.
* **Loop**: a writer saves as fast as it can for ``COCIJAX_READERS_S`` seconds (default 20;
  ``make test-long`` runs it again for ``COCIJAX_READERS_LONG_S``, default 300) while two
  readers restore (the newest step and the step they listed just before) and run ``cocijax
  verify`` in a loop: no problem may appear; the test prints how often a step was deleted
  under a reader.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _readers import HANDLER_OPTIONS, state
from reliability_helpers import HERE, child_env

import cocijax as cj

DURATION_S = float(os.environ.get("COCIJAX_READERS_S", "20"))
LONG_DURATION_S = float(os.environ.get("COCIJAX_READERS_LONG_S", "300"))
# 2 MiB leaves in 4 KiB chunks: a read opens about a thousand files, so a reader seen with one
# of them open is stopped long before it has opened them all.
ROWS = 2048
AIMED_OPTIONS = {**HANDLER_OPTIONS, "chunk_bytes": 4096}


def _spawn(mode: str, cfg: dict) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "_readers.py"), mode, json.dumps(cfg)],
        env=child_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _reading(pid: int, roots: list[Path], timeout_s: float = 60.0) -> bool:
    """Waits until process ``pid`` has a file under ``roots`` open."""
    prefixes = tuple(str(r) for r in roots)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            return False  # it ended
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefixes):
                    return True
            except OSError:
                continue
    return False


@pytest.mark.parametrize("what", ["newest", "step", "verify"])
def test_a_step_deleted_under_a_reader(tmp_path: Path, what: str) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to see which files the reader has open")
    roots = [tmp_path / "root0", tmp_path / "root1"]
    with cj.CheckpointManager(
        tmp_path / "ckpt",
        roots=roots,
        policy=cj.policies.fixed(1),
        max_to_keep=1,
        handler_options=AIMED_OPTIONS,
    ) as writer:
        writer.save(1, state(1, ROWS), loss=1.0, force=True)
        writer.wait_until_finished()
        reader = _spawn("once", {"base": str(tmp_path), "what": what, "rows": ROWS})
        try:
            assert json.loads(reader.stdout.readline()) == {"listed": [1]}, reader.stderr.read()
            assert _reading(reader.pid, roots), "the reader never opened a file of step 1"
            reader.send_signal(signal.SIGSTOP)
            try:
                writer.save(2, state(2, ROWS), loss=1.0, force=True)
                writer.wait_until_finished()  # step 1 renamed away, its stripes removed
                assert writer.all_steps() == [2]
            finally:
                reader.send_signal(signal.SIGCONT)
            out, err = reader.communicate(timeout=120)
        finally:
            reader.kill()
    result = json.loads(out.splitlines()[-1])
    print(f"{what}: {result}")
    if what == "newest":  # retried with the newest step, transparently
        assert result.get("restored_step") == 2 and result["same"], (result, err[-3000:])
    elif what == "step":
        assert result.get("error", {}).get("type") == "StepDeletedError", (result, err[-3000:])
        assert "step 1 " in result["error"]["message"]
    else:
        assert result.get("status") == 0, (result, err[-3000:])
        assert "step 1: deleted while it was verified" in result["output"], result


@pytest.mark.parametrize(
    "duration_s", [DURATION_S, pytest.param(LONG_DURATION_S, marks=pytest.mark.long)]
)
def test_readers_in_a_loop_never_see_a_mixed_or_partial_tree(
    tmp_path: Path, duration_s: float
) -> None:
    cfg = {"base": str(tmp_path), "duration_s": duration_s}
    writer = _spawn("writer", cfg)
    readers = [_spawn("reader", cfg) for _ in range(2)]
    try:
        results = []
        for reader in readers:
            out, err = reader.communicate(timeout=duration_s + 300)
            assert reader.returncode == 0 and out.strip(), err[-3000:]
            results.append(json.loads(out.splitlines()[-1]))
        _, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err[-3000:]
    finally:
        for p in (writer, *readers):
            p.kill()
    saved = json.loads((tmp_path / "done").read_text())["steps"]
    for r in results:
        assert r["problem_count"] == 0, r["problems"]
        assert all(r["counts"][k] > 0 for k in ("newest", "verify", "opened")), r
    total = {k: sum(r["counts"][k] for r in results) for k in results[0]["counts"]}
    print(
        f"\nreaders: the writer saved {saved} steps in {duration_s:.0f} s (max_to_keep=1); "
        f"2 readers: {total['newest']} restore() and {total['listed']} restore(step) returned "
        f"a complete step, {total['retried']} restore() retried with the newest step, "
        f"{total['deleted']} StepDeletedError and {total['gone']} FileNotFoundError (step "
        f"deleted before the call), {total['verify']} verify runs with status 0, "
        f"{total['opened']} read-only managers opened; 0 problems"
    )


def test_a_reader_opening_while_a_step_is_deleted_does_not_fail(tmp_path: Path) -> None:
    """Orbax's open lists the steps, then reads each one's commit time and metrics; the writer
    may delete a step in between (both failed readers' opens in the loop above). Here the
    deletion lands exactly there: the commit time is the one read at listing, and the metrics
    of the deleted step are missing (``FileNotFoundError``, which Orbax skips), not a
    ``ValueError``."""
    import orbax.checkpoint as ocp

    from cocijax.manager._directory import CommittedStepFormat

    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1)) as writer:
        for step in (1, 2):
            writer.save(step, state(step, 8), loss=1.0, force=True, metrics={"loss": 1.0})
    listed = list(CommittedStepFormat().find_all(directory))
    reader = cj.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        assert reader.orbax.metrics(1) == {"loss": 1.0}
        shutil.rmtree(directory / "1")  # what the writer's retention does after the listing
        assert sorted(m.step for m in listed) == [1, 2] and all(m.commit_timestamp for m in listed)
        assert reader.orbax.metrics(1) is None
        assert reader.all_steps() == [2]
    finally:
        reader.close()
