"""Two tiers: local commits drained in the background to a durable tier (a real S3 server, moto,
on 127.0.0.1; or a plain path), listed, restored and collected on both tiers."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax import storage
from cocijax.manager import DurableTierError
from cocijax.storage._records import MANIFEST_NAME


def _state(seed: int, n: int = 256 * 1024) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((n // 256, 256), dtype=np.float32)),
        "b": rng.integers(0, 1 << 40, 9, dtype=np.int64),
        "step": seed,
    }


def _same(a: dict, b: dict) -> bool:
    return (
        np.array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
        and np.array_equal(np.asarray(a["b"]), np.asarray(b["b"]))
        and a["step"] == b["step"]
    )


@pytest.fixture(params=["s3", "gs", "path"])
def durable(request, tmp_path):
    """``(durable, durable_options, S3 bucket or None)``: an S3 prefix on moto, a GCS prefix on
    the GCS emulator, or a plain path."""
    if request.param == "path":
        return str(tmp_path / "durable"), None, None
    if request.param == "gs":
        return request.getfixturevalue("gcs").url("run42"), None, None
    s3 = request.getfixturevalue("s3")
    return s3.url("run42"), s3.options, s3


def _manager(tmp_path, durable, **kwargs):
    where, options, _ = durable
    kwargs.setdefault("roots", [tmp_path / "nvme0", tmp_path / "nvme1"])
    kwargs.setdefault("policy", cj.policies.fixed(1))
    return cj.CheckpointManager(
        tmp_path / "ckpt",
        durable=where,
        durable_options=options,
        **kwargs,
    )


def test_every_item_is_drained_and_restores_bit_exact_from_either_tier(tmp_path, durable):
    where, options, s3 = durable
    with _manager(tmp_path, durable) as mngr:
        for step in (1, 2):
            mngr.save(
                step,
                _state(step),
                loss=1.0,
                extra={"config": ocp.args.JsonSave({"lr": step})},
                metrics={"acc": step / 10},
            )
            mngr.wait_until_finished(durable=True)
        assert mngr.durable_steps() == [1, 2]
        assert mngr.all_steps() == [1, 2]
        assert math.isfinite(mngr.measurements.drain_s) and mngr.measurements.drain_s > 0
        # The durable copy is a self-contained item that verify reads where it is.
        assert storage.verify(f"{where}/2/state", root_options=options) == []
        assert storage.read_manifest(f"{where}/2/state", root_options=options).roots == (None,)
        for tier in ("local", "durable"):
            state, extra = mngr.restore(tier=tier, extra={"config": ocp.args.JsonRestore()})
            assert mngr.restored_step == 2
            assert _same(state, _state(2)) and extra == {"config": {"lr": 2}}
        state = mngr.restore(1, tier="durable")
        assert _same(state, _state(1))
    if s3 is not None:
        keys = s3.keys("run42/")
        assert "run42/2/state/cocijax_manifest.json" in keys
        assert "run42/2/metrics/metrics" in keys and "run42/2/policy/policy_state.json" in keys
        assert all(k.split("/")[1] in ("1", "2") for k in keys)


def test_a_new_machine_lists_the_durable_steps_and_restores_the_newest_bit_exact(tmp_path, durable):
    with _manager(tmp_path, durable) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, _state(step), loss=1.0)
            mngr.wait_until_finished(durable=True)
    # The local tier is lost: the directory and both roots.
    for name in ("ckpt", "nvme0", "nvme1"):
        shutil.rmtree(tmp_path / name)
    with _manager(tmp_path, durable) as mngr:
        assert mngr.all_steps() == [1, 2, 3] and mngr.latest_step() == 3
        assert mngr._local_steps() == []
        assert _same(mngr.restore(), _state(3)) and mngr.restored_step == 3
        # Partial restore reads only what the target asks for, from the durable tier.
        part = mngr.restore(target={"b": np.empty(9, np.int64)}, partial=True)
        np.testing.assert_array_equal(part["b"], _state(3)["b"])
        # Training continues after the durable steps only, and the next step reaches both tiers.
        with pytest.raises(ValueError, match="not after the latest saved step 3"):
            mngr.save(3, _state(3), loss=1.0)
        mngr.save(4, _state(4), loss=1.0)
        mngr.wait_until_finished(durable=True)
        assert mngr.durable_steps() == [1, 2, 3, 4]
        assert _same(mngr.restore(4, tier="local"), _state(4))


def test_while_a_drain_runs_only_the_newest_committed_step_is_drained_next(tmp_path, s3):
    durable = (s3.url("run"), s3.options, s3)
    saved = list(range(1, 9))
    # 16 MiB a step: a drain to moto takes several local commits' time.
    with _manager(tmp_path, durable, max_to_keep=1) as mngr:
        for step in saved:
            mngr.save(step, _state(step, n=4 << 20), loss=1.0)
        mngr.wait_until_finished(durable=True)
        drained = mngr.durable_steps()
        skipped = list(mngr._durable.skipped)
        local = mngr._local_steps()
    assert drained[-1] == saved[-1]  # the newest step always reaches the durable tier
    assert skipped, "no step was skipped: the drains kept up with the saves"
    assert sorted(drained + skipped) == saved  # each committed step: drained or skipped
    # max_to_keep=1, plus at most the two pinned steps (being drained, waiting) at the last save
    assert local[-1] == saved[-1] and len(local) <= 3


def test_best_n_retention_deletes_a_step_locally_only_after_its_drain(tmp_path, s3):
    durable = (s3.url("run"), s3.options, s3)
    saved = list(range(1, 7))
    n = 4 << 20  # 16 MiB a step: best-N wants each new step gone while its drain still runs
    best = {"best_fn": lambda m: m["acc"], "max_to_keep": 1, "keep_latest": 0}
    with _manager(tmp_path, durable, **best) as mngr:
        for step in saved:
            mngr.save(step, _state(step, n=n), loss=1.0, metrics={"acc": 1 / step})
        mngr.wait_until_finished(durable=True)  # a drain whose local copy went would raise
        drained = mngr.durable_steps()
        skipped = list(mngr._durable.skipped)
        assert mngr._local_steps() == [1]  # the best; the others left once drained or skipped
        assert drained[-1] == saved[-1] and sorted(drained + skipped) == saved
        assert _same(mngr.restore(), _state(saved[-1], n=n))  # only on the durable tier now
        assert mngr.restored_step == saved[-1]


def test_a_preemption_save_is_drained_whatever_durable_every(tmp_path, s3):
    durable = (s3.url("run"), s3.options, s3)
    policy = cj.policies.fixed(10**6)
    with _manager(
        tmp_path, durable, policy=policy, durable_every=100, exit_on_preemption=False
    ) as mngr:
        assert mngr.save(1, _state(1), loss=1.0, force=True)  # the 1st of 100: not drained
        os.kill(os.getpid(), signal.SIGTERM)
        assert mngr.save(2, _state(2), loss=1.0) and mngr.reached_preemption
    # close() returned after the preemption save's drain.
    assert f"run/2/state/{MANIFEST_NAME}" in s3.keys("run/2/")
    assert not s3.keys("run/1/")
    for name in ("ckpt", "nvme0", "nvme1"):
        shutil.rmtree(tmp_path / name)
    with _manager(tmp_path, durable) as mngr:
        assert mngr.all_steps() == [2] and _same(mngr.restore(), _state(2))


def test_fallback_skips_a_damaged_copy_on_either_tier(tmp_path, s3):
    durable = (s3.url("run"), s3.options, s3)
    with _manager(tmp_path, durable) as mngr:
        for step in (1, 2):
            mngr.save(step, _state(step), loss=1.0)
            mngr.wait_until_finished(durable=True)
        # Damage the local copy of step 2: one byte of a chunk file.
        manifest = storage.read_manifest(mngr.item_directory(2))
        piece = next(p for p in manifest.pieces if manifest.leaves[p.leaf].path == "['w']")
        array_dir = manifest.piece_path(piece, mngr.item_directory(2))
        chunk = next(f for f in array_dir.iterdir() if f.name != "zarr.json")
        data = bytearray(chunk.read_bytes())
        data[100] ^= 0xFF
        chunk.write_bytes(bytes(data))
        with pytest.raises(storage.CorruptCheckpointError, match="checksum"):
            mngr.restore()
        with pytest.warns(RuntimeWarning, match="step 2 \\(local copy\\)"):
            state = mngr.restore(fallback=True)
        assert mngr.restored_step == 2 and _same(state, _state(2))  # the durable copy
        # Damage the durable copy of step 2 too: the next intact copy is step 1's.
        key = next(k for k in s3.keys("run/2/state/") if f"{piece.file}/c." in k)
        body = bytearray(s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read())
        body[100] ^= 0xFF
        s3.client.put_object(Bucket=s3.name, Key=key, Body=bytes(body))
        with pytest.warns(RuntimeWarning, match="step 2 \\(durable copy\\)"):
            state = mngr.restore(tier="durable", fallback=True)
        assert mngr.restored_step == 1 and _same(state, _state(1))
        problems = storage.verify(s3.url("run/2/state"), root_options=s3.options)
        piece_url = s3.url(key.rsplit("/c.", 1)[0])  # the damaged piece's zarr array
        assert len(problems) == 1 and problems[0].file == piece_url


def test_garbage_collection_on_both_tiers_keeps_the_newest_durable_step(tmp_path, s3):
    durable = (s3.url("run"), s3.options, s3)
    with _manager(tmp_path, durable, max_to_keep=1, durable_max_to_keep=2) as mngr:
        for step in (1, 2, 3, 4):
            mngr.save(step, _state(step), loss=1.0)
            mngr.wait_until_finished(durable=True)
        assert mngr.durable_steps() == [3, 4]
        mngr.save(5, _state(5), loss=1.0)
        mngr.wait_until_finished(durable=True)
        assert mngr._local_steps() == [5]
        assert mngr.durable_steps() == [4, 5]
        # Besides the steps, only the lease of this writer, while it is open.
        assert {k.split("/")[1] for k in s3.keys("run/")} == {"4", "5", "cocijax_lease.json"}
        mngr.delete(5)  # an explicit delete removes the step from both tiers
        assert mngr.all_steps() == [4] and mngr.durable_steps() == [4]


def test_a_durable_server_that_goes_down_leaves_training_and_local_saves_alone(
    tmp_path, s3, s3_proxy, caplog
):
    with (
        caplog.at_level(logging.WARNING, logger="cocijax"),
        cj.CheckpointManager(
            tmp_path / "ckpt",
            policy=cj.policies.fixed(1),
            durable=s3.url("run"),
            durable_options=s3.options_via(s3_proxy.endpoint),
            store_timeout_s=5,
        ) as mngr,
    ):
        mngr.save(1, _state(1), loss=1.0)
        mngr.wait_until_finished(durable=True)
        s3_proxy.down()
        for step in (2, 3):
            mngr.save(step, _state(step), loss=1.0)
            mngr.wait_until_finished()  # local commits are not held up
            assert mngr._local_steps()[-1] == step
        mngr.delete(2)  # waits for the drains too, but leaves their errors to be raised
        with pytest.raises(DurableTierError, match=r"step \d to s3://") as caught:
            mngr.wait_until_finished(durable=True)
        assert mngr.durable_steps() == [1]  # the last listing: unknown is not empty
        assert _same(mngr.restore(), _state(3))
        s3_proxy.up()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    drained = [m for m in errors if m.startswith("drain of step")]
    steps = [m.split()[3] for m in drained]
    assert len(steps) == len(set(steps)) >= 1  # once per step, with the URL
    assert all(s3.url("run") in m for m in drained)
    assert s3.url("run") in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"durable_every": 0}, ValueError, "durable_every: must be >= 1"),
        ({"durable_every": 1.5}, TypeError, "durable_every: expected an int"),
        ({"durable_max_to_keep": 0}, ValueError, "durable_max_to_keep: must be >= 1"),
        ({"durable": 123}, TypeError, "durable: expected a path or an object-store URL"),
        ({"durable": "ftp://host/x"}, ValueError, "unsupported URL scheme 'ftp'"),
        ({"durable": "s3://"}, ValueError, "no bucket"),
        (
            {"durable": "s3://bucket/run", "durable_options": {"region": "x"}},
            ValueError,
            "TensorStore calls it 'aws_region'",
        ),
        (
            {"durable": "s3://bucket/run", "durable_options": {"retries": 3}},
            ValueError,
            "TensorStore refuses the kvstore spec",
        ),
        ({"durable_options": {"endpoint": "http://x"}}, ValueError, "without durable="),
    ],
    ids=[
        "every-0",
        "every-float",
        "keep-0",
        "not-a-path",
        "ftp",
        "no-bucket",
        "region",
        "unknown-option",
        "options-alone",
    ],
)
def test_bad_durable_arguments_are_named(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        cj.CheckpointManager(tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt" / ".cocijax-running").exists()


def test_bad_tier_in_restore_is_named(tmp_path):
    with cj.CheckpointManager(tmp_path / "ckpt", policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, _state(1), loss=1.0)
        with pytest.raises(ValueError, match="tier must be None, 'memory', 'local' or 'durable'"):
            mngr.restore(tier="cloud")
        with pytest.raises(ValueError, match="no durable tier"):
            mngr.restore(tier="durable")
        assert mngr.durable_steps() == []


def test_durable_every_drains_every_kth_saved_step(tmp_path):
    durable = (str(tmp_path / "durable"), None, None)
    with _manager(tmp_path, durable, durable_every=2) as mngr:
        for step in range(1, 6):
            mngr.save(step, _state(step), loss=1.0)
            mngr.wait_until_finished(durable=True)
        assert mngr.durable_steps() == [2, 4]
        assert mngr.all_steps() == [1, 2, 3, 4, 5]
    # The next open drains the newest local step the durable tier lacks (5), whatever the count.
    with _manager(tmp_path, durable, durable_every=2) as mngr:
        mngr.wait_until_finished(durable=True)
        assert mngr.durable_steps() == [2, 4, 5]


def _lease(root, name: str, **kwargs):
    from cocijax.manager._tier_lease import Lease

    kwargs.setdefault("duration_s", 60.0)
    return Lease(storage.KvPath.parse(root), owner=name, directory=f"/ckpt-{name}", **kwargs)


def test_the_lease_has_one_holder_until_released_or_expired(tmp_path):
    from cocijax.manager._tier_lease import LeaseError

    first, second = _lease(tmp_path, "first"), _lease(tmp_path, "second")
    first.acquire(0)
    try:
        with pytest.raises(LeaseError, match=r"held by another writer, first .*/ckpt-first"):
            second.acquire(0.2)
        waited = []
        first.release()
        second.acquire(0.2, waiting=waited.append)
        assert second.held and not waited
        # A holder that stopped renewing: once its expiry passed (another clock), it is taken.
        later = _lease(tmp_path, "later", clock=lambda: time.time() + 120)
        later.acquire(0)
        with pytest.raises(LeaseError, match="lease lost"):
            second.check(margin_s=0)
        later.release()
    finally:
        first.release()
        second.release()


def test_a_lease_whose_process_is_gone_is_free_at_once(tmp_path):
    import json
    import socket
    import subprocess
    import sys

    from cocijax.manager._tier_lease import LEASE_KEY

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    record = {
        "format": "cocijax-durable-lease",
        "owner": "killed",
        "host": socket.gethostname(),
        "pid": int(gone.stdout),
        "expires_unix": time.time() + 3600,
    }
    (tmp_path / LEASE_KEY).write_text(json.dumps(record))
    lease = _lease(tmp_path, "next")
    lease.acquire(0)
    try:
        assert lease.held
        assert json.loads((tmp_path / LEASE_KEY).read_text())["owner"] == "next"
    finally:
        lease.release()
    assert not (tmp_path / LEASE_KEY).exists()
