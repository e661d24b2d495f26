"""An I/O error at opening is not damage (issue 27 item 3: hunted set-ups).

A writer sets damaged steps aside when it opens, and keeps only the newest two of them: an
I/O error reading the manifests (a storage hiccup: EIO, EACCES on a network file system) set
every step aside, the next save deleted all but two, and the job started from scratch.
"""

from __future__ import annotations

import errno
import pathlib

import numpy as np
import pytest

import cocijax as cj
from cocijax.storage._records import MANIFEST_NAME


def test_an_io_error_at_opening_is_raised_and_sets_no_step_aside(tmp_path, monkeypatch):
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"w": np.full(2, step)}, loss=1.0)
    read_bytes = pathlib.Path.read_bytes

    def failing(path: pathlib.Path) -> bytes:
        if path.name == MANIFEST_NAME:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return read_bytes(path)

    with monkeypatch.context() as patch:
        patch.setattr(pathlib.Path, "read_bytes", failing)
        # Read newest first (the opening stops at the newest committed step): step 3 is named.
        with pytest.raises(OSError, match=r"step .*3 cannot be read .*Input/output error") as e:
            cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1))
    assert e.value.errno == errno.EIO
    assert not (tmp_path / ".cocijax-quarantine").exists()
    with cj.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        assert mngr.all_steps() == [1, 2, 3]
        mngr.save(4, {"w": np.full(2, 4)}, loss=1.0)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2, 3, 4]
