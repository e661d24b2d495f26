"""The contract both managers implement (`cocijax.manager.ManagerProtocol`), one error set,
and the same best-N retention, preemption saves and final step (real files, real signals)."""

import os
import signal

import numpy as np
import pytest

import cocijax as cj
from cocijax.manager import ManagerClosedError, ManagerProtocol


def _jax_manager(path, policy=None, **kwargs):
    return cj.CheckpointManager(path, policy=policy or cj.policies.fixed(2), **kwargs)


def _torch_manager(path, policy=None, **kwargs):
    cjt = pytest.importorskip("cocijax.torch")
    return cjt.CheckpointManager(path, policy=policy or cj.policies.fixed(2), **kwargs)


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


# Eval accuracy of steps 1..8: the newest step is the worst but one.
ACC = {1: 0.50, 2: 0.90, 3: 0.60, 4: 0.95, 5: 0.40, 6: 0.70, 7: 0.80, 8: 0.45}


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_both_managers_keep_the_best_steps_save_on_a_signal_and_save_the_final_step(tmp_path, kind):
    make, state = MANAGERS[kind]
    # An MTBF of years: coci saves nothing by itself in 12 steps, except the last one.
    coci = cj.policies.coci(mtbf_s=1e8, recovery_s=0.0, total_steps=12, cost_prior_s=1.0)
    mngr = make(
        tmp_path,
        policy=coci,
        best_fn=lambda m: m["acc"],
        max_to_keep=2,
        preemption_signals=(signal.SIGUSR1,),
    )
    with mngr:
        for step, acc in ACC.items():
            assert mngr.save(step, state(), loss=1.0, force=True, metrics={"acc": acc})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 4, 8]  # the two best, and the newest
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, delivered by the kernel
        assert not mngr.reached_preemption
        assert mngr.save(9, state(), loss=1.0, metrics={"acc": 0.1})  # the policy says no
        assert mngr.reached_preemption and mngr.latest_step() == 9  # committed already
        assert [mngr.save(s, state(), loss=1.0) for s in (10, 11)] == [False, False]
        assert mngr.save(12, state(), loss=1.0, metrics={"acc": 0.99})  # the final step
        mngr.wait_until_finished()
        # The best two now are 12 and 4; 9 stays, the step the job would resume from.
        assert mngr.all_steps() == [4, 9, 12]
        assert mngr.metrics(12) == {"acc": 0.99} and mngr.metrics(9) == {"acc": 0.1}
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is given back
