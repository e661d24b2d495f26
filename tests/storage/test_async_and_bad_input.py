"""Only the host snapshot happens in ``async_save``; the rest waits for Orbax. Bad inputs."""

import asyncio
import concurrent.futures
import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.futures import future, synchronization

import cocijax as cj
from cocijax.storage._stripes import find_stripe_dirs

CREATED = synchronization.HandlerAwaitableSignal.STEP_DIRECTORY_CREATION


def test_async_save_snapshots_then_commit_waits_for_the_directory_signal(tmp_path, roots):
    """Structural: before Orbax signals the item directory, only piece files on the external
    roots are written (chunk files and their zarr.json; no manifest), and the data the commit
    writes is the snapshot taken inside async_save, not the live arrays."""
    # chunk_bytes below the host leaf's size: its chunk writes may start inside async_save.
    handler = cj.StripedCheckpointHandler(
        roots, small_bytes=1024, chunk_bytes=4096, write_while_copying=True
    )
    source = np.arange(4096, dtype=np.float32)
    device = jnp.arange(8, dtype=jnp.int32)
    item = tmp_path / "not_created_yet"
    snapshots = []
    take = handler._snapshot
    handler._snapshot = lambda *a: snapshots.append(take(*a)) or snapshots[-1]
    synchronization.OperationIdGenerator.next_operation_id()
    op = synchronization.OperationIdGenerator.get_current_operation_id()
    future.AwaitableSignalsContract.add_to_awaitable_signals_contract([CREATED])
    try:
        futures = asyncio.run(
            handler.async_save(item, cj.StripedSave({"host": source, "dev": device}))
        )
        assert len(futures) == 1
        # The commit is parked on the signal; the host leaf's direct chunk writes started
        # inside async_save: once they are done, they are all that is on the roots.
        (snapshot,) = snapshots
        assert snapshot.early  # the host leaf's pieces (its 16 KiB over the two roots)
        concurrent.futures.wait([f for fs in snapshot.early.values() for f in fs], timeout=60)
        early = [f.relative_to(r).parts for r in roots for f in r.rglob("*") if f.is_file()]
        # <stripe>/<piece>/c.<chunk key>, 4 KiB each, and <stripe>/<piece>/zarr.json
        kinds = sorted("c." if parts[2].startswith("c.") else parts[2] for parts in early)
        assert kinds == ["c."] * 4 + ["zarr.json"] * len(snapshot.early), early
        assert {parts[1] for parts in early} == set(snapshot.early)
        assert not item.exists()
        source[:] = -1  # The caller may reuse its buffers as soon as async_save returns.
        item.mkdir()
        future.set_signals([CREATED], operation_id=op)
        futures[0].result(timeout=60)
    finally:
        future.AwaitableSignalsContract.remove_all_awaitable_signals(op)
    assert any(find_stripe_dirs(r) for r in roots)
    handler.finalize(item)
    got = handler.restore(item, cj.StripedRestore())
    np.testing.assert_array_equal(got["host"], np.arange(4096, dtype=np.float32))
    np.testing.assert_array_equal(got["dev"], np.arange(8))


@pytest.mark.parametrize("overlap", [False, True])
def test_pieces_start_writing_inside_save_only_with_write_while_copying(tmp_path, roots, overlap):
    handler = cj.StripedCheckpointHandler(
        roots, small_bytes=1024, chunk_bytes=4096, write_while_copying=overlap
    )
    tree = {"host": np.arange(4096, dtype=np.float32)}
    snapshot = handler._snapshot(tree, handler._writer())
    for started in snapshot.early.values():
        concurrent.futures.wait(started)
    written = [f for r in roots for f in r.rglob("*") if f.is_file()]
    assert bool(snapshot.early) == overlap
    assert bool(written) == overlap
    handler.close()


@pytest.mark.parametrize("error", [ValueError, TypeError, cj.storage.UnsupportedLeafError])
def test_unsupported_leaf_is_one_error_type_naming_its_path(tmp_path, error):
    # One documented type that is both: ValueError as Orbax raises, TypeError as cocijax did.
    handler = cj.StripedCheckpointHandler()
    with (
        ocp.Checkpointer(handler) as ckptr,
        pytest.raises(error, match=r"Unsupported type object for leaf \['opt'\]\['name'\]"),
    ):
        ckptr.save(tmp_path / "a", args=cj.StripedSave({"opt": {"name": object()}}))
    with (
        ocp.Checkpointer(handler) as ckptr,
        pytest.raises(error, match=r"Unsupported dtype object for leaf \['x'\]"),
    ):
        ckptr.save(tmp_path / "b", args=cj.StripedSave({"x": np.array([None])}))


def test_restore_mismatch_is_a_value_error_naming_the_leaf(tmp_path):
    handler = cj.StripedCheckpointHandler()
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "c", args=cj.StripedSave({"w": np.zeros((3, 4), np.float32)}))
        for bad in (np.zeros((4, 3), np.float32), np.zeros((3, 4), np.float64)):
            with pytest.raises(ValueError, match=r"\['w'\].*\(3, 4\) dtype float32"):
                ckptr.restore(tmp_path / "c", args=cj.StripedRestore({"w": bad}))
        expected = r"not in the target: \['w'\]; in the target but not saved: \['v'\]"
        with pytest.raises(ValueError, match=expected):
            ckptr.restore(tmp_path / "c", args=cj.StripedRestore({"v": np.zeros((3, 4))}))


def test_duplicate_roots_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"roots\[1\].*same directory as roots\[0\]"):
        cj.StripedCheckpointHandler([tmp_path / "r", tmp_path / "x" / ".." / "r"])


def test_single_path_instead_of_a_list_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="sequence"):
        cj.StripedCheckpointHandler(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_root_fails_at_construction_permissions(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=r"roots\[0\].*cannot be written"):
        cj.StripedCheckpointHandler([locked])


def test_unwritable_root_fails_at_construction(tmp_path):
    # A regular file where a directory is expected cannot be written even by root.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"roots\[1\].*cannot be written"):
        cj.StripedCheckpointHandler([tmp_path / "ok", blocker / "sub"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"compression": "gzip"}, "compression"), ({"piece_bytes": 0}, "piece_bytes")],
)
def test_bad_options(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cj.StripedCheckpointHandler([tmp_path], **kwargs)


def test_typestr_is_stable():
    assert cj.StripedCheckpointHandler.typestr() == "cocijax.storage.StripedCheckpointHandler"
