"""A job that switches from Orbax's CheckpointManager to cocijax continues from its Orbax steps.

The directories in tests/data/orbax-0.12-checkpoint were written by Orbax 0.12.8's own manager
(StandardSave as the ``default`` item; a Composite of ``state`` and a JSON ``config``; a
PyTreeSave ``params``). Before: ``cj.CheckpointManager`` refused them ("... has no 'state' item;
it was not written by cocijax"), so a running job could not be switched over.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj

DATA = Path(__file__).resolve().parent.parent / "data" / "orbax-0.12-checkpoint"
EXPECTED = json.loads((DATA / "expected.json").read_text())


@pytest.fixture
def orbax_dir(tmp_path):
    """A copy of the Orbax 0.12 directories (a test may write into its copy)."""
    shutil.copytree(DATA, tmp_path / "orbax")
    return tmp_path / "orbax"


def _as_json(tree):
    return {
        k: _as_json(v) if isinstance(v, dict) else np.asarray(v).tolist() for k, v in tree.items()
    }


def _abstract(expected: dict):
    def leaf(value):
        a = np.asarray(value, dtype=np.float32 if isinstance(value, list) else None)
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    return jax.tree.map(leaf, expected, is_leaf=lambda x: not isinstance(x, dict))


def _digest(directory: Path) -> str:
    """Every file's path and bytes under ``directory``: an Orbax step left untouched keeps it."""
    h = hashlib.sha256()
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(directory)).encode() + f.read_bytes())
    return h.hexdigest()


def _state(step: int) -> dict:
    return {"w": np.full(8, step, np.float32)}


def test_a_standard_save_directory_is_listed_restored_and_continued(orbax_dir, caplog):
    directory = orbax_dir / "standard"
    before = {s: _digest(directory / s) for s in ("10", "20")}
    with caplog.at_level(logging.INFO, logger="cocijax"):
        mngr = cj.CheckpointManager(directory, policy=cj.policies.fixed(10**6), max_to_keep=2)
    with mngr:
        assert mngr.all_steps() == [10, 20] and mngr.latest_step() == 20
        restored = mngr.restore()  # as saved, through Orbax's StandardCheckpointHandler
        assert _as_json(restored) == EXPECTED["standard/20"]
        assert "written by Orbax" in caplog.text
        assert _as_json(mngr.restore(10)) == EXPECTED["standard/10"]
        # New steps in cocijax's format, after the newest Orbax step; Orbax's stay untouched
        # and do not count in max_to_keep.
        with pytest.raises(ValueError, match="not after the latest saved step 20"):
            mngr.save(20, _state(20), loss=1.0, force=True)
        for step in (21, 22, 23):
            assert mngr.save(step, _state(step), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [10, 20, 22, 23]
    assert {s: _digest(directory / s) for s in ("10", "20")} == before
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(10**6)) as again:
        assert again.latest_step() == 23
        np.testing.assert_array_equal(again.restore()["w"], _state(23)["w"])


def test_a_target_restores_onto_its_shapes_and_shardings(orbax_dir):
    expected = EXPECTED["composite/30"]
    target = _abstract(expected)
    target["opt"]["count"] = jax.ShapeDtypeStruct((), np.int32)
    target["step"] = jax.ShapeDtypeStruct((), np.int32)
    with cj.CheckpointManager(orbax_dir / "composite", policy=cj.policies.fixed(1)) as mngr:
        state, extra = mngr.restore(target=target, extra={"config": ocp.args.JsonRestore()})
        assert _as_json(state) == expected and extra == {"config": {"lr": 0.1}}
        assert isinstance(state["params"]["w"], jax.Array)
        with pytest.raises(ValueError, match="partial=True is not supported"):
            mngr.restore(target=target, partial=True)
        with pytest.raises(KeyError, match="no item 'data'"):
            mngr.restore(extra={"data": ocp.args.JsonRestore()})


def test_a_pytree_save_item_is_the_state_when_it_is_the_only_tree(orbax_dir):
    with cj.CheckpointManager(orbax_dir / "pytree", policy=cj.policies.fixed(1)) as mngr:
        assert mngr.latest_step() == 40
        assert _as_json(mngr.restore()) == EXPECTED["pytree/40"]


def test_orbax_steps_count_in_retention_only_on_request(orbax_dir):
    directory = orbax_dir / "standard"
    with cj.CheckpointManager(
        directory, policy=cj.policies.fixed(10**6), max_to_keep=2, orbax_retention=True
    ) as mngr:
        mngr.save(21, _state(21), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [20, 21]  # the oldest Orbax step made room
        mngr.save(22, _state(22), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [21, 22]
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "21",
        "22",
    ]


def test_a_step_that_neither_wrote_is_still_refused(tmp_path):
    (tmp_path / "ck" / "3" / "weights").mkdir(parents=True)
    with pytest.raises(ValueError, match="neither a 'state' item of cocijax's nor Orbax's"):
        cj.CheckpointManager(tmp_path / "ck")


def test_the_command_line_lists_orbax_steps_beside_cocijax_s(orbax_dir, capsys):
    from cocijax.cli import main

    directory = orbax_dir / "composite"  # Orbax's 'state' item is no damaged cocijax step
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(31, _state(31), loss=1.0)
    assert main(["ls", str(directory)]) == 0
    listed = "".join(capsys.readouterr().out.split())  # the table may wrap its cells
    assert "n/a(writtenbyOrbax)" in listed and "│ok│" in listed
    assert main(["verify", str(directory)]) == 0
    said = capsys.readouterr().out
    assert "steps [30]: not verified (written by Orbax)" in said
    assert "OK: 1 step(s) verified" in said
