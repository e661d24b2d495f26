"""Best-N retention by metrics that never drops the newest steps (google/orbax#526), on disk."""

from __future__ import annotations

import os
import signal

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax.core._retention import BestN
from cocijax.storage._stripes import referenced_stripe_dirs

# Eval accuracy at steps 1..8; the newest step (8) is the worst but one.
ACC = {1: 0.50, 2: 0.90, 3: 0.60, 4: 0.95, 5: 0.40, 6: 0.70, 7: 0.80, 8: 0.45}


def run(directory, **kwargs) -> list[int]:
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1), **kwargs) as mngr:
        for step, acc in ACC.items():
            mngr.save(step, {"w": jnp.full(3, step)}, loss=1.0, metrics={"eval_acc": acc})
        mngr.wait_until_finished()
        return mngr.all_steps()


def test_best_steps_are_kept_and_the_newest_never_dropped_unlike_orbax(tmp_path):
    best = {"best_fn": lambda m: m["eval_acc"], "max_to_keep": 2}
    assert run(tmp_path / "max", **best) == [2, 4, 8]  # the two best, and the newest
    assert run(tmp_path / "min", **best, best_mode="min") == [5, 8]  # 8 is among the best
    assert run(tmp_path / "latest2", **best, keep_latest=2) == [2, 4, 7, 8]
    # keep_latest=0 ranks every step, the newest too: what Orbax's own best_fn does.
    assert run(tmp_path / "none", **best, keep_latest=0) == [2, 4]
    options = ocp.CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["eval_acc"])
    with ocp.CheckpointManager(tmp_path / "orbax", options=options) as orbax:
        for step, acc in ACC.items():
            args = ocp.args.StandardSave({"w": np.ones(3)})
            orbax.save(step, args=args, metrics={"eval_acc": acc})
        orbax.wait_until_finished()
        assert orbax.all_steps() == [2, 4]  # the newest step, 8, is gone
    # best_fn and best_mode given through Orbax's options work the same way.
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["eval_acc"], best_mode="min")
    assert run(tmp_path / "options", max_to_keep=2, options=options) == [5, 8]


def test_ranking_continues_after_reopening_and_stripes_of_dropped_steps_go(tmp_path):
    roots = [tmp_path / "r0", tmp_path / "r1"]
    kwargs = {"roots": roots, "best_fn": lambda m: m["eval_acc"], "max_to_keep": 1}
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1), **kwargs) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"w": jnp.ones(1000)}, loss=1.0, metrics={"eval_acc": ACC[step]})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1), **kwargs) as mngr:
        mngr.save(4, {"w": jnp.ones(1000)}, loss=1.0, metrics={"eval_acc": ACC[4]})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4]  # 2 was the best on disk until 4 beat it
        stripes = {p.name for r in roots for p in r.rglob("cocijax-stripe-*") if p.is_dir()}
        referenced = {p.name for p in referenced_stripe_dirs(mngr.item_directory(4))}
        assert stripes == referenced


def test_a_preemption_save_is_kept_even_when_no_newest_step_is(tmp_path):
    with cj.CheckpointManager(
        tmp_path,
        policy=cj.policies.fixed(1),
        best_fn=lambda m: m["acc"],
        max_to_keep=1,
        keep_latest=0,
        preemption_signals=(signal.SIGUSR1,),
        exit_on_preemption=False,  # SIGUSR1's default action would end the test's process
    ) as mngr:
        for step in (1, 2):
            mngr.save(step, {"w": jnp.ones(2)}, loss=1.0, metrics={"acc": 0.9 - step / 10})
        os.kill(os.getpid(), signal.SIGUSR1)
        mngr.save(3, {"w": jnp.ones(2)}, loss=1.0, metrics={"acc": 0.1})  # the worst
        assert mngr.reached_preemption
        assert mngr.all_steps() == [1, 3]  # ranked out, but the job resumes from it
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_best_fn_that_cannot_read_the_metrics_fails_before_saving(tmp_path):
    with cj.CheckpointManager(
        tmp_path, policy=cj.policies.fixed(1), best_fn=lambda m: m["eval_acc"], max_to_keep=2
    ) as mngr:
        with pytest.raises(ValueError, match=r"best_fn failed on the metrics of step 1.*'loss'"):
            mngr.save(1, {"w": jnp.ones(2)}, loss=1.0, metrics={"loss": 0.3})
        mngr.wait_until_finished()
        assert mngr.all_steps() == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"best_fn": "eval_acc"}, TypeError, "best_fn: expected a function"),
        ({"best_fn": len, "best_mode": "best"}, ValueError, "best_mode: expected 'max' or 'min'"),
        ({"best_fn": len, "keep_latest": -1}, ValueError, "keep_latest: expected an int >= 0"),
        (
            {"best_fn": len, "preservation_policy": ocp.checkpoint_managers.LatestN(2)},
            ValueError,
            "preservation_policy: cannot be combined with best_fn",
        ),
        (
            {"best_fn": len, "options": ocp.CheckpointManagerOptions(best_fn=max)},
            ValueError,
            "best_fn: given as an argument and in options",
        ),
    ],
    ids=["not-callable", "bad-mode", "negative-keep-latest", "preservation", "twice"],
)
def test_bad_retention_arguments_are_named(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        cj.CheckpointManager(tmp_path, **kwargs)
    assert not (tmp_path / ".cocijax-running").exists()  # refused before the directory is used


def test_best_n_selection_rules():
    best = BestN(lambda m: m["a"], best_mode="max", max_to_keep=1, keep_latest=1, keep_period=4)
    metrics = {1: {"a": 3.0}, 2: {"a": float("nan")}, 3: {"a": 3.0}, 4: {"a": 0.0}, 5: None}
    # Ties keep the newer step (3 over 1); NaN is not ranked; 4 is periodic; 5 the newest.
    assert best.to_delete(metrics) == [1, 2]
    assert best.to_delete({}) == []
    every = BestN(lambda m: m["a"], max_to_keep=None, keep_latest=0)
    assert every.to_delete({1: {"a": 1.0}, 2: None}) == [2]
