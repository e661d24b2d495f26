"""``cocijax ls`` and ``verify`` on object storage (a real S3 server, moto, on 127.0.0.1): a
checkpoint directory whose roots are on S3, and a durable tier given by its URL."""

import re

import numpy as np
import pytest

import cocijax as cj
from cocijax.cli import main


@pytest.fixture
def saved(tmp_path, s3):
    """Two steps striped over an S3 root and a local one, both drained to ``s3://.../run``."""
    directory = tmp_path / "ckpt"
    with cj.CheckpointManager(
        directory,
        roots=[s3.url("roots/a"), tmp_path / "r1"],
        handler_options={"root_options": s3.options, "piece_bytes": 1 << 18},
        policy=cj.policies.fixed(1),
        durable=s3.url("run"),
        durable_options=s3.options,
    ) as mngr:
        for step in (1, 2):
            mngr.save(step, {"w": np.arange(256 * 1024, dtype=np.float32) + step}, loss=1.0)
            mngr.wait_until_finished(durable=True)
    return directory, s3


def _args(s3):
    return ["--endpoint", s3.endpoint, "--region", "us-east-1"]


def test_ls_and_verify_a_directory_with_roots_on_s3_and_the_durable_url(saved, capsys):
    directory, s3 = saved
    assert s3.keys("roots/a/")  # some pieces really are on S3
    assert main(["verify", str(directory), *_args(s3)]) == 0
    assert "OK: 2 step(s) verified" in capsys.readouterr().out
    assert main(["ls", str(directory), *_args(s3)]) == 0
    capsys.readouterr()
    assert main(["ls", s3.url("run"), *_args(s3)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^│\s*\d+\s*│", line)]
    assert [int(r.split("│")[1]) for r in rows] == [1, 2]
    assert all("ok" in r and "MiB" in r for r in rows)  # 1 MiB of pieces a step
    assert main(["verify", s3.url("run"), "--step", "2", *_args(s3)]) == 0
    assert "OK: 1 step(s) verified in s3://" in capsys.readouterr().out


def test_verify_names_a_damaged_object_on_the_durable_tier(saved, capsys):
    _, s3 = saved
    key = next(k for k in s3.keys("run/2/state/") if "/c." in k)
    s3.client.put_object(Bucket=s3.name, Key=key, Body=b"truncated")
    policy_key = "run/1/policy/policy_state.json"
    s3.client.put_object(Bucket=s3.name, Key=policy_key, Body=b"{}")
    assert main(["verify", s3.url("run"), *_args(s3)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    piece = s3.url(key.rsplit("/c.", 1)[0])
    assert any(line.startswith("step 2: leaf ['w']") and piece in line for line in lines)
    assert any(line.startswith("step 1") and s3.url(policy_key) in line for line in lines)
    assert "problem(s) in s3://" in captured.err
    assert main(["ls", s3.url("run"), "--no-verify", *_args(s3)]) == 0
    assert main(["ls", s3.url("run"), *_args(s3)]) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "ftp://host/run"], "unsupported URL scheme 'ftp'"),
        (["ls", "s3://"], "no bucket"),
    ],
    ids=["scheme", "no-bucket"],
)
def test_bad_urls_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_step_the_durable_tier_lacks_is_exit_2(saved, capsys):
    _, s3 = saved
    assert main(["verify", s3.url("run"), "--step", "9", *_args(s3)]) == 2
    assert "no step 9 in s3://" in capsys.readouterr().err
