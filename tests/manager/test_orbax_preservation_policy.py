"""Retention the user asked for, kept across a reopening (issue 27 item 3: hunted set-ups)."""

from __future__ import annotations

import datetime

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

import cocijax as cj

ACC = {1: 0.9, 2: 0.8, 3: 0.1, 4: 0.2, 5: 0.3}


def steps_after(directory, policy, saves) -> list[int]:
    with cj.CheckpointManager(
        directory, policy=cj.policies.fixed(1), preservation_policy=policy
    ) as mngr:
        for step in saves:
            mngr.save(step, {"w": jnp.full(3, step)}, loss=1.0, metrics={"acc": ACC[step]})
        mngr.wait_until_finished()
        return mngr.all_steps()


def test_a_best_n_preservation_policy_keeps_the_best_steps_across_reopening(tmp_path):
    # Orbax's BestN ranks the metrics Orbax was given with each save and, after a reopening,
    # those it read from the steps: the manager gave it none, so every step counted as without
    # metrics and this policy deleted every step, the best ones included.
    best = ocp.checkpoint_managers.BestN(
        get_metric_fn=lambda m: m["acc"], n=2, keep_checkpoints_without_metrics=False
    )
    assert steps_after(tmp_path, best, (1, 2, 3)) == [1, 2]
    assert steps_after(tmp_path, best, (4, 5)) == [1, 2]


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        (
            ocp.checkpoint_managers.LatestDuration(datetime.timedelta(hours=1)),
            ([1, 2, 3], [1, 2, 3, 4, 5]),
        ),
        (
            ocp.checkpoint_managers.AnyPreservationPolicy(
                [
                    ocp.checkpoint_managers.LatestN(1),
                    ocp.checkpoint_managers.EveryNSeconds(interval_secs=3600),
                ]
            ),
            ([1, 3], [1, 5]),
        ),
    ],
    ids=["LatestDuration", "EveryNSeconds"],
)
def test_a_time_preservation_policy_works_after_reopening(tmp_path, policy, kept):
    # Opened without the steps' commit times, Orbax gave them datetime.min, which its
    # time policies cannot compare with a new step's time: every save after a reopening
    # failed with "can't subtract offset-naive and offset-aware datetimes".
    assert steps_after(tmp_path, policy, (1, 2, 3)) == kept[0]
    assert steps_after(tmp_path, policy, (4, 5)) == kept[1]
