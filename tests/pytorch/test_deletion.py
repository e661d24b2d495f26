"""A step the PyTorch manager deletes is listed whole or not at all.

Retention renames a dropped step into the trash (``.cocijax-deleted``) before it removes any
file, as the JAX manager does; the next deletion or opening empties the trash. Shown with a
real SIGKILL landing after the first file of a deletion, and with an I/O error injected there.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cocijax as cj
import cocijax.torch as cjt
from cocijax.torch import _directory
from cocijax.torch import _saving as _manager  # where retention calls remove()

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1000.0) + step}


def _open(directory: Path, **kwargs) -> cjt.CheckpointManager:
    return cjt.CheckpointManager(
        directory, policy=cj.policies.fixed(1), max_to_keep=1, use_async=False, **kwargs
    )


def _listed_whole(directory: Path) -> list[int]:
    """The steps a fresh manager lists, each restored to check its data is all there."""
    with _open(directory) as mngr:
        steps = mngr.all_steps()
        for step in steps:
            restored = mngr.restore(step, {"w": torch.zeros(1000)})
            assert torch.equal(restored["w"], _state(step)["w"]), step
    return steps


def _directories_of_step_1(directory: Path) -> list[Path]:
    """Step 1's directory, listed or in the trash (renamed ``1.<random>``)."""
    return [d for d in directory.rglob("1*") if d.is_dir() and d.name.split(".")[0] == "1"]


# The child saves step 1, then step 2, whose retention deletes step 1; the first file it
# removes is the last thing it does: it SIGKILLs itself right after.
_KILLED_MID_DELETION = textwrap.dedent(
    """
    import os, signal, sys, torch
    import cocijax as cj, cocijax.torch as cjt
    from cocijax.torch import _saving as _manager

    real_unlink, real_remove = os.unlink, _manager.remove
    deleting = False

    def unlink(*args, **kwargs):
        real_unlink(*args, **kwargs)
        if deleting:
            os.kill(os.getpid(), signal.SIGKILL)

    def remove(path):
        global deleting
        deleting = True
        real_remove(path)

    os.unlink, _manager.remove = unlink, remove
    mngr = cjt.CheckpointManager(
        sys.argv[1], policy=cj.policies.fixed(1), max_to_keep=1, use_async=False
    )
    for step in (1, 2):
        mngr.save(step, {"w": torch.arange(1000.0) + step}, loss=1.0, force=True)
    print("not killed")
    """
)


def test_a_deletion_killed_after_its_first_file_leaves_no_listed_step_without_data(tmp_path):
    ckpt = tmp_path / "ckpt"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_DELETION, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    # Killed in the middle: all of step 1's files but one are still on disk (in the trash).
    (left,) = _directories_of_step_1(ckpt)
    assert len(list(left.iterdir())) == len(list((ckpt / "2").iterdir())) - 1
    assert _listed_whole(ckpt) == [2]
    assert _directories_of_step_1(ckpt) == []  # the opening finished the deletion


def test_an_io_error_in_a_deletion_is_logged_and_the_step_is_not_listed(
    tmp_path, monkeypatch, caplog
):
    ckpt = tmp_path / "ckpt"
    real_unlink, failing = os.unlink, []

    def unlink(path, *args, **kwargs):
        if failing:  # the first file of the deletion cannot be removed
            failing.clear()
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        real_unlink(path, *args, **kwargs)

    def remove(path):
        failing.append(path)
        real_remove(path)

    real_remove = _manager.remove
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(_manager, "remove", remove)
    with caplog.at_level(logging.WARNING, logger=_directory.__name__), _open(ckpt) as mngr:
        for step in (1, 2):
            mngr.save(step, _state(step), loss=1.0, force=True)
        assert mngr.all_steps() == [2]
    monkeypatch.undo()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not remove" in m and "Input/output error" in m for m in warned), warned
    # What could not be removed waits in the trash, not as a listed step without its data.
    (left,) = (ckpt / _directory.TRASH_DIR).iterdir()
    assert left.name.startswith("1.")
    assert _listed_whole(ckpt) == [2]
    assert not left.exists()  # removed when the directory was opened again


def test_a_failed_rename_keeps_the_step_whole_and_says_so(tmp_path, monkeypatch, caplog):
    ckpt = tmp_path / "ckpt"
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if Path(src) == ckpt / "1":  # the deletion's rename
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), src)
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with caplog.at_level(logging.WARNING, logger=_directory.__name__), _open(ckpt) as mngr:
        for step in (1, 2):
            mngr.save(step, _state(step), loss=1.0, force=True)
    monkeypatch.undo()
    assert any(f"could not delete {ckpt / '1'}" in r.getMessage() for r in caplog.records)
    assert _listed_whole(ckpt) == [1, 2]  # whole, so retention drops it at the next save
