"""The memory tier (``memory=``): saves on tmpfs first, restores memory first, failure classes.

Each folder given as ``memory=`` is made under the machine's shared-memory tmpfs (found at run
time, as ``memory=True`` finds it); the tests are skipped where there is none.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax.core._contract import DirectoryLockedError
from cocijax.core._memory import find_tmpfs, mount_of

TMPFS = find_tmpfs()
pytestmark = pytest.mark.skipif(TMPFS is None, reason="no shared-memory tmpfs on this machine")


def alternating(levels=2):
    """A two-level policy of its own: level 1 at every 2nd step, level 2 at every 6th."""

    def update(state, *, step, **_):
        level = jnp.where(step % 6 == 0, 2, jnp.where(step % 2 == 0, 1, 0))
        return level, {"n": state["n"] + 1}

    return cj.policies.Policy(
        lambda: {"n": jnp.zeros((), jnp.int32)}, jax.jit(update), levels=levels
    )


def state_at(step, n=1000):
    return {"w": np.arange(n, dtype=np.float32) + step, "b": np.float32(step)}


def train(mngr, steps):
    saved = [s for s in steps if mngr.save(s, state_at(s), loss=1.0)]
    mngr.wait_until_finished()
    return saved


def test_level_1_saves_go_to_memory_only_and_persisted_ones_also_to_disk_and_durable(
    tmp_path, memory
):
    durable = tmp_path / "durable"
    with cj.CheckpointManager(
        tmp_path / "ckpt", policy=alternating(), memory=memory, durable=durable
    ) as mngr:
        saved = train(mngr, range(1, 15))
        mngr.wait_until_finished(durable=True)
        # Step 2 is the early save (no cost known yet): persisted.
        assert saved == [2, 4, 6, 8, 10, 12, 14]
        assert mngr.memory_steps() == [12, 14]  # two slots
        assert mngr._local_steps() == [2, 6, 12]
        # Persisted saves only (a step may be skipped for a newer one while a drain runs).
        assert set(mngr.durable_steps()) <= {2, 6, 12} and 12 in mngr.durable_steps()
        assert mngr.all_steps() == [2, 6, 12, 14]
        assert (mngr._memory.path / "14" / "state" / "cocijax_manifest.json").exists()
        m = mngr.measurements
        assert m.cost_estimate_s >= 0 and m.persist_cost_estimate_s >= 0


def test_a_one_level_policy_s_every_save_lands_in_memory_and_on_disk(tmp_path, memory):
    with cj.CheckpointManager(
        tmp_path / "ckpt", policy=cj.policies.fixed(3), memory=memory
    ) as mngr:
        assert train(mngr, range(1, 10)) == [3, 6, 9]
        assert mngr.memory_steps() == [6, 9]
        assert mngr._local_steps() == [3, 6, 9]


def test_without_a_memory_tier_a_level_1_save_goes_to_the_disk_but_not_the_durable_tier(
    tmp_path,
):
    with cj.CheckpointManager(
        tmp_path / "ckpt", policy=alternating(), durable=tmp_path / "durable"
    ) as mngr:
        train(mngr, range(1, 9))
        mngr.wait_until_finished(durable=True)
        assert mngr._local_steps() == [2, 4, 6, 8]
        assert set(mngr.durable_steps()) <= {2, 6} and 6 in mngr.durable_steps()


def test_a_forced_save_and_a_preemption_save_are_persisted(tmp_path, memory):
    with cj.CheckpointManager(
        tmp_path / "ckpt",
        policy=alternating(),
        memory=memory,
        durable=tmp_path / "durable",
        preemption_signals=(signal.SIGUSR1,),
        exit_on_preemption=False,  # SIGUSR1's default action would end the test's process
    ) as mngr:
        train(mngr, range(1, 5))  # 2 (the early save) persisted, 4 in memory only
        assert mngr.save(5, state_at(5), loss=1.0, force=True)
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, delivered by the kernel
        assert mngr.save(7, state_at(7), loss=1.0) and mngr.reached_preemption  # policy: no
        mngr.wait_until_finished(durable=True)
        assert mngr._local_steps() == [2, 5, 7] and mngr.memory_steps() == [5, 7]
        assert 7 in mngr.durable_steps()


def test_with_external_roots_garbage_collection_keeps_every_listed_step_whole(tmp_path, memory):
    directory, roots = tmp_path / "ckpt", [tmp_path / "r1", tmp_path / "r2"]
    with cj.CheckpointManager(
        directory, roots=roots, policy=alternating(), memory=memory, max_to_keep=2
    ) as mngr:
        train(mngr, range(1, 21))
        assert mngr.memory_steps() == [18, 20] and mngr._local_steps() == [12, 18]
    with cj.CheckpointManager(directory, roots=roots, policy=alternating(), memory=memory) as m:
        for step, tier in [(18, "memory"), (20, "memory"), (12, "local"), (18, "local")]:
            restored = m.restore(step, tier=tier)
            np.testing.assert_array_equal(restored["w"], state_at(step)["w"])


def test_restore_reads_memory_first_then_the_disk_and_says_which(tmp_path, memory, caplog):
    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        train(mngr, range(1, 15))
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        with caplog.at_level(logging.INFO, logger="cocijax"):
            restored = mngr.restore()
        assert (mngr.restored_step, mngr.restored_tier) == (14, "memory")
        np.testing.assert_array_equal(restored["w"], state_at(14)["w"])
        assert "step 14 restored from the memory tier" in caplog.text
        mngr.restore(12, tier="local")
        assert (mngr.restored_step, mngr.restored_tier) == (12, "local")
        # The schedule continues after the restored step.
        assert mngr.save(16, state_at(16), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.memory_steps() == [14, 16]


def _corrupt(step_dir: Path) -> None:
    chunk = next(p for p in (step_dir / "state").rglob("c.*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


def test_a_corrupt_memory_snapshot_falls_back_to_the_next_copy(tmp_path, memory):
    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        train(mngr, range(1, 15))
        space = mngr._memory.path
    _corrupt(space / "14")
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        with pytest.warns(RuntimeWarning, match=r"skipping damaged step 14 \(memory copy\)"):
            restored = mngr.restore()
        assert (mngr.restored_step, mngr.restored_tier) == (12, "memory")
        assert mngr.memory_steps() == [12]  # the damaged copy deleted: the next save may go on
        np.testing.assert_array_equal(restored["w"], state_at(12)["w"])
    _corrupt(space / "12")
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        with pytest.warns(RuntimeWarning, match="memory copy"):
            restored = mngr.restore()
        assert (mngr.restored_step, mngr.restored_tier) == (12, "local")
        np.testing.assert_array_equal(restored["w"], state_at(12)["w"])


def test_a_torn_memory_snapshot_is_never_listed(tmp_path, memory):
    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        train(mngr, range(1, 15))
        space = mngr._memory.path
    (space / "14" / "state" / "cocijax_manifest.json").unlink()  # cut before its commit record
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        assert mngr.memory_steps() == [12]
        assert not (space / "14").exists()  # removed by the writer's opening
        mngr.restore()
        assert (mngr.restored_step, mngr.restored_tier) == (12, "memory")


def test_two_jobs_share_a_memory_folder_and_a_copy_of_a_directory_is_refused(tmp_path, memory):
    first = cj.CheckpointManager(tmp_path / "a", policy=cj.policies.fixed(1), memory=memory)
    with first, cj.CheckpointManager(tmp_path / "b", policy=cj.policies.fixed(1), memory=memory):
        assert first._memory.path.parent == memory
        shutil.copytree(tmp_path / "a", tmp_path / "copy", ignore=shutil.ignore_patterns(".*lock"))
        with pytest.raises(DirectoryLockedError, match=r"memory: the memory folder .* is in use"):
            cj.CheckpointManager(tmp_path / "copy", policy=cj.policies.fixed(1), memory=memory)
    assert len(list(memory.iterdir())) == 2


def test_a_copy_of_a_directory_never_takes_the_original_s_snapshots(tmp_path, memory):
    with cj.CheckpointManager(tmp_path / "a", policy=alternating(), memory=memory) as mngr:
        train(mngr, range(1, 9))  # step 8 is in memory only
        assert mngr.memory_steps() == [6, 8] and mngr._local_steps() == [2, 6]
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    with pytest.raises(ValueError, match=r"holds the snapshots of .*/a, whose identity"):
        cj.CheckpointManager(tmp_path / "copy", policy=alternating(), memory=memory)
    with cj.CheckpointManager(tmp_path / "copy", policy=alternating()) as copy:
        assert copy.latest_step() == 6
    # The original is moved away: its successor at a new path takes the folder over.
    (tmp_path / "a").rename(tmp_path / "moved")
    with cj.CheckpointManager(tmp_path / "moved", policy=alternating(), memory=memory) as mngr:
        assert mngr.latest_step() == 8


def test_a_reader_lists_and_restores_the_memory_tier(tmp_path, memory):
    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(directory, policy=alternating(), memory=memory) as mngr:
        train(mngr, range(1, 9))
        reader = cj.CheckpointManager(
            directory, memory=memory, options=ocp.CheckpointManagerOptions(read_only=True)
        )
        with reader:
            assert reader.all_steps() == [2, 6, 8]
            restored = reader.restore()
            assert (reader.restored_step, reader.restored_tier) == (8, "memory")
            np.testing.assert_array_equal(restored["w"], state_at(8)["w"])


def test_a_memory_folder_on_a_disk_is_warned_about(tmp_path):
    if mount_of(tmp_path)[1] in ("tmpfs", "ramfs"):
        pytest.skip("the test's temporary directory is on a tmpfs")
    with pytest.warns(RuntimeWarning, match=r"is on a disk \(.*\), not in memory"):
        mngr = cj.CheckpointManager(tmp_path / "ckpt", memory=tmp_path / "mem")
    mngr.close()


@pytest.mark.parametrize(
    ("memory_arg", "bytes_arg", "error"),
    [
        (5, None, (TypeError, "memory: expected True, a folder")),
        (True, 0, (ValueError, "memory_bytes: must be positive")),
        (True, 1.5, (TypeError, "memory_bytes: expected an int")),
        (None, 10, (ValueError, "memory_bytes: given without memory=")),
    ],
)
def test_bad_memory_arguments_are_refused_by_name(tmp_path, memory_arg, bytes_arg, error):
    with pytest.raises(error[0], match=error[1]):
        cj.CheckpointManager(tmp_path / "ckpt", memory=memory_arg, memory_bytes=bytes_arg)
    assert not (tmp_path / "ckpt").exists()  # nothing touched


def test_a_memory_folder_inside_the_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="overlaps the checkpoint directory"):
        cj.CheckpointManager(tmp_path / "ckpt", memory=tmp_path / "ckpt" / "mem")


@pytest.mark.parametrize(
    ("memory_at", "root_at", "durable_at", "named"),
    [
        # Found by the dataloss review: the memory tier's job folder was the root's stripe
        # folder, and its next opening removed the stripes of the disk's steps as leftovers.
        ("shared", "shared", None, r"roots\[0\]"),
        ("shared", "shared/inner", None, r"roots\[0\]"),
        ("shared", None, "shared", "durable"),
        ("shared/inner", None, "shared", "durable"),
    ],
    ids=["root", "root-inside", "durable", "inside-durable"],
)
def test_a_memory_folder_overlapping_a_root_or_the_durable_tier_is_refused(
    tmp_path, memory, memory_at, root_at, durable_at, named
):
    kwargs = {"memory": memory / memory_at}
    if root_at is not None:
        kwargs["roots"] = [memory / root_at]
    if durable_at is not None:
        kwargs["durable"] = memory / durable_at
    with pytest.raises(ValueError, match=rf"memory=.*overlaps {named}=.*memory=True"):
        cj.CheckpointManager(tmp_path / "ckpt", **kwargs)


def test_a_state_that_does_not_fit_is_refused_at_the_first_save_naming_the_sizes(tmp_path, memory):
    with cj.CheckpointManager(
        tmp_path / "ckpt", policy=cj.policies.fixed(1), memory=memory, memory_bytes=1000
    ) as mngr:
        with pytest.raises(ValueError, match=r"a state of 4004 bytes .* need 8008 bytes.*=1000"):
            mngr.save(1, state_at(1), loss=1.0)
        assert mngr.all_steps() == []


def test_memory_true_falls_back_to_the_disk_when_the_state_does_not_fit(tmp_path):
    with cj.CheckpointManager(
        tmp_path / "ckpt", policy=alternating(), memory=True, memory_bytes=1000
    ) as mngr:
        assert mngr._memory.path.parent.parent == TMPFS
        with pytest.warns(RuntimeWarning, match="memory=True: a state of .*the disk only"):
            saved = train(mngr, range(1, 9))
        assert saved == [2, 4, 6, 8]
        assert mngr.memory_steps() == [] and mngr._local_steps() == saved
        shutil.rmtree(mngr._memory.path)


# -- a tmpfs that fills up ------------------------------------------------------------------


@pytest.mark.xdist_group("reliability-mounts")
def test_a_tmpfs_full_mid_write_keeps_the_older_slot_listed_and_restorable(tmp_path, small_tmpfs):
    size = 512 << 10  # 2 MiB of float32: two slots fit the 8 MiB tmpfs
    memory = small_tmpfs / "memory"
    state = lambda step: {"w": np.full(size, step, np.float32)}
    with cj.CheckpointManager(
        tmp_path / "ckpt", policy=cj.policies.fixed(1), memory=memory
    ) as mngr:
        mngr.save(1, state(1), loss=1.0)
        mngr.wait_until_finished()
        free = os.statvfs(small_tmpfs)
        ballast = small_tmpfs / "ballast"
        ballast.write_bytes(b"\0" * (free.f_bavail * free.f_frsize - (1 << 20)))
        mngr.save(2, state(2), loss=1.0)  # 2 MiB into the 1 MiB left
        with pytest.raises(Exception, match=str(memory)) as raised:
            mngr.wait_until_finished()
        assert "No space left" in str(raised.value) or "RESOURCE_EXHAUSTED" in str(raised.value)
        assert mngr.memory_steps() == [1]
        # The disk's copy is made from the memory copy (one host snapshot): none of step 2.
        assert mngr._local_steps() == [1]
        restored = mngr.restore(1, tier="memory")
        np.testing.assert_array_equal(restored["w"], state(1)["w"])
        ballast.unlink()  # the operator frees the tmpfs: saving goes on
        mngr.save(3, state(3), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.memory_steps() == [1, 3] and mngr._local_steps() == [1, 3]
        assert sorted(p.name for p in mngr._memory.path.iterdir() if p.is_dir()) == ["1", "3"]


# -- failure classes and the two-level inputs -----------------------------------------------


def test_the_history_tells_a_process_failure_from_a_machine_failure(tmp_path, memory):
    from cocijax.core._history import MACHINE_SHARE, PROCESS, RunHistory

    marker = memory / "marker"
    RunHistory(tmp_path, memory_marker=marker).adopt(None)  # killed: no close
    second = RunHistory(tmp_path, memory_marker=marker)
    second.adopt(None)
    assert (second.failures, second.machine_failures, second.failure_class) == (1, 0, PROCESS)
    marker.unlink()  # the machine restarted: the tmpfs is empty
    # A still clock: the uptime below and the one inside class_mtbf_s are the same number.
    third = RunHistory(tmp_path, memory_marker=marker, clock=lambda: 50.0)
    third.adopt(second.to_json())
    assert (third.failures, third.machine_failures, third.failure_class) == (2, 1, "machine")
    saved = third.to_json()
    assert (saved["failures"], saved["machine_failures"]) == (2, 1)
    # Each class learns its own rate from its share of the prior.
    uptime = third.uptime_s
    assert third.class_mtbf_s("machine", 1000.0) == pytest.approx(
        (1000.0 / MACHINE_SHARE + uptime) / 2
    )
    assert third.class_mtbf_s("process", 1000.0) == pytest.approx(
        (1000.0 / (1 - MACHINE_SHARE) + uptime) / 2
    )


def test_a_run_without_a_memory_tier_before_counts_a_process_failure(tmp_path, memory):
    from cocijax.core._history import RunHistory

    RunHistory(tmp_path).adopt(None)  # no memory tier, killed
    second = RunHistory(tmp_path, memory_marker=memory / "marker")
    second.adopt(None)
    assert (second.failures, second.machine_failures, second.failure_class) == (1, 0, "process")


def test_the_driver_feeds_each_level_its_own_cost_and_each_class_its_own_rate(tmp_path):
    from cocijax.core._driver import PolicyDriver
    from cocijax.core._history import RunHistory

    def update(state, *, step, checkpoint_cost_s, persist_cost_s, mtbf_s, machine_mtbf_s, **_):
        seen = jnp.stack([checkpoint_cost_s, persist_cost_s, mtbf_s, machine_mtbf_s])
        return jnp.where(step % 2 == 0, 1 + (step % 4 == 0), 0), {"seen": seen}

    policy = cj.policies.Policy(
        lambda: {"seen": jnp.zeros(4)}, jax.jit(update), levels=2, cost_prior_s=1.0
    )
    clock = [0.0]
    history = RunHistory(tmp_path, clock=lambda: clock[0])
    driver = PolicyDriver(policy, clock=lambda: clock[0], history=history, prior_mtbf_s=800.0)
    levels = []
    for step in range(1, 10):
        clock[0] += 1.0  # a training step
        level = driver.decide_level(step, loss=1.0)
        levels.append(level)
        if level:
            with driver.saving(level):
                clock[0] += 0.5 if level == 1 else 4.0
    assert levels == [0, 2, 0, 2, 0, 1, 0, 2, 0]  # step 2: the early save, persisted
    seen = np.asarray(driver.state["seen"])
    assert seen[:2].tolist() == [0.5, 4.0]
    assert seen[2] == pytest.approx((800.0 / 0.8 + history.uptime_s) / 1, rel=1e-3)
    assert seen[3] == pytest.approx((800.0 / 0.2 + history.uptime_s) / 1, rel=1e-3)
    m = driver.measurements()
    assert (m.cost_estimate_s, m.persist_cost_estimate_s) == (0.5, 4.0)
    assert m.mtbf_s == pytest.approx(seen[2], rel=1e-3)
    assert m.machine_mtbf_s == pytest.approx(seen[3], rel=1e-3)
