"""The memory tier (``memory=``) of both managers: the rules they share, run on each backend
(kills and reboots of a real child process included), and the PyTorch manager's own (its DCP
copies).

Each folder given as ``memory=`` is made under the machine's shared-memory tmpfs (found at run
time, as ``memory=True`` finds it) and removed afterwards; the tests are skipped where there is
none. The JAX manager's own tests are ``tests/manager/test_memory_tier.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from killed_child import run_until_killed

import cocijax as cj
import cocijax.torch as cjt
from cocijax.core._contract import DirectoryLockedError
from cocijax.core._memory import find_tmpfs

TMPFS = find_tmpfs()
pytestmark = [
    pytest.mark.skipif(TMPFS is None, reason="no shared-memory tmpfs on this machine"),
    # cocijax.torch silences this DCP warning at import; pytest resets filters for each test.
    pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning"),
]

N = 1000  # elements of the state's array


def alternating():
    """A two-level policy of its own: level 1 at every 2nd step, level 2 at every 6th."""

    def update(state, *, step, **_):
        level = jnp.where(step % 6 == 0, 2, jnp.where(step % 2 == 0, 1, 0))
        return level, {"n": state["n"] + 1}

    return cj.policies.Policy(lambda: {"n": jnp.zeros((), jnp.int32)}, jax.jit(update), levels=2)


def values_at(step: int) -> np.ndarray:
    return np.arange(N, dtype=np.float32) * 0.1 + step


class JaxBackend:
    """``cocijax.CheckpointManager`` on a state ``{"w": array}``."""

    name = "jax"

    def open(self, directory, **kwargs):
        return cj.CheckpointManager(directory, **kwargs)

    def save(self, mngr, step, offset=0.0, **kwargs):
        return mngr.save(step, {"w": values_at(step) + offset}, loss=1.0, **kwargs)

    # A state this large is still being written when the child is killed.
    killed_size = 4 << 20

    def restore(self, mngr, step=None, *, size=N, tier=None):
        return np.asarray(mngr.restore(step, tier=tier)["w"])

    def disk_steps(self, mngr):
        return mngr._local_steps()

    def data_file(self, step_dir: Path) -> Path:
        return next(p for p in (step_dir / "state").rglob("c.*") if p.is_file())


class TorchBackend:
    """``cocijax.torch.CheckpointManager`` on a state ``{"w": tensor}``."""

    name = "torch"

    def open(self, directory, **kwargs):
        return cjt.CheckpointManager(directory, **kwargs)

    def save(self, mngr, step, offset=0.0, **kwargs):
        w = torch.from_numpy(values_at(step) + np.float32(offset))
        return mngr.save(step, {"w": w}, loss=1.0, **kwargs)

    killed_size = 1 << 20  # a save may be in flight when killed

    def restore(self, mngr, step=None, *, size=N, tier=None):
        """The torch manager has no ``tier=``: a step's memory copy is read first."""
        return mngr.restore(step, target={"w": torch.zeros(size)})["w"].numpy()

    def disk_steps(self, mngr):
        return list(mngr._steps)

    def data_file(self, step_dir: Path) -> Path:
        return step_dir / "__0_0.distcp"


@pytest.fixture(params=[JaxBackend(), TorchBackend()], ids=lambda b: b.name)
def backend(request):
    return request.param


def train(backend, mngr, steps):
    saved = [s for s in steps if backend.save(mngr, s)]
    mngr.wait_until_finished()
    return saved


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# -- shared by both managers ------------------------------------------------------------------


def test_a_one_level_save_lands_in_memory_and_on_disk(backend, tmp_path, memory):
    with backend.open(tmp_path / "ckpt", policy=cj.policies.fixed(3), memory=memory) as mngr:
        saved = train(backend, mngr, range(1, 10))
        assert saved == [3, 6, 9]
        assert mngr.memory_steps() == [6, 9]  # two slots
        assert backend.disk_steps(mngr) == saved
        assert mngr.all_steps() == saved


def test_a_level_1_save_lands_in_memory_only(backend, tmp_path, memory):
    with backend.open(tmp_path / "ckpt", policy=alternating(), memory=memory) as mngr:
        saved = train(backend, mngr, range(1, 15))
        assert saved == [2, 4, 6, 8, 10, 12, 14]
        assert mngr.memory_steps() == [12, 14]
        assert backend.disk_steps(mngr) == [2, 6, 12]
        assert mngr.all_steps() == [2, 6, 12, 14]
        assert mngr.latest_step() == 14


def test_a_forced_save_is_persisted(backend, tmp_path, memory):
    with backend.open(tmp_path / "ckpt", policy=alternating(), memory=memory) as mngr:
        train(backend, mngr, range(1, 8))
        assert backend.save(mngr, 8, force=True)
        mngr.wait_until_finished()
        assert 8 in backend.disk_steps(mngr) and 8 in mngr.memory_steps()


def test_restore_reads_memory_first_bit_exact_and_says_which(backend, tmp_path, memory):
    directory = tmp_path / "ckpt"
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        train(backend, mngr, range(1, 15))
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        w = backend.restore(mngr)
        assert (mngr.restored_step, mngr.restored_tier) == (14, "memory")
        assert w.tobytes() == values_at(14).tobytes()
        assert backend.restore(mngr, 12).tobytes() == values_at(12).tobytes()
        assert mngr.restored_tier == "memory"  # step 12 has both copies: memory first
        # The schedule continues after the restored step.
        assert backend.save(mngr, 16)
        mngr.wait_until_finished()
        assert mngr.memory_steps() == [14, 16]


def test_a_run_without_the_memory_tier_in_between_makes_its_snapshots_stale(
    backend, tmp_path, memory
):
    # Found by the dataloss review: run 2, opened without memory=, resumed from the disk's
    # step 12 and saved step 14 again (other values); run 3, with memory= again, restored
    # run 1's memory snapshot of step 14 (memory first), not the step's bytes on the disk.
    directory = tmp_path / "ckpt"
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        train(backend, mngr, range(1, 15))
        assert mngr.memory_steps() == [12, 14] and 14 not in backend.disk_steps(mngr)
    with backend.open(directory, policy=cj.policies.fixed(2)) as mngr:
        assert mngr.latest_step() == 12
        for step in (13, 14):
            backend.save(mngr, step, offset=1000.0)
        mngr.wait_until_finished()
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        assert backend.restore(mngr).tobytes() == (values_at(14) + 1000).tobytes()
        assert (mngr.restored_step, mngr.restored_tier) == (14, "local")
        assert mngr.memory_steps() == []  # removed: not this directory's steps any more


def test_an_opening_in_between_that_saved_nothing_keeps_the_newer_snapshots(
    backend, tmp_path, memory
):
    directory = tmp_path / "ckpt"
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        train(backend, mngr, range(1, 15))
    backend.open(directory, policy=alternating()).close()  # e.g. a run that failed at once
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        # Step 14 is the only save of its number: kept; step 12's memory copy may not be.
        assert mngr.memory_steps() == [14]
        assert backend.restore(mngr).tobytes() == values_at(14).tobytes()
        assert (mngr.restored_step, mngr.restored_tier) == (14, "memory")
        assert backend.restore(mngr, 12).tobytes() == values_at(12).tobytes()


def test_a_corrupt_memory_copy_falls_back_to_the_next_copy(backend, tmp_path, memory):
    directory = tmp_path / "ckpt"
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        train(backend, mngr, range(1, 15))
        space = mngr._memory.path
    _flip_a_byte(backend.data_file(space / "14"))
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        with pytest.warns(RuntimeWarning, match=r"skipping damaged step 14 \(memory copy\)"):
            w = backend.restore(mngr)
        assert (mngr.restored_step, mngr.restored_tier) == (12, "memory")
        assert w.tobytes() == values_at(12).tobytes()
        assert mngr.memory_steps() == [12]  # the damaged copy deleted: the next save may go on
    _flip_a_byte(backend.data_file(space / "12"))
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        with pytest.warns(RuntimeWarning, match="memory copy"):
            w = backend.restore(mngr)
        assert (mngr.restored_step, mngr.restored_tier) == (12, "local")
        assert w.tobytes() == values_at(12).tobytes()


def test_the_budget_error_names_the_sizes_at_the_first_save(backend, tmp_path, memory):
    with backend.open(
        tmp_path / "ckpt", policy=cj.policies.fixed(1), memory=memory, memory_bytes=1000
    ) as mngr:
        with pytest.raises(ValueError, match=r"a state of 400\d bytes .* need 80\d\d bytes.*=1000"):
            backend.save(mngr, 1)
        assert mngr.all_steps() == []


def test_memory_true_falls_back_to_the_disk_when_the_state_does_not_fit(backend, tmp_path):
    with backend.open(
        tmp_path / "ckpt", policy=alternating(), memory=True, memory_bytes=1000
    ) as mngr:
        assert mngr._memory.path.parent.parent == TMPFS
        try:
            with pytest.warns(RuntimeWarning, match="memory=True: a state of .*the disk only"):
                saved = train(backend, mngr, range(1, 9))
            assert saved == [2, 4, 6, 8]
            assert mngr.memory_steps() == [] and backend.disk_steps(mngr) == saved
        finally:
            shutil.rmtree(mngr._memory.path)


def test_two_managers_on_one_memory_folder_stay_apart(backend, tmp_path, memory):
    policy = cj.policies.fixed(1)
    a = backend.open(tmp_path / "a", policy=policy, memory=memory)
    with a, backend.open(tmp_path / "b", policy=policy, memory=memory) as b:
        assert a._memory.path != b._memory.path and a._memory.path.parent == memory
        backend.save(a, 1)
        backend.save(b, 2)
        a.wait_until_finished()
        b.wait_until_finished()
        assert (a.memory_steps(), b.memory_steps()) == ([1], [2])
        shutil.copytree(tmp_path / "a", tmp_path / "copy", ignore=shutil.ignore_patterns(".*lock"))
        with pytest.raises(DirectoryLockedError, match=r"memory: the memory folder .* is in use"):
            backend.open(tmp_path / "copy", policy=policy, memory=memory)
    assert len(list(memory.iterdir())) == 2
    # Opened later, the copy still does not take the original's snapshots.
    with pytest.raises(ValueError, match=r"holds the snapshots of .*/a, whose identity"):
        backend.open(tmp_path / "copy", policy=policy, memory=memory)


@pytest.mark.parametrize(
    ("memory_arg", "bytes_arg", "error"),
    [
        (5, None, (TypeError, "memory: expected True, a folder")),
        (True, 0, (ValueError, "memory_bytes: must be positive")),
        (True, 1.5, (TypeError, "memory_bytes: expected an int")),
        (None, 10, (ValueError, "memory_bytes: given without memory=")),
    ],
)
def test_bad_memory_arguments_are_refused_by_name(backend, tmp_path, memory_arg, bytes_arg, error):
    with pytest.raises(error[0], match=error[1]):
        backend.open(tmp_path / "ckpt", memory=memory_arg, memory_bytes=bytes_arg)
    assert not (tmp_path / "ckpt").exists()  # nothing touched


def test_a_memory_folder_inside_the_directory_is_refused(backend, tmp_path):
    with pytest.raises(ValueError, match="overlaps the checkpoint directory"):
        backend.open(tmp_path / "ckpt", memory=tmp_path / "ckpt" / "mem")


# -- the PyTorch manager's own ------------------------------------------------------------------


def test_the_torch_memory_copy_is_a_committed_dcp_step_with_checksums(tmp_path, memory):
    with cjt.CheckpointManager(tmp_path / "ckpt", policy=alternating(), memory=memory) as mngr:
        train(TorchBackend(), mngr, range(1, 5))
        step_dir = mngr._memory.path / "4"
        names = sorted(p.name for p in step_dir.iterdir())
        assert names == [".metadata", "__0_0.distcp", cjt.METADATA_NAME]
        meta = json.loads((step_dir / cjt.METADATA_NAME).read_text())
        assert sorted(meta["checksums"]) == [".metadata", "__0_0.distcp"]
        assert (tmp_path / "ckpt" / ".cocijax-id").is_file()
        assert mngr._memory.path.name.startswith(".cocijax-")


def test_a_torn_torch_memory_copy_is_never_listed(tmp_path, memory):
    directory, backend = tmp_path / "ckpt", TorchBackend()
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        train(backend, mngr, range(1, 15))
        space = mngr._memory.path
    (space / "14" / cjt.METADATA_NAME).unlink()  # cut before its commit record
    (space / ".tmp-16-killed").mkdir()  # a save killed mid-write
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        assert mngr.memory_steps() == [12]
        assert not (space / "14").exists() and not (space / ".tmp-16-killed").exists()
        assert backend.restore(mngr).tobytes() == values_at(12).tobytes()
        assert mngr.restored_tier == "memory"


# -- kills and reboots, with real processes (both managers) ------------------------------------


def _check_every_listed_step(backend, directory, memory, size):
    """Restores every listed step of each tier bit-exact (the torch manager reads a step's
    memory copy first); returns the tiers' steps and the measurements of a fresh opening."""
    with backend.open(directory, policy=alternating(), memory=memory) as mngr:
        listed = (mngr.memory_steps(), backend.disk_steps(mngr))
        for tier, steps in zip(("memory", "local"), listed, strict=True):
            for step in steps:
                w = backend.restore(mngr, step, size=size, tier=tier)
                assert w.tobytes() == np.full(size, step, np.float32).tobytes(), (tier, step)
        return listed, mngr.measurements


def test_a_sigkill_then_reopen_restores_from_memory_and_counts_a_process_failure(
    backend, tmp_path, memory
):
    directory, size = tmp_path / "ckpt", backend.killed_size
    run_until_killed(backend.name, directory, memory, size, lines=9)
    out = run_until_killed(backend.name, directory, memory, size, lines=2)
    assert out[0].startswith("restored ") and out[0].endswith(" memory"), out
    (memory_steps, disk_steps), measured = _check_every_listed_step(
        backend, directory, memory, size
    )
    assert memory_steps and disk_steps
    assert (measured.failures, measured.machine_failures) == (2, 0)


def test_a_reboot_restores_from_the_disk_and_counts_a_machine_failure(backend, tmp_path, memory):
    directory, size = tmp_path / "ckpt", 1000
    run_until_killed(backend.name, directory, memory, size, lines=9)
    shutil.rmtree(memory)  # the reboot: the tmpfs is empty again
    memory.mkdir()
    out = run_until_killed(backend.name, directory, memory, size, lines=2)
    assert out[0].startswith("restored ") and out[0].endswith(" local"), out
    _, measured = _check_every_listed_step(backend, directory, memory, size)
    assert (measured.failures, measured.machine_failures) == (2, 1)
