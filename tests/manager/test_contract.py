"""The contract both managers implement (`cocijax.manager.ManagerProtocol`), one error set,
and the same best-N retention, preemption saves and final step (real files, real signals)."""

import json
import logging
import os
import signal
import threading
import warnings

import numpy as np
import pytest
from manager_helpers import FakeClock  # pytest puts tests/ on sys.path

import cocijax as cj
from cocijax.core._policy_inputs import prior_cost_s
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


def _jax_cost_on_disk(path, step) -> float:
    return json.loads((path / str(step) / "policy" / "policy_state.json").read_text())["cost_s"]


def _torch_cost_on_disk(path, step) -> float:
    return json.loads((path / str(step) / "cocijax.json").read_text())["policy"]["cost_s"]


MANAGERS = {"jax": (_jax_manager, _jax_state), "torch": (_torch_manager, _torch_state)}
COST_ON_DISK = {"jax": _jax_cost_on_disk, "torch": _torch_cost_on_disk}


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
        exit_on_preemption=False,  # SIGUSR1's default action would end the test's process
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
        # The best two now are 12 and 4; 9, the preemption save, is never dropped (with
        # keep_latest=0 neither: a job resumes from it).
        assert mngr.all_steps() == [4, 9, 12]
        assert mngr.metrics(12) == {"acc": 0.99} and mngr.metrics(9) == {"acc": 0.1}
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is given back


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_steps_without_metrics_are_kept_only_as_newest_steps_said_once(tmp_path, kind):
    make, state = MANAGERS[kind]
    best = {"best_fn": lambda m: m["acc"], "max_to_keep": 1}
    with (
        pytest.warns(RuntimeWarning, match=r"step 2 has no metrics.*keep_latest=1") as said,
        make(tmp_path, policy=cj.policies.fixed(1), **best) as mngr,
    ):
        mngr.save(1, state(), loss=1.0, metrics={"acc": 0.5})
        for step in (2, 3, 4):
            mngr.save(step, state(), loss=1.0)
        mngr.wait_until_finished()
        # Step 1 is the only ranked one; of the unranked, only the newest stays.
        assert mngr.all_steps() == [1, 4]
    (warning,) = [w for w in said if "no metrics" in str(w.message)]
    assert warning.filename == __file__  # it points at the user's save call


@pytest.fixture
def own_sigterm_handler():
    """A handler of the test's own, so that a restored handler can be told from the default."""
    seen: list[int] = []

    def handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler, seen
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("exit_on_preemption", [True, False])
@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_sigterm_saves_the_next_step_commits_and_hands_the_signal_on(
    tmp_path, own_sigterm_handler, kind, exit_on_preemption
):
    make, state = MANAGERS[kind]
    handler, seen = own_sigterm_handler
    never = cj.policies.fixed(10**6)
    with make(tmp_path, policy=never, exit_on_preemption=exit_on_preemption) as mngr:
        assert signal.getsignal(signal.SIGTERM) != handler  # the manager's own while open
        assert not mngr.save(1, state(), loss=1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered by the kernel
        assert not mngr.reached_preemption and seen == []
        assert mngr.save(2, state(), loss=1.0)  # the policy says no; the preemption says save
        assert mngr.reached_preemption
        assert mngr.all_steps() == [2]  # committed before save returned: no wait needed
        # By default the signal then goes on to the handler cocijax replaced, as it would
        # have without cocijax (a default action would have ended the process: see
        # test_signals.py); a handler that returns leaves the manager open.
        assert seen == ([signal.SIGTERM] if exit_on_preemption else [])
        # Its cost is measured and recorded like any other save's.
        assert COST_ON_DISK[kind](tmp_path, 2) == mngr.measurements.last_save_s > 0
        # One preemption save only: the loop should stop, and if it does not, the policy rules.
        assert not mngr.save(3, state(), loss=1.0)
    assert signal.getsignal(signal.SIGTERM) is handler
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM] * (2 if exit_on_preemption else 1)
    with make(tmp_path, policy=never) as again:
        assert again.latest_step() == 2 and not again.reached_preemption


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_outside_the_main_thread_a_warning_and_no_handler(tmp_path, kind):
    make, state = MANAGERS[kind]
    before = signal.getsignal(signal.SIGTERM)
    caught: list[warnings.WarningMessage] = []
    results: list[object] = []

    def train():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with make(tmp_path) as mngr:
                results.extend(mngr.save(s, state(), loss=1.0) for s in (1, 2))
                results.append(signal.getsignal(signal.SIGTERM))
        caught.extend(said)

    thread = threading.Thread(target=train, name="trainer")
    thread.start()
    thread.join()
    assert results == [False, True, before]  # it trains and saves; SIGTERM is left alone
    (said,) = [w for w in caught if "main thread" in str(w.message)]
    assert issubclass(said.category, RuntimeWarning)
    assert "'trainer'" in str(said.message) and "preemption_signals=()" in str(said.message)


EXITS = {
    "an error": RuntimeError("gloo: the peer rank is gone"),
    "Ctrl-C": KeyboardInterrupt(),
    "sys.exit(0)": SystemExit(0),
    "an error after a preemption save": RuntimeError("after the preemption save"),
}


@pytest.mark.parametrize("how", EXITS)
@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_leaving_the_with_block_by_an_exception_is_a_failure(tmp_path, kind, how):
    """Finding 20: under torchrun, rank 1 killed during a save made rank 0's commit fail; the
    error left the `with` block and close() removed the running marker (this run had committed
    a save), so the restarted job counted no failure."""
    make, state = MANAGERS[kind]
    with (
        pytest.raises(type(EXITS[how])),
        make(tmp_path, preemption_signals=(signal.SIGUSR1,), exit_on_preemption=False) as mngr,
    ):
        mngr.save(1, state(), loss=1.0, force=True)
        mngr.wait_until_finished()  # committed: a clean close would remove the marker
        if how == "an error after a preemption save":
            os.kill(os.getpid(), signal.SIGUSR1)
            assert mngr.save(2, state(), loss=1.0) and mngr.reached_preemption
        raise EXITS[how]
    with make(tmp_path) as again:
        failed = how in ("an error", "Ctrl-C")
        assert again.measurements.failures == int(failed)


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_measurements_show_the_mtbf_and_recovery_the_policy_uses(tmp_path, kind):
    """Issue 30: a policy built with mtbf_s=1.0 was reported with the 24 h prior."""
    make, state = MANAGERS[kind]
    with make(tmp_path, policy=cj.policies.coci(mtbf_s=1.0, recovery_s=5.0)) as mngr:
        mngr.save(1, state(), loss=1.0)
        assert (mngr.measurements.mtbf_s, mngr.measurements.recovery_s) == (1.0, 5.0)
    # Without its own, the policy uses what the directory learned (no failure: the prior).
    with make(tmp_path / "learned", policy=cj.policies.young(), prior_mtbf_s=7200.0) as mngr:
        mngr.save(1, state(), loss=1.0)
        assert 7200.0 <= mngr.measurements.mtbf_s < 7200.0 + 60.0


STATE_BYTES = {"jax": 3 * 8, "torch": 3 * 4}  # np.arange(3.0), torch.arange(3.0)


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_a_fresh_job_is_said_and_saved_early_to_measure_its_cost(tmp_path, kind, caplog):
    """The first hour: coci() assumed a 10 s save until one was timed; its first save came
    after ~330 s of training, so a 20 s job kept only its final step and a kill restarted it
    from step 0, with no word. Now the first timed step (step 2) is saved."""
    make, state = MANAGERS[kind]
    clock = FakeClock(tick=0.25)
    started = f"no checkpoint in {tmp_path}: starting at step 1"
    with caplog.at_level(logging.INFO), make(tmp_path, policy=cj.policies.coci(), clock=clock) as m:
        assert started in caplog.messages
        decisions = []
        for step in range(1, 6):
            clock.advance(1.0)
            decisions.append(m.save(step, state(), loss=1.0))
            if step == 1:  # until a save is timed, a cost from the state's size
                assert m.measurements.cost_estimate_s == prior_cost_s(STATE_BYTES[kind])
        assert decisions == [False, True, False, False, False]
        m.wait_until_finished()
        assert m.all_steps() == [2]
        assert m.measurements.cost_estimate_s == m.measurements.last_save_s > 0
    caplog.clear()
    # Reopened, the job has the cost its checkpoint measured: no early save, no word.
    with caplog.at_level(logging.INFO), make(tmp_path, policy=cj.policies.coci(), clock=clock) as m:
        assert started not in caplog.messages
        for step in range(3, 8):
            clock.advance(1.0)
            assert not m.save(step, state(), loss=1.0)
