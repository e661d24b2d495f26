"""A persisted save with a memory tier: one host snapshot, the disk's copy made from memory.

The copy runs in a thread (``cocijax.manager._disk_copy``); these tests hold it back where they
need it in flight (a ``copy_item`` that waits for an event), and kill a real process during it.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax.core._memory import find_tmpfs
from cocijax.manager import _disk_copy
from cocijax.manager._disk_copy import PENDING_PREFIX, DiskCopyStalledError

TMPFS = find_tmpfs()
pytestmark = pytest.mark.skipif(TMPFS is None, reason="no shared-memory tmpfs on this machine")


@pytest.fixture
def held(monkeypatch):
    """The disk copy's ``copy_item``, held back until ``held.set()`` (at most 60 s)."""
    release = threading.Event()
    real = _disk_copy.storage.copy_item

    def copy_item(*args, **kwargs):
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(_disk_copy.storage, "copy_item", copy_item)
    yield release
    release.set()


def two_level():
    """Level 2 at every 4th step, level 1 at the others."""

    def update(state, *, step, **_):
        return jnp.where(step % 4 == 0, 2, 1), state

    return cj.policies.Policy(lambda: {"n": jnp.zeros((), jnp.int32)}, jax.jit(update), levels=2)


def state_at(step, n=1000):
    return {"w": np.arange(n, dtype=np.float32) + step, "b": np.float32(step)}


def check_restores(mngr, step, tier):
    restored = mngr.restore(step, tier=tier)
    np.testing.assert_array_equal(restored["w"], state_at(step)["w"])


def test_a_persisted_save_writes_memory_only_and_its_disk_copy_is_made_from_it(
    tmp_path, memory, monkeypatch
):
    with cj.CheckpointManager(
        tmp_path / "ckpt", policy=cj.policies.fixed(2), memory=memory, max_to_keep=2
    ) as mngr:
        disk_saves = []
        real_save = mngr.orbax.save
        monkeypatch.setattr(mngr.orbax, "save", lambda *a, **k: disk_saves.append(a))
        for step in range(1, 9):
            mngr.save(step, state_at(step), loss=1.0, metrics={"loss": float(step)})
        mngr.wait_until_finished()
        monkeypatch.setattr(mngr.orbax, "save", real_save)
        assert disk_saves == []  # one snapshot per save: the disk is written from memory
        assert mngr._local_steps() == [6, 8]  # max_to_keep applies to the copies
        assert mngr.memory_steps() == [6, 8]
        for step in (6, 8):
            assert cj.storage.verify(mngr.item_directory(step)) == []
            check_restores(mngr, step, "local")
        assert mngr.metrics(8) == {"loss": 8.0}
        assert not list(memory.rglob(f"{PENDING_PREFIX}*"))
    with cj.CheckpointManager(tmp_path / "ckpt", policy=cj.policies.fixed(2)) as mngr:
        check_restores(mngr, 8, "local")  # without the memory tier: a plain disk step
        assert mngr.restored_tier == "local"


def test_with_external_roots_the_copy_is_striped_over_them(tmp_path, memory):
    roots = [tmp_path / "r0", tmp_path / "r1"]
    with cj.CheckpointManager(
        tmp_path / "ckpt", roots=roots, policy=cj.policies.fixed(1), memory=memory
    ) as mngr:
        mngr.save(1, {f"a{i}": np.full(3 << 20, i, np.float32) for i in range(2)}, loss=1.0)
        mngr.wait_until_finished()
        manifest = cj.storage.read_manifest(mngr.item_directory(1))
        assert manifest.roots == tuple(str(r) for r in mngr.stripe_roots)
        assert {p.root for p in manifest.pieces} == {0, 1}
        inside = [p.name for p in mngr.item_directory(1).iterdir()]
        assert not any(name.startswith("cocijax-stripe") for name in inside)
        restored = mngr.restore(1, tier="local")
        np.testing.assert_array_equal(restored["a1"], np.full(3 << 20, 1, np.float32))


def test_a_step_is_listed_on_disk_only_once_its_copy_committed(tmp_path, memory, held):
    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory) as mngr:
        mngr.save(1, state_at(1), loss=1.0)
        assert mngr.is_saving_in_progress()
        deadline = time.monotonic() + 60
        while mngr.memory_steps() != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mngr.memory_steps() == [1] and mngr._local_steps() == []
        assert not (directory / "1").exists()  # the copy is under a temporary name
        check_restores(mngr, 1, "memory")
        held.set()
        mngr.wait_until_finished()
        assert mngr._local_steps() == [1] and not mngr.is_saving_in_progress()
        assert [p.name for p in directory.iterdir() if not p.name.startswith(".")] == ["1"]


def test_a_memory_save_that_would_delete_the_step_being_copied_waits_for_the_copy(
    tmp_path, memory, held
):
    with cj.CheckpointManager(tmp_path / "ckpt", policy=two_level(), memory=memory) as mngr:
        held.set()
        for step in range(1, 4):
            mngr.save(step, state_at(step), loss=1.0)  # 2: the early save, persisted
        mngr.wait_until_finished()
        held.clear()
        mngr.save(4, state_at(4), loss=1.0)  # level 2: copied from memory, held back
        mngr.save(5, state_at(5), loss=1.0)  # level 1: step 4 is the newest, kept
        assert mngr._copy.step == 4 and not held.is_set()  # 5 did not wait for the copy
        released = threading.Timer(0.2, held.set)
        released.start()
        mngr.save(6, state_at(6), loss=1.0)  # level 1: would delete step 4 from memory
        assert held.is_set()  # so it waited for the copy
        released.join()
        mngr.wait_until_finished()
        assert mngr._local_steps() == [2, 4] and mngr.memory_steps() == [5, 6]
        check_restores(mngr, 4, "local")


def test_a_failed_copy_is_raised_and_leaves_the_memory_copy_intact(tmp_path, memory, monkeypatch):
    directory = tmp_path / "ckpt"
    real = _disk_copy.storage.copy_item

    def disk_full(source, dest, **kwargs):
        real(source, dest, **kwargs)  # pieces written, then the manifest's write fails
        raise OSError(errno.ENOSPC, "No space left on device", str(dest))

    mngr = cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory)
    monkeypatch.setattr(_disk_copy.storage, "copy_item", disk_full)
    mngr.save(1, state_at(1), loss=1.0)
    with pytest.raises(OSError, match="No space left") as raised:
        mngr.wait_until_finished()
    assert str(directory) in str(raised.value)
    assert "the memory copy is intact" in "".join(raised.value.__notes__)
    mngr.wait_until_finished()  # raised once
    assert mngr._local_steps() == [] and mngr.memory_steps() == [1]
    assert cj.storage.verify(mngr._memory.path / "1" / "state") == []
    check_restores(mngr, 1, "memory")
    assert [p.name for p in directory.iterdir() if not p.name.startswith(".")] == []
    mngr.save(2, state_at(2), loss=1.0)  # fails alike: raised by the next save, as an
    with pytest.raises(OSError, match="No space left"):  # asynchronous save's error is
        mngr.save(3, state_at(3), loss=1.0)
    mngr.save(4, state_at(4), loss=1.0)  # fails alike, raised by close()
    with pytest.raises(OSError, match="No space left"):
        mngr.close()
    monkeypatch.setattr(_disk_copy.storage, "copy_item", real)
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory) as mngr:
        # The opening copies the persisted steps still in memory: nothing lost. (Found by the
        # dataloss review: step 1, whose copy had failed, left memory's two slots at step 4's
        # save and was lost; a persisted step now stays in memory until its copy commits.)
        assert mngr._local_steps() == [1, 2, 4]  # step 3's save raised: not saved
        check_restores(mngr, 1, "local")
        check_restores(mngr, 4, "local")


def test_a_persisted_step_whose_copy_failed_stays_in_memory_until_the_next_copy(
    tmp_path, memory, monkeypatch
):
    # Found by the dataloss review: level-1 saves after a failed copy deleted the persisted
    # step from memory (the two slots), so it was on no tier at all.
    real = _disk_copy.storage.copy_item

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with cj.CheckpointManager(tmp_path / "ckpt", policy=two_level(), memory=memory) as mngr:
        monkeypatch.setattr(_disk_copy.storage, "copy_item", disk_full)
        mngr.save(4, state_at(4), loss=1.0)  # level 2: its copy fails
        with pytest.raises(OSError, match="No space left"):
            mngr.wait_until_finished()
        monkeypatch.setattr(_disk_copy.storage, "copy_item", real)  # the disk is freed
        for step in (5, 6, 7):  # level 1: memory only
            mngr.save(step, state_at(step), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.memory_steps() == [4, 6, 7]  # step 4 kept beyond the two slots
        mngr.save(8, state_at(8), loss=1.0)  # level 2: its copy copies step 4 first
        mngr.wait_until_finished()
        assert mngr._local_steps() == [4, 8]
        check_restores(mngr, 4, "local")
        mngr.save(9, state_at(9), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.memory_steps() == [8, 9]  # copied: back to two slots


def test_a_stalled_copy_is_bounded_and_said(tmp_path, memory, held):
    directory = tmp_path / "ckpt"
    mngr = cj.CheckpointManager(
        directory, policy=cj.policies.fixed(1), memory=memory, store_timeout_s=0.5
    )
    mngr.save(1, state_at(1), loss=1.0)
    with pytest.raises(DiskCopyStalledError, match=r"step 1 .* made no progress for 0.5 s"):
        mngr.wait_until_finished()
    with pytest.raises(DiskCopyStalledError):
        mngr.close()  # abandoned: it commits nothing
    held.set()
    for thread in threading.enumerate():  # the abandoned copy ends: it commits nothing
        if thread.name == "cocijax-disk-copy-1":
            thread.join(60)
    assert not (directory / "1").exists()
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory) as mngr:
        assert mngr._local_steps() == [1]  # the opening finished it


_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np
    import cocijax as cj
    from cocijax.manager import _disk_copy

    directory, memory, flag = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    real = _disk_copy.storage.copy_item

    def copy_item(source, dest, **kwargs):
        real(source, dest, **kwargs)  # the pieces and the manifest, not renamed into place
        flag.touch()
        time.sleep(120)  # killed here

    _disk_copy.storage.copy_item = copy_item
    mngr = cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory)
    mngr.save(1, {"w": np.arange(1000, dtype=np.float32) + 1, "b": np.float32(1)}, loss=1.0)
    mngr.wait_until_finished()
    """
)


def test_a_process_killed_during_the_copy_loses_nothing(tmp_path, memory):
    directory, flag = tmp_path / "ckpt", tmp_path / "copying"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), str(memory), str(flag)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert not (directory / "1").exists()  # nothing half-listed on the disk
    with cj.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True)
    ) as reader:
        assert reader.all_steps() == []
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory) as mngr:
        assert mngr.memory_steps() == [1] and mngr._local_steps() == [1]
        check_restores(mngr, 1, "local")
        check_restores(mngr, 1, "memory")
        leftovers = [p.name for p in directory.iterdir() if not p.name.startswith(".")]
        assert leftovers == ["1"] and not list(memory.rglob(f"{PENDING_PREFIX}*"))


@pytest.mark.xdist_group("reliability-mounts")
def test_a_disk_full_during_the_copy_keeps_the_memory_copy_and_the_next_opening_copies_it(
    small_tmpfs, memory
):
    directory, size = small_tmpfs / "ckpt", 512 << 10  # 2 MiB states, the disk 8 MiB
    state = lambda step: {"w": np.full(size, step, np.float32)}
    mngr = cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory)
    mngr.save(1, state(1), loss=1.0)
    mngr.wait_until_finished()
    free = os.statvfs(small_tmpfs)
    ballast = small_tmpfs / "ballast"
    ballast.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - (1 << 20)))
    mngr.save(2, state(2), loss=1.0)  # its copy: 2 MiB into the 1 MiB left
    with pytest.raises(Exception, match=str(directory)) as raised:
        mngr.wait_until_finished()
    assert "No space left" in str(raised.value) or "RESOURCE_EXHAUSTED" in str(raised.value)
    assert mngr._local_steps() == [1] and mngr.memory_steps() == [1, 2]
    assert cj.storage.verify(mngr._memory.path / "2" / "state") == []
    np.testing.assert_array_equal(mngr.restore(2)["w"], state(2)["w"])
    assert mngr.restored_tier == "memory"
    assert [p.name for p in directory.iterdir() if not p.name.startswith(".")] == ["1"]
    mngr.close()
    ballast.unlink()  # the operator frees the disk
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1), memory=memory) as mngr:
        assert mngr._local_steps() == [1, 2]
        np.testing.assert_array_equal(mngr.restore(2, tier="local")["w"], state(2)["w"])
