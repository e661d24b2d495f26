"""Opening a directory reads each step once, and needs no parse of manifests it can trust.

Issue 29.3: a restarting job pays the opening, and it grew with the steps kept (each manifest
parsed several times, Orbax's own listing reading every step's metrics). The manifest check of
a listing now verifies the digest over the raw bytes of a manifest written by this version;
a damaged or older one is parsed and refused as before.
"""

from __future__ import annotations

import collections
import datetime
import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax.storage import _manifest_io


def _state(i: int) -> dict:
    return {"w": np.full(8, float(i), np.float32), "b": np.arange(3, dtype=np.int32) + i}


def _open(directory, **kwargs) -> cj.CheckpointManager:
    return cj.CheckpointManager(
        directory, policy=cj.policies.fixed(10**6), exit_on_preemption=False, **kwargs
    )


def _write(directory, steps, **kwargs) -> None:
    with _open(directory, **kwargs) as mngr:
        for step in steps:
            mngr.save(step, _state(step), loss=1.0, force=True)


@pytest.fixture
def counted(monkeypatch):
    """Counts the manifest files read (by path) and the manifests parsed."""
    reads: collections.Counter = collections.Counter()
    parses: list[str] = []
    check, decode = _manifest_io.check_committed, _manifest_io.decode_manifest

    def counting_check(item_dir):
        reads[str(item_dir)] += 1
        return check(item_dir)

    def counting_decode(raw, source):
        parses.append(source)
        return decode(raw, source)

    monkeypatch.setattr(_manifest_io, "check_committed", counting_check)
    monkeypatch.setattr(_manifest_io, "decode_manifest", counting_decode)
    # The manager's own module imported the name: count its calls too.
    from cocijax.manager import _directory

    monkeypatch.setattr(_directory, "check_committed", counting_check)
    _manifest_io._PARSED.clear()  # a fresh process: nothing parsed yet
    return reads, parses


def test_opening_checks_each_step_once_and_parses_no_manifest(tmp_path, counted):
    directory = tmp_path / "run"
    _write(directory, [1, 2, 3, 4, 5])
    reads, parses = counted
    with _open(directory) as mngr:
        assert mngr.all_steps() == [1, 2, 3, 4, 5]
        assert parses == [], parses  # the digest over the bytes sufficed
        assert sorted(reads) == [str(directory / f"{s}" / "state") for s in (1, 2, 3, 4, 5)]
        assert max(reads.values()) == 1, reads
        restored = mngr.restore()
    np.testing.assert_array_equal(restored["b"], _state(5)["b"])
    assert parses == [str(directory / "5" / "state" / _manifest_io.MANIFEST_NAME)]


def test_a_changed_byte_is_parsed_and_refused(tmp_path, counted):
    directory = tmp_path / "run"
    _write(directory, [1, 2])
    path = directory / "2" / "state" / _manifest_io.MANIFEST_NAME
    raw = path.read_bytes()
    # Still valid JSON of the same shape: one digit of a leaf's shape changed.
    damaged = raw.replace(b'"shape":[8]', b'"shape":[9]', 1)
    assert damaged != raw
    path.write_bytes(damaged)
    _, parses = counted
    with _open(directory) as mngr:
        assert mngr.all_steps() == [1]  # step 2 is set aside, not listed
    assert str(path) in parses  # the fast check could not vouch for it: parsed, refused
    assert not (directory / "2").exists()
    assert any(p.name.startswith("2") for p in (directory / ".cocijax-quarantine").iterdir())


def test_a_manifest_written_otherwise_still_reads(tmp_path, counted):
    """A manifest in another layout (an older cocijax wrote its keys unsorted) is parsed."""
    directory = tmp_path / "run"
    _write(directory, [1])
    path = directory / "1" / "state" / _manifest_io.MANIFEST_NAME
    data = json.loads(path.read_bytes())
    path.write_bytes(json.dumps({"digest": data.pop("digest"), **data}).encode())
    _, parses = counted
    with _open(directory) as mngr:
        assert mngr.all_steps() == [1]
        assert str(path) in parses


def test_keep_time_interval_still_sees_commit_times(tmp_path):
    """Orbax opens without reading each step's metadata, except when its retention by time
    needs the commit times: the steps kept by time survive a reopening."""
    directory = tmp_path / "run"
    by_time = ocp.CheckpointManagerOptions(
        max_to_keep=1, keep_time_interval=datetime.timedelta(days=1)
    )
    reader = ocp.CheckpointManagerOptions(read_only=True)
    _write(directory, [1, 2, 3], options=by_time)
    assert cj.CheckpointManager(directory, options=reader).all_steps() == [1, 3]
    _write(directory, [4], options=by_time)
    assert cj.CheckpointManager(directory, options=reader).all_steps() == [1, 4]


def test_the_writer_opens_reading_only_the_newest_step(tmp_path, counted):
    """The writer reads the steps newest first down to the newest committed one; the older
    ones are read once, when every step is first needed (here ``all_steps``)."""
    directory = tmp_path / "run"
    _write(directory, [1, 2, 3, 4, 5])
    reads, _ = counted
    with _open(directory) as mngr:
        assert mngr.latest_step() == 5
        assert dict(reads) == {str(directory / "5" / "state"): 1}
        assert mngr.all_steps() == [1, 2, 3, 4, 5]
        assert sorted(reads) == [str(directory / f"{s}" / "state") for s in (1, 2, 3, 4, 5)]
        assert max(reads.values()) == 1, reads


def test_an_older_damaged_step_is_set_aside_before_the_first_save(tmp_path):
    """A step the opening left unread is checked before Orbax's retention counts the steps:
    a damaged one is set aside (not deleted, not counted by ``max_to_keep``)."""
    directory = tmp_path / "run"
    _write(directory, [1, 2, 3])
    (directory / "2" / "state" / _manifest_io.MANIFEST_NAME).write_bytes(b"{}")
    with _open(directory, max_to_keep=3) as mngr:
        assert (directory / "2").exists()  # not read yet
        mngr.save(4, _state(4), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 3, 4]  # max_to_keep counts the intact steps only
    quarantined = list((directory / ".cocijax-quarantine").iterdir())
    assert [p.name.split("-")[0] for p in quarantined] == ["2"], quarantined


def test_an_older_damaged_step_is_skipped_by_a_fallback_restore(tmp_path):
    directory = tmp_path / "run"
    _write(directory, [1, 2, 3])
    (directory / "3" / "state" / _manifest_io.MANIFEST_NAME).write_bytes(b"{}")
    (directory / "2" / "state" / _manifest_io.MANIFEST_NAME).write_bytes(b"{}")
    with _open(directory) as mngr:
        assert mngr.latest_step() == 1  # 3 and 2 were read: no committed step above 1
        np.testing.assert_array_equal(mngr.restore(fallback=True)["b"], _state(1)["b"])


def test_restoring_the_step_the_opening_adopted_reads_its_policy_state_once(tmp_path, monkeypatch):
    from cocijax.manager import _policy_item

    directory = tmp_path / "run"
    _write(directory, [1, 2])
    reads = []
    restore = _policy_item.PolicyStateHandler.restore

    def counting(self, directory, *args, **kwargs):
        reads.append(str(directory))
        return restore(self, directory, *args, **kwargs)

    monkeypatch.setattr(_policy_item.PolicyStateHandler, "restore", counting)
    with _open(directory) as mngr:
        mngr.restore()
        assert reads == [str(directory / "2" / "policy")]
        mngr.restore(1)  # another step: its own state
        assert reads[1:] == [str(directory / "1" / "policy")]
        mngr.restore()  # the newest again, after another one was adopted
        assert reads[2:] == [str(directory / "2" / "policy")]
