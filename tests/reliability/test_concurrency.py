"""Saves that overlap in time, and two writers on one directory.

* A save started while the previous async save is still writing must not interleave with it: the
  test records, inside this process, the instant each piece file is written (directly, or by a
  TensorStore store being opened) and checks on disk that the previous step was already
  committed (final directory and manifest present) when the next step wrote its first file.
* A second process (or a second manager in this process) that opens a directory some manager
  already writes to gets a clear error naming the directory and the lock, and the first writer's
  checkpoints stay intact. Readers (``cocijax verify``) are not blocked.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import tensorstore as ts
from reliability_helpers import child_env, item_dir

import cocijax as cj
from cocijax import cli, storage
from cocijax.manager import DirectoryLockedError
from cocijax.storage import _direct
from cocijax.storage._stripes import referenced_stripe_dirs

pytestmark = pytest.mark.xdist_group("reliability-concurrency")


def _state(step: int, mib: int = 2) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    n = mib * 1024 * 1024 // 4 // 8
    return {f"leaf{i}": rng.standard_normal((n,)).astype(np.float32) for i in range(8)}


def _abstract(mib: int = 2) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0, mib))


def _committed(directory: Path, step: int) -> bool:
    try:
        storage.read_manifest(item_dir(directory, step))
    except (ValueError, FileNotFoundError, StopIteration):
        return False
    return True


def test_next_save_never_interleaves_with_the_running_one(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "ckpt"
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    opens: list[tuple[str, dict[int, bool]]] = []
    lock = threading.Lock()
    original_open, original_write = ts.open, _direct.write_file

    def record(target: Any) -> None:
        # What was committed at the instant this file was written or this store opened.
        with lock:
            opens.append((str(target), {s: _committed(directory, s) for s in (1, 2, 3)}))

    def recording_open(spec: Any = None, *args: Any, **kwargs: Any):
        record(spec)
        return original_open(spec, *args, **kwargs)

    def recording_write(path: Path, *args: Any, **kwargs: Any):
        record(path)
        return original_write(path, *args, **kwargs)

    monkeypatch.setattr(ts, "open", recording_open)
    monkeypatch.setattr(_direct, "write_file", recording_write)
    mib = 48
    with cj.CheckpointManager(
        directory, roots=roots, policy=cj.policies.fixed(1), max_to_keep=5
    ) as mngr:
        states = {s: _state(s, mib) for s in (1, 2, 3)}
        running_when_next_started = []
        for step in (1, 2, 3):
            if step > 1:
                running_when_next_started.append(not _committed(directory, step - 1))
            assert mngr.save(step, states[step], loss=1.0, force=True)
        mngr.wait_until_finished()
        assert list(mngr.all_steps()) == [1, 2, 3]
        for step in (1, 2, 3):
            restored = mngr.restore(step, target=_abstract(mib))
            for k, v in states[step].items():
                np.testing.assert_array_equal(np.asarray(restored[k]), v)
    # The overlap really happened (else this test would prove nothing).
    assert any(running_when_next_started), "every save finished before the next began"
    stripes = {
        s: [d.name for d in referenced_stripe_dirs(item_dir(directory, s))] for s in (1, 2, 3)
    }
    by_step: dict[int, list[dict[int, bool]]] = {1: [], 2: [], 3: []}
    for spec, committed in opens:
        for step in (1, 2, 3):
            if any(name in spec for name in stripes[step]):
                by_step[step].append(committed)
    for step in (2, 3):
        assert by_step[step], f"no piece file write recorded for step {step}"
        for committed in by_step[step]:
            assert committed[step - 1], f"step {step} wrote before step {step - 1} committed"


_SECOND_WRITER = """
import sys, numpy as np, cocijax as cj
try:
    m = cj.CheckpointManager(sys.argv[1], roots=sys.argv[2:], policy=cj.policies.fixed(1))
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(3)
m.save(10, {"x": np.ones(3, np.float32)}, loss=1.0, force=True)
m.wait_until_finished()
m.close()
print("saved")
"""


def test_second_writer_gets_a_clear_error(tmp_path: Path, capsys) -> None:
    directory = tmp_path / "ckpt"
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    state = {"x": np.arange(3, dtype=np.float32)}
    argv = [sys.executable, "-c", _SECOND_WRITER, str(directory), *roots]
    with cj.CheckpointManager(directory, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        assert mngr.save(1, state, loss=1.0, force=True)
        mngr.wait_until_finished()

        other = subprocess.run(argv, env=child_env(1), capture_output=True, text=True, timeout=120)
        assert other.returncode == 3, other.stdout + other.stderr
        assert other.stdout.startswith("DirectoryLockedError"), other.stdout
        assert str(directory) in other.stdout and "lock" in other.stdout.lower(), other.stdout

        # The same in this process: a second manager on the directory is refused too.
        with pytest.raises(DirectoryLockedError, match="lock") as info:
            cj.CheckpointManager(directory, roots=roots, policy=cj.policies.fixed(1))
        assert str(directory) in str(info.value)

        # Readers are not writers: verify works while the lock is held.
        assert cli.main(["verify", str(directory)]) == 0
        capsys.readouterr()

        # The first writer carries on undisturbed.
        assert mngr.save(3, {"x": np.full(3, 3.0, np.float32)}, loss=1.0, force=True)
        mngr.wait_until_finished()
        assert list(mngr.all_steps()) == [1, 3]
        assert storage.verify(item_dir(directory, 1)) == []

    # Once the first writer closed, another process may write.
    after = subprocess.run(
        [*argv[:3], str(directory), *roots],
        env=child_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert after.returncode == 0 and "saved" in after.stdout, after.stdout + after.stderr


def test_two_directories_sharing_a_root_keep_each_others_data(tmp_path: Path) -> None:
    shared = tmp_path / "shared_root"
    state = {"w": np.arange(4, dtype=np.float32)}
    with cj.CheckpointManager(tmp_path / "run_a", roots=[shared], policy=cj.policies.fixed(1)) as a:
        assert a.save(1, state, loss=1.0, force=True)
    with cj.CheckpointManager(tmp_path / "run_b", roots=[shared], policy=cj.policies.fixed(1)) as b:
        assert b.save(1, state, loss=1.0, force=True)
    assert storage.verify(item_dir(tmp_path / "run_a", 1)) == []
    assert storage.verify(item_dir(tmp_path / "run_b", 1)) == []
