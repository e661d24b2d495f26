"""Set-ups a user can reach that destroyed committed steps or leaked disk (adversarial review).

Each case is one the review reproduced against the manager; each test failed before its fix.
The promise tested throughout: a committed step is never destroyed by anything but the
retention the user asked for, and what retention drops is collected.

* paths: a durable tier or a root that is (or is inside) the checkpoint directory; a symlink
  re-pointed to another run sharing a root; one directory under two spellings; a dangling link;
* arguments: ``max_to_keep=0``, ``keep_period`` 0 or negative, a step beyond int32;
* the file system: a new manifest in the same second as the one it replaced (ext4 with 128-byte
  inodes keeps 1-second timestamps), a manifest this version cannot interpret, a disk full for
  a moment, a failing extra item;
* corruption: the error says what to do; a fallback restore sets the damaged steps aside so
  that training goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax import storage
from cocijax.storage._records import MANIFEST_NAME, STRIPE_PREFIX
from cocijax.storage._stripes import referenced_stripe_dirs


def _state(step: int, n: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {f"w{i}": rng.standard_normal((64, 256)).astype(np.float32) for i in range(n)}


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _assert_bit_equal(a: Any, b: Any) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _manager(directory: Path, **kwargs: Any) -> cj.CheckpointManager:
    return cj.CheckpointManager(directory, policy=cj.policies.fixed(10**6), **kwargs)


def _stripes(root: Path) -> set[str]:
    return {p.name for p in root.rglob(f"{STRIPE_PREFIX}*") if p.is_dir()}


def _referenced(mngr: cj.CheckpointManager) -> set[str]:
    return {
        p.name
        for step in mngr.all_steps()
        for p in referenced_stripe_dirs(mngr.item_directory(step))
    }


# -- paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "match"),
    [
        (lambda d, r: {"durable": str(d)}, "overlaps the checkpoint directory"),
        (lambda d, r: {"durable": str(d / "dur")}, "overlaps the checkpoint directory"),
        (lambda d, r: {"durable": str(d.parent)}, "overlaps the checkpoint directory"),
        (lambda d, r: {"roots": [d / "r0"]}, "lies inside the checkpoint directory"),
        (lambda d, r: {"roots": [r], "durable": str(r)}, "overlaps roots"),
        (lambda d, r: {"roots": [r], "durable": str(r / "dur")}, "overlaps roots"),
    ],
    ids=[
        "durable-is-dir",
        "durable-inside",
        "durable-holds-dir",
        "root-inside",
        "durable-is-root",
        "durable-in-root",
    ],
)
def test_locations_that_would_lose_data_are_refused_before_anything_is_written(
    tmp_path, where, match
):
    # Before: durable=directory was accepted; each drain took the committed local step for a
    # cut drain and deleted it (three saves returned True, all_steps() was [] after). A root
    # inside the directory worked once, then no opening ever worked again.
    directory = tmp_path / "run" / "ck"
    with pytest.raises(ValueError, match=match):
        _manager(directory, **where(directory, tmp_path / "root"))
    assert not directory.exists()


def test_the_directory_itself_may_be_a_root(tmp_path):
    with _manager(tmp_path / "ck", roots=[tmp_path / "ck"]) as mngr:
        mngr.save(1, _state(1), loss=1.0, force=True)
    with _manager(tmp_path / "ck", roots=[tmp_path / "ck"]) as mngr:
        _assert_bit_equal(mngr.restore(1, target=_abstract(_state(1))), _state(1))


def test_a_symlink_re_pointed_to_another_run_never_collects_the_first_run_s_stripes(tmp_path):
    # Before: the stripe folder on a root was named by the directory's path as given, so
    # runA and runB, both opened as `current`, shared it; opening runB collected runA's
    # stripes, and runA's listed step 2 raised CorruptCheckpointError.
    root = tmp_path / "shared-root"
    current = tmp_path / "current"
    (tmp_path / "runA").mkdir()
    (tmp_path / "runB").mkdir()
    current.symlink_to(tmp_path / "runA")
    with _manager(current, roots=[root]) as mngr:
        for step in (1, 2):
            mngr.save(step, _state(step), loss=1.0, force=True)
    current.unlink()
    current.symlink_to(tmp_path / "runB")
    with _manager(current, roots=[root], max_to_keep=1) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, _state(10 + step), loss=1.0, force=True)
    with _manager(tmp_path / "runA", roots=[root]) as mngr:
        assert mngr.all_steps() == [1, 2]
        for step in (1, 2):
            _assert_bit_equal(mngr.restore(step, target=_abstract(_state(step))), _state(step))


def test_one_directory_under_two_spellings_collects_its_own_stripes(tmp_path):
    # Before: opened through a symlink and as x/../run, it wrote two stripe folders, and
    # neither opening collected the other's stripes: they leaked.
    root = tmp_path / "root"
    (tmp_path / "x").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    spellings = [link, tmp_path / "x" / ".." / "run", run]
    step = 0
    for spelling in spellings:
        with _manager(spelling, roots=[root], max_to_keep=1) as mngr:
            for _ in range(2):
                step += 1
                mngr.save(step, _state(step), loss=1.0, force=True)
    with _manager(run, roots=[root], max_to_keep=1) as mngr:
        mngr.wait_until_finished()
        assert mngr.all_steps() == [step]
        assert _stripes(root) == _referenced(mngr)  # one stripe folder's worth, nothing leaked
        assert len([p for p in root.iterdir() if p.name.startswith(".cocijax-")]) == 1


def test_a_copy_of_a_directory_takes_its_own_identity(tmp_path):
    # A directory copied with `cp -r` (its stripes on a shared root not copied) must never
    # collect the stripes its original writes after the copy, nor the reverse.
    root = tmp_path / "root"
    with _manager(tmp_path / "orig", roots=[root]) as mngr:
        mngr.save(1, _state(1), loss=1.0, force=True)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy", symlinks=True)
    with _manager(tmp_path / "orig", roots=[root], max_to_keep=1) as mngr:
        mngr.save(2, _state(2), loss=1.0, force=True)
    with _manager(tmp_path / "copy", roots=[root], max_to_keep=1) as mngr:  # takes a new one
        mngr.save(2, _state(22), loss=1.0, force=True)
        mngr.save(3, _state(3), loss=1.0, force=True)
    with _manager(tmp_path / "orig", roots=[root]) as mngr:
        _assert_bit_equal(mngr.restore(2, target=_abstract(_state(2))), _state(2))
    with _manager(tmp_path / "copy", roots=[root]) as mngr:
        _assert_bit_equal(mngr.restore(3, target=_abstract(_state(3))), _state(3))


def test_a_copy_is_told_apart_after_its_original_was_opened_without_its_roots(tmp_path):
    # Every writer's opening bumped the directory's epoch, with roots or without: an original
    # opened once without its roots caught up with the epoch its copy had written on the
    # roots, took the copy's identity at its next opening with them, and collected the
    # stripes of the copy's step 2.
    root = tmp_path / "root"
    with _manager(tmp_path / "orig", roots=[root]) as mngr:
        mngr.save(1, _state(1), loss=1.0, force=True)
    shutil.copytree(tmp_path / "orig", tmp_path / "copy", symlinks=True)
    with _manager(tmp_path / "copy", roots=[root]) as mngr:
        mngr.save(2, _state(22), loss=1.0, force=True)
    _manager(tmp_path / "orig").close()
    with _manager(tmp_path / "orig", roots=[root], max_to_keep=1) as mngr:
        mngr.save(2, _state(2), loss=1.0, force=True)
        mngr.save(3, _state(3), loss=1.0, force=True)
    with _manager(tmp_path / "copy", roots=[root]) as mngr:
        _assert_bit_equal(mngr.restore(2, target=_abstract(_state(22))), _state(22))


def test_a_dangling_symlink_as_directory_is_named(tmp_path):
    link = tmp_path / "ck"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match=r"symbolic link to .*gone.*does not exist"):
        _manager(link)


# -- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_to_keep": 0}, "max_to_keep: expected an int >= 1 or None, got 0"),
        ({"max_to_keep": -1}, "max_to_keep: expected an int >= 1"),
        ({"keep_period": 0}, "keep_period: expected an int >= 1 or None, got 0"),
        ({"keep_period": -2}, "keep_period: expected an int >= 1"),
        ({"options": ocp.CheckpointManagerOptions(max_to_keep=0)}, "max_to_keep"),
    ],
    ids=["max_to_keep-0", "max_to_keep-neg", "keep_period-0", "keep_period-neg", "options"],
)
def test_retention_that_would_delete_every_step_is_refused_at_construction(tmp_path, kwargs, match):
    # Before: max_to_keep=0 deleted every committed step, the preemption save included;
    # keep_period=0 failed only at the first save, from Orbax's thread.
    with pytest.raises(ValueError, match=match):
        _manager(tmp_path / "ck", **kwargs)
    assert not (tmp_path / "ck").exists()


def test_a_step_beyond_int32_is_named(tmp_path):
    with _manager(tmp_path / "ck") as mngr:
        with pytest.raises(ValueError, match=r"step: must be at most 2147483647"):
            mngr.save(2**31, _state(1), loss=1.0, force=True)
        assert mngr.save(2**31 - 1, _state(1), loss=1.0, force=True)


# -- the file system ---------------------------------------------------------------------


@pytest.fixture
def coarse_ext4(tmp_path: Path) -> Iterator[Path]:
    """An ext4 file system with 128-byte inodes (1-second timestamps), loop-mounted."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("a loop-mounted ext4 needs root and mkfs.ext4 (e2fsprogs)")
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    mnt.mkdir()
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], capture_output=True, text=True
    )
    mounted = (
        made.returncode == 0
        and (
            subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True)
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip(f"cannot make and loop-mount an ext4 here: {made.stderr.strip()}")
    try:
        probe = mnt / "probe"
        probe.write_bytes(b"x")
        assert probe.stat().st_mtime_ns % 1_000_000_000 == 0, "not a 1-second file system"
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.xdist_group("reliability-mounts")
def test_a_manifest_rewritten_within_a_second_is_read_afresh(coarse_ext4):
    # Before: which stripes a manifest references was cached by (path, mtime, size). On a
    # 1-second file system, save(2), delete(2), restore() of 1 and save(2) again, within one
    # second, gave the new manifest the old one's key: GC deleted the new step 2's stripes.
    directory, root = coarse_ext4 / "ck", coarse_ext4 / "root"
    with _manager(directory, roots=[root]) as mngr:
        mngr.save(1, _state(1), loss=1.0, force=True)
        mngr.save(2, _state(2), loss=1.0, force=True)
        mngr.wait_until_finished()  # collects garbage: reads step 2's manifest
        manifest = mngr.item_directory(2) / MANIFEST_NAME
        first = manifest.stat()
        for _ in range(20):  # a manifest of the same size (its digest's digits vary)
            mngr.delete(2)
            mngr.restore(1, target=_abstract(_state(1)))
            mngr.save(2, _state(2), loss=1.0, force=True)  # the same tree
            mngr.wait_until_finished()
            second = manifest.stat()
            if second.st_size == first.st_size:
                break
        assert second.st_size == first.st_size
        # Within the same second here, or made so (what a slower machine would see).
        os.utime(manifest, ns=(second.st_atime_ns, first.st_mtime_ns))
        mngr.save(3, _state(3), loss=1.0, force=True)
        mngr.wait_until_finished()  # collects garbage again
        _assert_bit_equal(mngr.restore(2, target=_abstract(_state(2))), _state(2))
        assert storage.verify(mngr.item_directory(2)) == []


@pytest.mark.xdist_group("reliability-mounts")
@pytest.mark.parametrize("roots", [False, True], ids=["in-step-dirs", "on-a-root"])
def test_a_disk_full_for_a_moment_costs_one_save(small_tmpfs, tmp_path, roots):
    # Before: the failed save's <step>.orbax-checkpoint-tmp stayed until a reopen (1.8 MiB of
    # the 8 MiB tmpfs), and every later save failed for want of room.
    directory = small_tmpfs / "ck"
    kwargs = {"roots": [small_tmpfs / "root"]} if roots else {}
    with _manager(directory, max_to_keep=1, **kwargs) as mngr:
        for step in (1, 2):
            mngr.save(step, _state(step, n=8), loss=1.0, force=True)
        mngr.wait_until_finished()
        ballast = small_tmpfs / "ballast"
        free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
        ballast.write_bytes(b"\0" * (free - (256 << 10)))  # room for an eighth of a save
        with pytest.raises(OSError):
            mngr.save(3, _state(3, n=8), loss=1.0, force=True)
            mngr.wait_until_finished()
        ballast.unlink()  # the operator frees space
        assert mngr.save(4, _state(4, n=8), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4]
        _assert_bit_equal(mngr.restore(4, target=_abstract(_state(4, n=8))), _state(4, n=8))
        assert not [p for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]


def test_a_failing_extra_item_does_not_leak_a_copy_of_the_state(tmp_path):
    # Before: with the data in the step directories, each failed save left its temporary
    # directory (a whole copy of the state) until the next opening.
    directory = tmp_path / "ck"
    with _manager(directory, max_to_keep=1) as mngr:
        for step in range(1, 9):
            bad = step % 2 == 0
            extra = {"config": ocp.args.JsonSave({"x": object()} if bad else {"x": step})}
            try:
                mngr.save(step, _state(step), loss=1.0, force=True, extra=extra)
                mngr.wait_until_finished()
            except (TypeError, ValueError):
                assert bad
        mngr.wait_until_finished()
        assert mngr.all_steps() == [7]
        leftovers = [p for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]
        assert leftovers == []


# -- corruption ----------------------------------------------------------------------------


def _damage_a_piece(mngr: cj.CheckpointManager, step: int) -> None:
    manifest = storage.read_manifest(mngr.item_directory(step))
    piece = manifest.piece_path(manifest.pieces[0], mngr.item_directory(step))
    for f in Path(piece).rglob("*"):
        if f.is_file() and f.name != "zarr.json":
            f.write_bytes(b"\xff" * f.stat().st_size)


def test_a_corrupt_step_s_error_says_what_to_do_and_a_fallback_lets_training_go_on(tmp_path):
    directory = tmp_path / "ck"
    with _manager(directory, roots=[tmp_path / "root"]) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, _state(step), loss=1.0, force=True)
        mngr.wait_until_finished()
        _damage_a_piece(mngr, 2)
        _damage_a_piece(mngr, 3)
    with _manager(directory, roots=[tmp_path / "root"]) as mngr:
        with pytest.raises(storage.CorruptCheckpointError) as raised:
            mngr.restore(target=_abstract(_state(3)))
        # Before: the traceback began with "RuntimeError: no running event loop", and the
        # error did not say what to do.
        assert raised.value.__context__ is None or not isinstance(
            raised.value.__context__, RuntimeError
        )
        notes = " ".join(getattr(raised.value, "__notes__", []))
        assert "fallback=True" in notes and "cocijax verify" in notes
        with pytest.warns(RuntimeWarning, match="skipping damaged step"):
            restored = mngr.restore(target=_abstract(_state(3)), fallback=True)
        assert mngr.restored_step == 1
        _assert_bit_equal(restored, _state(1))
        # Before: the next save failed ("not after the latest saved step 3") until the user
        # deleted the damaged steps by hand. They are set aside, kept for inspection.
        assert mngr.all_steps() == [1]
        assert mngr.save(2, _state(22), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        aside = sorted(p.name.split("-")[0] for p in (directory / ".cocijax-quarantine").iterdir())
        assert aside == ["2", "3"]


def test_orbax_metadata_of_the_wrong_type_is_damage_not_a_failed_open(tmp_path):
    # Before: `"commit_timestamp_nsecs": "x"` (or `[]` as the whole file) in one step's
    # _CHECKPOINT_METADATA made the manager fail to open, naming no file.
    directory = tmp_path / "ck"
    with _manager(directory) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, _state(step), loss=1.0, force=True)
    (directory / "3" / "_CHECKPOINT_METADATA").write_text("[]")
    meta = directory / "2" / "_CHECKPOINT_METADATA"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "commit_timestamp_nsecs": "x"}))
    with _manager(directory) as mngr:
        assert mngr.all_steps() == [1]
        _assert_bit_equal(mngr.restore(target=_abstract(_state(1))), _state(1))
        assert mngr.save(2, _state(2), loss=1.0, force=True)
