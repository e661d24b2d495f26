"""A tree the reader would refuse is refused by the writer (issue 27 item 3: hunted set-ups).

A listing trusts a manifest by its digest alone, so a manifest written is one a reader
accepts: a custom pytree node whose children's keys repeat or mix kinds saved, was listed and
counted by ``max_to_keep`` (the older, readable step was deleted), and could not be restored.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj


class Mixed:
    """A pytree node whose two children are keyed by an int and by a str."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    Mixed,
    lambda n: (((jax.tree_util.DictKey(0), n.a), (jax.tree_util.DictKey("x"), n.b)), None),
    lambda _, children: Mixed(*children),
)


def test_an_unreadable_tree_fails_its_save_and_deletes_no_readable_step(tmp_path):
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1), max_to_keep=1) as mngr:
        mngr.save(1, {"w": np.ones(3)}, loss=1.0)
        mngr.wait_until_finished()
        with pytest.raises(cj.storage.CheckpointFormatError, match="mixes list indices"):
            mngr.save(2, {"w": Mixed(np.zeros(2), np.ones(2))}, loss=1.0)
            mngr.wait_until_finished()
    reader_options = ocp.CheckpointManagerOptions(read_only=True)
    with cj.CheckpointManager(tmp_path, options=reader_options) as reader:
        assert reader.all_steps() == [1]
        np.testing.assert_array_equal(reader.restore(1)["w"], np.ones(3))
