"""``cocijax ls`` and ``verify`` beside a writer that deletes steps (``max_to_keep``).

A writer renames a step into its trash before it removes any file, so a step whose directory
is gone by the time it is read was deleted, not damaged: both commands skip it with a note and
exit 0. The deletion is made to land at a chosen point (after the listing, during the checksum
check) by wrapping the function that runs there.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import cocijax as cj
from cocijax.cli import _inspect, main
from cocijax.storage._records import MANIFEST_NAME


@pytest.fixture
def two_steps(tmp_path) -> Path:
    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1)) as mngr:
        for step in (1, 2):
            mngr.save(step, {"w": np.arange(4096, dtype=np.float32) + step}, loss=1.0)
    return directory


def _delete_as_the_writer_does(step_dir: Path) -> None:
    trash = step_dir.parent / ".cocijax-deleted"
    trash.mkdir(exist_ok=True)
    step_dir.rename(trash / step_dir.name)
    shutil.rmtree(trash / step_dir.name)


def _rows(out: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^│\s*(\d+)\s*│", out, re.M)]


@pytest.mark.parametrize(
    "command, when",
    [
        (["ls"], "after listing"),
        (["ls", "--no-verify"], "after listing"),
        (["ls"], "during verify"),
        (["verify"], "during verify"),
    ],
)
def test_a_step_deleted_while_it_is_read_is_skipped_not_damaged(
    two_steps, monkeypatch, capsys, command, when
):
    step_1 = two_steps / "1"
    if when == "after listing":
        real_find = _inspect.find_steps

        def find_then_delete(directory):
            steps = real_find(directory)
            _delete_as_the_writer_does(step_1)
            return steps

        monkeypatch.setattr(_inspect, "find_steps", find_then_delete)
    else:
        real_verify = cj.storage.verify

        def delete_then_verify(item, **kwargs):
            if Path(item).parent == step_1:
                _delete_as_the_writer_does(step_1)
            return real_verify(item, **kwargs)

        monkeypatch.setattr(cj.storage, "verify", delete_then_verify)
    status = main([command[0], str(two_steps), *command[1:]])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    doing = "listed" if command[0] == "ls" else "verified"
    assert f"step 1: deleted while it was {doing} (by its writer); skipped" in captured.out
    assert captured.err == ""
    if command[0] == "ls":
        assert _rows(captured.out) == [2]
    else:
        assert "OK: 1 step(s) verified" in captured.out


def test_a_step_missing_a_file_while_its_directory_stays_is_damage(two_steps, capsys):
    (two_steps / "1" / "state" / MANIFEST_NAME).unlink()
    assert main(["ls", str(two_steps)]) == 1
    assert "DAMAGED" in capsys.readouterr().out
