"""Faults of the durable tier and of object stores (a real S3 server, moto, on 127.0.0.1, behind
a proxy a test can take down or make hang; or a plain path), each at a chosen instant:

* an object store that cannot be reached, has no such bucket, or refuses the credentials fails
  at construction, within a bound, naming the URL and the cause (roots and durable tier);
* a durable tier unreachable when a manager opens is unknown, not empty: the open raises;
* two writers on one durable prefix: the second waits for the lease, deletes nothing it does
  not own, and never replaces a step the first committed;
* a drain that fails removes its own objects at once, after retries with backoff;
* reads that race the writer's deletions, or find a step the store lost, list again;
* ``close()`` gives up on a drain to a store that never answers, within ``store_timeout_s``;
* a malformed step record is a ``CorruptCheckpointError`` naming the step and the object;
* the command line reads a durable tier given as a path as one (a drain in flight is no damage).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from reliability_helpers import free_port

import cocijax as cj
from cocijax import storage
from cocijax.cli import main as cli
from cocijax.manager import DurableTierError, StepDeletedError, _tier_read, _tiers
from cocijax.storage._records import MANIFEST_NAME

# Generous bound for a test that must not hang; the behaviour is checked by what is raised.
HANG_GUARD_S = 60


def _state(step: int) -> dict:
    return {"w": np.arange(4096, dtype=np.float32) + step, "step": step}


def _manager(directory: Path, durable: str, store: dict | None, **kwargs) -> cj.CheckpointManager:
    kwargs.setdefault("policy", cj.policies.fixed(1))
    return cj.CheckpointManager(directory, durable=durable, durable_options=store, **kwargs)


def _save(mngr: cj.CheckpointManager, *steps: int, drained: bool = True) -> None:
    for step in steps:
        mngr.save(step, _state(step), loss=1.0, force=True)
        mngr.wait_until_finished(durable=drained)


def _reader(directory: Path, durable: str, options: dict | None) -> cj.CheckpointManager:
    directory.mkdir(parents=True, exist_ok=True)
    read_only = ocp.CheckpointManagerOptions(read_only=True)
    return _manager(directory, durable, options, options=read_only)


@pytest.fixture
def tier_options(monkeypatch):
    """Sets DurableOptions the manager does not expose (lease wait, retry backoff) for a test."""

    def set_options(**kwargs):
        monkeypatch.setattr(
            _tiers, "DurableOptions", functools.partial(_tiers.DurableOptions, **kwargs)
        )

    return set_options


class _Said(logging.Handler):
    """An event set once a log record containing one of ``texts`` is emitted."""

    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts
        self.event = threading.Event()

    def emit(self, record):
        if any(text in record.getMessage() for text in self.texts):
            self.event.set()


@pytest.fixture
def said():
    handlers = []

    def watch(*texts: str) -> threading.Event:
        handler = _Said(texts)
        logging.getLogger("cocijax").addHandler(handler)
        handlers.append(handler)
        return handler.event

    yield watch
    for handler in handlers:
        logging.getLogger("cocijax").removeHandler(handler)


# -- failing fast at construction ---------------------------------------------------------------


def _unreachable(case: str, s3, s3_proxy, monkeypatch) -> tuple[str, dict, str, dict]:
    """``(url, kvstore options, expected cause, manager kwargs)`` of a store that cannot be
    used, with TensorStore's default retries (as the README's example has it)."""
    options = {"endpoint": s3.endpoint, "aws_region": "us-east-1"}
    url, kwargs = s3.url("run"), {}
    if case == "closed-port":  # retried (it may be a restart) until the deadline
        options["endpoint"] = f"http://127.0.0.1:{free_port()}"
        cause, kwargs = "Could not connect", {"store_timeout_s": 2}
    elif case == "missing-bucket":
        url = f"s3://cocijax-missing-{uuid.uuid4().hex[:8]}/run"
        cause = "NoSuchBucket"
    elif case == "no-credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        options["aws_credentials"] = {"type": "environment"}
        cause = "credentials"
    else:  # accepts connections, never answers: only the deadline ends the wait
        s3_proxy.hang()
        options["endpoint"] = s3_proxy.endpoint
        cause, kwargs = "no answer within 2 s", {"store_timeout_s": 2}
    return url, options, cause, kwargs


@pytest.mark.parametrize("case", ["closed-port", "missing-bucket", "no-credentials", "hung"])
def test_an_unusable_durable_tier_fails_at_construction_naming_url_and_cause(
    tmp_path, s3, s3_proxy, monkeypatch, case
):
    url, options, cause, kwargs = _unreachable(case, s3, s3_proxy, monkeypatch)
    start = time.monotonic()
    with pytest.raises(DurableTierError) as caught:
        _manager(tmp_path / "ckpt", url, options, **kwargs)
    assert time.monotonic() - start < HANG_GUARD_S
    message = str(caught.value)
    assert url in message and cause in message, message
    assert "may be newer than the local ones" in message and "durable=" in message
    assert not (tmp_path / "ckpt" / ".cocijax-running").exists()


@pytest.mark.parametrize("case", ["closed-port", "missing-bucket", "no-credentials", "hung"])
def test_an_unwritable_object_store_root_fails_at_construction_naming_url_and_cause(
    tmp_path, s3, s3_proxy, monkeypatch, case
):
    url, options, cause, kwargs = _unreachable(case, s3, s3_proxy, monkeypatch)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"roots\[0\]=.* cannot be written") as caught:
        cj.CheckpointManager(
            tmp_path / "ckpt", roots=[url], handler_options={"root_options": options}, **kwargs
        )
    assert time.monotonic() - start < HANG_GUARD_S
    assert url in str(caught.value) and cause in str(caught.value), str(caught.value)


def test_bad_store_timeouts_are_named(tmp_path):
    with pytest.raises(ValueError, match="store_timeout_s: must be a positive"):
        cj.CheckpointManager(tmp_path / "ckpt", store_timeout_s=0)
    with pytest.raises(TypeError, match="store_timeout_s: expected a number"):
        cj.CheckpointManager(tmp_path / "ckpt", store_timeout_s="30")


# -- unknown is not empty ---------------------------------------------------------------------


def test_a_durable_tier_unreachable_at_open_is_unknown_not_empty(tmp_path, s3, s3_proxy):
    """Finding 15: run B opening on an empty local directory while the store is down must not
    see 'no step' (and train from step 1 over run A's steps)."""
    options = s3.options_via(s3_proxy.endpoint)
    with _manager(tmp_path / "a", s3.url("run"), options) as a:
        _save(a, 4, 5, 6)
    s3_proxy.down()
    with pytest.raises(DurableTierError, match="may be newer than the local ones"):
        _manager(tmp_path / "b", s3.url("run"), options, store_timeout_s=1)
    s3_proxy.up()
    with _manager(tmp_path / "b", s3.url("run"), options) as b:
        assert b.latest_step() == 6
        with pytest.raises(ValueError, match="not after the latest saved step 6"):
            b.save(4, _state(4), loss=1.0, force=True)


def test_a_drain_never_replaces_a_step_committed_by_another_writer(tmp_path, s3, caplog):
    """Finding 15/9: a drain of a step already committed on the durable tier (by another
    writer) skips it with an ERROR naming the step, the URL and the owner."""
    url, options = s3.url("run"), s3.options
    b = _manager(tmp_path / "b", url, options)  # lists the tier while it is empty
    try:
        with _manager(tmp_path / "a", url, options) as a:
            _save(a, 4)  # committed by A, after B listed
        with caplog.at_level(logging.ERROR, logger="cocijax"):
            b.save(4, {"w": np.zeros(4096, np.float32), "step": -4}, loss=1.0, force=True)
            b.wait_until_finished(durable=True)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(
            "step 4 is committed on the durable tier already" in m and f"{url}/4" in m
            for m in errors
        ), errors
        assert b.durable_steps() == [4]
    finally:
        b.close()
    with _reader(tmp_path / "c", url, options) as c:
        assert c.restore(4)["step"] == 4  # A's step, intact
    assert cli(["verify", url, "--endpoint", s3.endpoint, "--region", "us-east-1"]) == 0


# -- two writers ----------------------------------------------------------------------------


def _pause_drain_of(monkeypatch, step: int) -> tuple[threading.Event, threading.Event]:
    """Pauses the first drain of ``step`` once its pieces are written, before its commit.

    Returns:
      ``(paused, go)``: set when the drain is paused; set it to let the drain go on.
    """
    paused, go = threading.Event(), threading.Event()
    real = storage.copy_item

    def copy_item(source, dest, **kwargs):
        stats = real(source, dest, **kwargs)
        if str(dest).endswith(f"/{step}/state") and not paused.is_set():
            paused.set()
            assert go.wait(HANG_GUARD_S), "the test never let the paused drain go on"
        return stats

    monkeypatch.setattr(storage, "copy_item", copy_item)
    return paused, go


def test_a_second_writer_waits_for_the_lease_and_corrupts_nothing(
    tmp_path, s3, monkeypatch, said, caplog
):
    """Finding 9: job A is still draining its last save (step 4) when job B starts elsewhere
    with an empty local directory, restores step 3 and saves its own step 4, then 5."""
    url, options = s3.url("run"), s3.options
    a = _manager(tmp_path / "a", url, options)
    _save(a, 1, 2, 3)
    paused, go = _pause_drain_of(monkeypatch, 4)
    _save(a, 4, drained=False)
    assert paused.wait(HANG_GUARD_S)  # A's step 4: pieces on S3, not committed
    # B's drain of its step 4 either waits for A's lease or (without one) goes ahead.
    waiting, went_ahead = said("waits (up to"), said("step 4 drained")
    with (
        caplog.at_level(logging.INFO, logger="cocijax"),
        _manager(tmp_path / "b", url, options) as b,
    ):
        assert b.latest_step() == 3
        assert b.restore()["step"] == 3
        b.save(4, {"w": np.zeros(4096, np.float32), "step": -4}, loss=1.0, force=True)
        b.wait_until_finished()
        while not (waiting.is_set() or went_ahead.is_set()):
            waiting.wait(0.05)
        waited = waiting.is_set() and not went_ahead.is_set()  # before A's own drain ends
        go.set()
        a.close()  # A commits its step 4 and releases the lease
        b.wait_until_finished(durable=True)  # B's step 4: skipped, A's is there
        _save(b, 5)
        assert b.durable_steps() == [1, 2, 3, 4, 5]
    with _reader(tmp_path / "c", url, options) as c:
        assert c.restore()["step"] == 5
        assert c.restore(4)["step"] == 4  # A's, intact
    assert cli(["verify", url, "--endpoint", s3.endpoint, "--region", "us-east-1"]) == 0
    assert waited, "B's drain did not wait for A's lease"
    messages = [r.getMessage() for r in caplog.records]
    assert any("step 4 is committed on the durable tier already" in m for m in messages)


def test_a_second_writer_gives_up_after_its_bound_naming_the_holder(tmp_path, s3, tier_options):
    tier_options(lease_wait_s=1.0)
    url, options = s3.url("run"), s3.options
    with _manager(tmp_path / "a", url, options) as a:
        _save(a, 1)  # A holds the lease from now until it closes
        with _manager(tmp_path / "b", url, options) as b:
            b.save(2, _state(2), loss=1.0, force=True)
            with pytest.raises(DurableTierError, match="held by another writer") as caught:
                b.wait_until_finished(durable=True)
            assert str(tmp_path / "a") in str(caught.value)  # A's directory names the holder
            assert b.durable_steps() == [1]
        _save(a, 3)  # A goes on as before
        assert a.durable_steps() == [1, 3]


# -- a failed drain cleans up after itself -------------------------------------------------------


def test_a_failed_drain_removes_its_objects_at_once_after_retries(tmp_path, monkeypatch, caplog):
    """Finding 11: a store that is full for a moment costs one drain, not every later one."""
    durable = tmp_path / "durable"
    real, failures = storage.copy_item, []

    def full(source, dest, **kwargs):
        stats = real(source, dest, **kwargs)
        if str(dest).endswith("/1/state"):  # the pieces are written, then the store is full
            failures.append(dest)
            raise ValueError("RESOURCE_EXHAUSTED: the store is full")
        return stats

    monkeypatch.setattr(storage, "copy_item", full)
    with (
        caplog.at_level(logging.INFO, logger="cocijax"),
        _manager(tmp_path / "ckpt", str(durable), None) as mngr,
    ):
        mngr.save(1, _state(1), loss=1.0, force=True)
        with pytest.raises(DurableTierError, match="the store is full"):
            mngr.wait_until_finished(durable=True)
        assert not (durable / "1").exists()  # at once, not after the next successful drain
        assert len(failures) == 3  # tried three times, 1 s and 2 s apart
        _save(mngr, 2)
        assert mngr.durable_steps() == [2]
    retried = [r.getMessage() for r in caplog.records if "trying again in" in r.getMessage()]
    assert len(retried) == 2 and all("step 1" in m for m in retried)


# -- reads that race the writer, and steps the store lost ---------------------------------------


def test_a_reader_follows_the_writers_durable_deletions(tmp_path, s3):
    """Finding 7: a read-only manager's durable listing is from its opening; the writer's
    ``durable_max_to_keep`` deletes those steps."""
    url, options = s3.url("run"), s3.options
    with _manager(tmp_path / "w", url, options, durable_max_to_keep=1) as writer:
        _save(writer, 1)
        with _reader(tmp_path / "r", url, options) as reader:
            assert reader.durable_steps() == [1]
            _save(writer, 2, 3)  # deletes durable steps 1 and 2
            with pytest.raises(StepDeletedError, match="step 1"):
                reader.restore(1, tier="durable")
            assert reader.durable_steps() == [3]  # listed again
            _save(writer, 4, 5)  # deletes 3 and 4
            assert reader.restore(tier="durable")["step"] == 5  # retried with the newest
            assert reader.restored_step == 5
            _save(writer, 6)
            assert reader.restore(6, tier="durable")["step"] == 6  # listed again on a miss


def test_a_durable_read_raced_by_a_deletion_retries_with_the_newest_step(tmp_path, s3, monkeypatch):
    """Finding 14: the step's files vanish between its manifest and its record being read."""
    url, options = s3.url("run"), s3.options
    with _manager(tmp_path / "w", url, options) as writer:
        _save(writer, 1, 2)
        with _reader(tmp_path / "r", url, options) as reader:
            real, raced = _tier_read.step_files, []

            def step_files(prefix, *args):
                if not raced:  # the writer deletes step 2 under the read, manifest first
                    raced.append(prefix)
                    writer.delete(2)
                return real(prefix, *args)

            monkeypatch.setattr(_tier_read, "step_files", step_files)
            assert reader.restore(tier="durable")["step"] == 1
            assert raced and reader.durable_steps() == [1]


def test_durable_steps_the_store_lost_are_listed_again_and_skipped(tmp_path, s3):
    """Finding 19: the bucket is lost (a server restarted); reads and drains list again."""
    url, options = s3.url("run"), s3.options
    with _manager(tmp_path / "w", url, options, max_to_keep=1) as writer:
        _save(writer, 1, 2, 3)
        with _reader(tmp_path / "r", url, options) as reader:  # lists [1, 2, 3]; no local copy
            for step in (3, 2):  # the store lost the two newest steps
                s3.client.delete_object(Bucket=s3.name, Key=f"run/{step}/state/{MANIFEST_NAME}")
            assert reader.durable_steps() == [1, 2, 3]
            assert reader.restore(fallback=True)["step"] == 1
            assert reader.durable_steps() == [1]
        # Then the whole bucket: the next drain fails and lists the tier again.
        keys = s3.keys()
        s3.client.delete_objects(Bucket=s3.name, Delete={"Objects": [{"Key": k} for k in keys]})
        s3.client.delete_bucket(Bucket=s3.name)
        writer.save(4, _state(4), loss=1.0, force=True)
        with pytest.raises(DurableTierError):
            writer.wait_until_finished(durable=True)
        assert writer.durable_steps() == []
        assert writer.restore(fallback=True)["step"] == 4  # the local copy


# -- close() on a store that never answers --------------------------------------------------------


def test_close_abandons_a_drain_to_a_store_that_never_answers(tmp_path, s3, s3_proxy, caplog):
    """Finding 17: a server that accepts connections and never answers held close() for
    minutes; now it waits for a drain only while the drain makes progress."""
    mngr = _manager(
        tmp_path / "ckpt", s3.url("run"), s3.options_via(s3_proxy.endpoint), store_timeout_s=2
    )
    _save(mngr, 1)
    s3_proxy.hang()
    mngr.save(2, _state(2), loss=1.0, force=True)
    mngr.wait_until_finished()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="cocijax"):
        mngr.close()
    assert time.monotonic() - start < HANG_GUARD_S
    warned = [r.getMessage() for r in caplog.records if "abandoning the drain" in r.getMessage()]
    assert len(warned) == 1 and "[2]" in warned[0] and str(tmp_path / "ckpt") in warned[0]
    s3_proxy.up()
    assert f"run/2/state/{MANIFEST_NAME}" not in s3.keys("run/2/")


# -- malformed records ----------------------------------------------------------------------------


def test_a_malformed_step_record_is_damage_naming_the_step_and_the_object(tmp_path, s3, capsys):
    """Finding 18: one byte of cocijax_step.json changed ("path" -> "patH")."""
    url, options = s3.url("run"), s3.options
    with _manager(tmp_path / "w", url, options) as writer:
        _save(writer, 1, 2)
    key = "run/2/cocijax_step.json"
    body = s3.client.get_object(Bucket=s3.name, Key=key)["Body"].read()
    s3.client.put_object(Bucket=s3.name, Key=key, Body=body.replace(b'"path"', b'"patH"', 1))
    with _reader(tmp_path / "r", url, options) as reader:
        with pytest.raises(storage.CorruptCheckpointError, match=rf"step 2: {url}/2/cocijax_step"):
            reader.restore(tier="durable")
        with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
            assert reader.restore(tier="durable", fallback=True)["step"] == 1
    assert cli(["verify", url, "--endpoint", s3.endpoint, "--region", "us-east-1"]) == 1
    out = capsys.readouterr().out
    assert (
        f"step 2: leaf (no leaf), file {url}/2/cocijax_step.json" in out and "KeyError" not in out
    )


# -- the command line on a durable tier given as a path -----------------------------------------


def test_the_cli_reads_a_durable_path_as_a_durable_tier(tmp_path, monkeypatch, capsys):
    """Finding 14: a drain in flight (a step folder without its manifest) is not damage."""
    durable = tmp_path / "durable"
    paused, go = _pause_drain_of(monkeypatch, 2)
    with _manager(tmp_path / "ckpt", str(durable), None) as mngr:
        _save(mngr, 1)
        _save(mngr, 2, drained=False)
        assert paused.wait(HANG_GUARD_S)  # step 2 half drained
        try:
            assert cli(["verify", str(durable)]) == 0
            assert f"OK: 1 step(s) verified in {durable}" in capsys.readouterr().out
            assert cli(["ls", str(durable)]) == 0
            rows = [line for line in capsys.readouterr().out.splitlines() if "ok" in line]
            assert len(rows) == 1
        finally:
            go.set()


def test_an_interrupt_inside_a_durable_restore_leaves_no_temporary_folder(
    tmp_path, s3, monkeypatch
):
    url, options = s3.url("run"), s3.options
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    with _manager(tmp_path / "w", url, options) as writer:
        _save(writer, 1)
        real = ocp.Checkpointer.restore

        def interrupted(self, *args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(ocp.Checkpointer, "restore", interrupted)
        with pytest.raises(KeyboardInterrupt):
            writer.restore(tier="durable")
        monkeypatch.setattr(ocp.Checkpointer, "restore", real)
    assert not list(scratch.glob("cocijax-durable-*"))
