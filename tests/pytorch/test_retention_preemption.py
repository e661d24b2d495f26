"""Best-N by metrics and preemption saves of the PyTorch manager in one process: bad input,
SIGTERM (a real signal) and the handler given back, a manager opened outside the main thread.
Both managers' shared behaviour is in ``tests/manager/test_contract.py``; several ranks in
``test_ranks.py``."""

from __future__ import annotations

import json
import os
import signal
import threading
import warnings

import pytest
import torch

import cocijax as cj
import cocijax.torch as cjt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
STATE = {"w": torch.arange(3.0)}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"best_fn": "acc"}, TypeError, "best_fn: expected a function"),
        ({"best_fn": len, "best_mode": "best"}, ValueError, "best_mode: expected 'max' or 'min'"),
        ({"best_fn": len, "keep_latest": -1}, ValueError, "keep_latest: expected an int >= 0"),
        ({"preemption_signals": (signal.SIGKILL,)}, ValueError, "SIGKILL cannot be caught"),
        ({"preemption_signals": "SIGTERM"}, TypeError, "expected a tuple of signals"),
    ],
    ids=["best-fn-str", "best-mode", "keep-latest", "sigkill", "signal-name"],
)
def test_bad_retention_and_preemption_arguments_are_named(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        cjt.CheckpointManager(tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()  # refused before the directory is touched


def test_bad_metrics_are_refused_before_anything_is_written(tmp_path):
    with cjt.CheckpointManager(
        tmp_path, policy=cj.policies.fixed(1), best_fn=lambda m: m["acc"], max_to_keep=1
    ) as mngr:
        bad = [
            ({"acc": torch.ones(2)}, TypeError, r"metrics\['acc'\]: expected a scalar.*\(2,\)"),
            ([0.5], TypeError, "metrics: expected a dict"),
            ({"loss": 0.3}, ValueError, r"best_fn failed on the metrics of step \d.*'loss'"),
        ]
        for step, (metrics, error, match) in enumerate(bad, 1):
            with pytest.raises(error, match=match):
                mngr.save(step, STATE, loss=1.0, metrics=metrics)
            assert mngr.all_steps() == []  # nothing saved, the manager goes on
        assert mngr.save(4, STATE, loss=1.0, metrics={"acc": torch.tensor(0.25)})
        assert mngr.metrics(4) == {"acc": 0.25}  # a 0-d tensor is read as a number
    assert json.loads((tmp_path / "4" / cjt.METADATA_NAME).read_text())["metrics"] == {"acc": 0.25}


def test_steps_without_metrics_are_kept_only_as_newest_steps_said_once(tmp_path):
    with (
        pytest.warns(RuntimeWarning, match=r"step 2 has no metrics.*keep_latest=1") as said,
        cjt.CheckpointManager(
            tmp_path, policy=cj.policies.fixed(1), best_fn=lambda m: m["acc"], max_to_keep=1
        ) as mngr,
    ):
        mngr.save(1, STATE, loss=1.0, metrics={"acc": 0.5})
        for step in (2, 3, 4):
            mngr.save(step, STATE, loss=1.0)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 4]  # the only ranked step, and the newest
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


def test_sigterm_saves_the_next_step_commits_and_gives_the_handler_back(
    tmp_path, own_sigterm_handler
):
    handler, seen = own_sigterm_handler
    never = cj.policies.fixed(10**6)
    with cjt.CheckpointManager(tmp_path, policy=never) as mngr:
        assert not mngr.save(1, STATE, loss=1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered by the kernel
        assert mngr.save(2, STATE, loss=1.0) and mngr.reached_preemption
        assert (tmp_path / "2" / cjt.METADATA_NAME).is_file()  # committed when save returned
        assert json.loads((tmp_path / "2" / cjt.METADATA_NAME).read_text())["policy"]["cost_s"] > 0
        assert not mngr.save(3, STATE, loss=1.0)  # one preemption save; then the policy rules
        assert seen == []  # the manager took the signal, not the handler it replaced
    assert signal.getsignal(signal.SIGTERM) is handler
    with cjt.CheckpointManager(tmp_path, policy=never) as again:
        assert again.latest_step() == 2 and not again.reached_preemption


def test_outside_the_main_thread_a_warning_and_no_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    caught: list[warnings.WarningMessage] = []
    results: list[object] = []

    def train():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(2)) as mngr:
                results.extend(mngr.save(s, STATE, loss=1.0) for s in (1, 2))
                results.append(signal.getsignal(signal.SIGTERM))
        caught.extend(said)

    thread = threading.Thread(target=train, name="trainer")
    thread.start()
    thread.join()
    assert results == [False, True, before]  # it trains and saves; SIGTERM is left alone
    (said,) = [w for w in caught if "main thread" in str(w.message)]
    assert issubclass(said.category, RuntimeWarning)
    assert "'trainer'" in str(said.message) and "preemption_signals=()" in str(said.message)
