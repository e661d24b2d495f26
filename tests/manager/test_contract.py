"""The contract both managers implement (`cocijax.manager.ManagerProtocol`), one error set."""

import numpy as np
import pytest

import cocijax as cj
from cocijax.manager import ManagerClosedError, ManagerProtocol


def _jax_manager(path):
    return cj.CheckpointManager(path, policy=cj.policies.fixed(2))


def _torch_manager(path):
    cjt = pytest.importorskip("cocijax.torch")
    if not hasattr(cjt.CheckpointManager, "reached_preemption"):
        # The contract grew with issue 10; the PyTorch half lands in cocijax/torch.py apart.
        pytest.skip("cocijax.torch.CheckpointManager does not have issue 10's members yet")
    return cjt.CheckpointManager(path, policy=cj.policies.fixed(2))


def _jax_state():
    return {"w": np.arange(3.0)}


def _torch_state():
    torch = pytest.importorskip("torch")
    return {"w": torch.arange(3.0)}


MANAGERS = {"jax": (_jax_manager, _jax_state), "torch": (_torch_manager, _torch_state)}


@pytest.mark.parametrize("kind", MANAGERS)
def test_both_managers_keep_the_contract_and_refuse_calls_after_close(tmp_path, kind):
    make, state = MANAGERS[kind]
    mngr = make(tmp_path)
    assert isinstance(mngr, ManagerProtocol)
    assert [mngr.save(step, state(), loss=1.0 / step) for step in (1, 2, 3)] == [
        False,
        True,
        False,
    ]
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2] and mngr.latest_step() == 2
    mngr.close()
    for call in (lambda: mngr.save(4, state(), loss=0.1), lambda: mngr.restore(2)):
        with pytest.raises(ManagerClosedError, match="closed") as raised:
            call()
        # The JAX manager raised ValueError, the PyTorch one RuntimeError: both stay caught.
        assert isinstance(raised.value, ValueError) and isinstance(raised.value, RuntimeError)
    assert mngr.all_steps() == [2]  # what is on disk can still be listed
    mngr.close()  # closing twice is fine
    with make(tmp_path) as reopened:
        assert reopened.all_steps() == [2]
