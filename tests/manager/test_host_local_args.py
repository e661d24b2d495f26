"""``CheckpointManager(host_local=...)`` in one process: bad input is refused before anything is
touched, and ``host_local=True`` alone changes nothing (one process is its own host). The
several-process behaviour is tested with real processes in tests/reliability/test_host_local.py.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj


def _open(directory, **kwargs) -> cj.CheckpointManager:
    return cj.CheckpointManager(
        directory, policy=cj.policies.fixed(10**6), exit_on_preemption=False, **kwargs
    )


def test_host_local_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="host_local: expected a bool, got 'yes'"):
        _open(tmp_path / "ckpt", host_local="yes")
    assert not (tmp_path / "ckpt").exists()


def test_host_local_refuses_its_own_multiprocessing_options(tmp_path):
    options = ocp.CheckpointManagerOptions(
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=1)
    )
    with pytest.raises(ValueError, match=r"host_local=True: options\.multiprocessing_options"):
        _open(tmp_path / "ckpt", host_local=True, options=options)
    assert not (tmp_path / "ckpt").exists()


def test_host_local_with_a_memory_tier_in_one_process_saves_and_restores_as_usual(tmp_path, memory):
    state = {"w": np.arange(6, dtype=np.float32)}
    with _open(tmp_path / "ckpt", host_local=True, memory=memory) as mngr:
        mngr.save(1, state, loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.memory_steps() == [1] and mngr._local_steps() == [1]
    with _open(tmp_path / "ckpt", host_local=True, memory=memory) as mngr:
        restored = mngr.restore()
        assert mngr.restored_tier == "memory"
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_host_local_in_one_process_saves_and_restores_as_usual(tmp_path):
    state = {"w": np.arange(6, dtype=np.float32), "b": np.int32(3)}
    with _open(tmp_path / "ckpt", host_local=True, durable=tmp_path / "durable") as mngr:
        mngr.save(1, state, loss=1.0, force=True)
        mngr.wait_until_finished(durable=True)
        assert mngr.durable_steps() == [1]
    with _open(tmp_path / "ckpt", host_local=True, durable=tmp_path / "durable") as mngr:
        restored = mngr.restore(1, tier="durable")
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert restored["b"] == 3


def test_a_memory_tier_on_a_directory_several_processes_share_is_refused(
    tmp_path, memory, monkeypatch
):
    # Refused from the process count alone, before anything is made: a patched count will do.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(
        ValueError,
        match=r"memory=: the memory tier supports one process; this job has 2\. "
        r"Pass host_local=True \(a memory tier per process\) with a durable= tier",
    ):
        _open(tmp_path / "ckpt", memory=memory)
    assert not (tmp_path / "ckpt").exists()
    assert list(memory.iterdir()) == []  # nothing made in the memory folder either
