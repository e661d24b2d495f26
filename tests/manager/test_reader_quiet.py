"""Opening a read-only manager logs no warning (it used to log four through absl)."""

from __future__ import annotations

import logging

import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

import cocijax as cj


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_reader_opens_restores_and_closes_without_a_warning(tmp_path, caplog):
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as writer:
        for step in (1, 2):
            writer.save(step, {"w": np.arange(8.0) + step}, loss=1.0)
    # Orbax's options class itself warns when read_only=True meets its defaults
    # (save_interval_steps=1, create=True): built before the capture, it is the user's call.
    plain = ocp.CheckpointManagerOptions(read_only=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        # Options a reader can have without any warning at all, even from Orbax's options.
        consistent = ocp.CheckpointManagerOptions(
            read_only=True, save_interval_steps=0, create=False
        )
        for options in (plain, consistent):
            with cj.CheckpointManager(tmp_path, options=options) as reader:
                assert reader.all_steps() == [1, 2]
                restored = reader.restore(2)
                np.testing.assert_array_equal(restored["w"], np.arange(8.0) + 2)
    assert _warnings(caplog) == []


def test_only_orbax_reader_notice_is_dropped_and_only_while_a_reader_opens(tmp_path, caplog):
    cj.CheckpointManager(tmp_path).close()
    with caplog.at_level(logging.WARNING):
        reader = cj.CheckpointManager(
            tmp_path,
            options=ocp.CheckpointManagerOptions(
                read_only=True, save_interval_steps=0, create=False
            ),
        )
        reader.close()
        absl_logging.warning("Given directory is read only=%s", tmp_path)  # not by a reader
    assert _warnings(caplog) == [f"Given directory is read only={tmp_path}"]
