"""Bad input to best-N and preemption of the PyTorch manager. What both managers do alike
(best-N, steps without metrics, a real SIGTERM, a manager opened outside the main thread) is in
``tests/manager/test_contract.py``; several ranks in ``test_ranks.py``."""

from __future__ import annotations

import json
import signal

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
