"""What every public entry point does with bad input; one test (or parameter set) per README row.

The README's "Bad input" table names the test behind each row. Errors must name the parameter
(or leaf path, or file) so that the message alone says what to fix.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reliability_helpers import item_dir

import cocijax as cj
from cocijax import cli, storage

pytestmark = pytest.mark.xdist_group("reliability-mounts")

P = cj.policies

# -- policies -------------------------------------------------------------------------------


_POSITIVE = [-1.0, 0.0, math.nan, math.inf, "1h"]
_NON_NEGATIVE = [-1.0, -1e-9, math.nan, math.inf, "2m"]
_FACTORIES = {
    "fixed-every": (lambda v: P.fixed(v), "every", [0, -2, 1.5, "3", None]),
    "fixed-every-none": (lambda v: P.fixed(v), "every", [None]),
    "young-mtbf": (lambda v: P.young(v), "mtbf_s", _POSITIVE),
    "young-prior-mtbf": (lambda v: P.young(prior_mtbf_s=v), "prior_mtbf_s", _POSITIVE),
    "coci-prior-mtbf": (lambda v: P.coci(prior_mtbf_s=v), "prior_mtbf_s", _POSITIVE),
    "daly-mtbf": (lambda v: P.daly(v), "mtbf_s", _POSITIVE),
    "coci-mtbf": (lambda v: P.coci(mtbf_s=v), "mtbf_s", _POSITIVE),
    "coci-recovery": (lambda v: P.coci(recovery_s=v), "recovery_s", _NON_NEGATIVE),
    "coci-time-weight": (lambda v: P.coci(time_weight=v), "time_weight", [-0.1, 1.5, math.nan]),
    "young-cost-prior": (lambda v: P.young(3600.0, cost_prior_s=v), "cost_prior_s", _NON_NEGATIVE),
    "checkfreq-overhead": (lambda v: P.checkfreq(v), "max_overhead", [*_POSITIVE, None, 2.0]),
}


@pytest.mark.parametrize(
    ("make", "param", "value"),
    [(make, param, v) for make, param, values in _FACTORIES.values() for v in values],
    ids=[f"{k}={v!r}" for k, (_, _, values) in _FACTORIES.items() for v in values],
)
def test_policy_factories_reject_bad_numbers(make, param: str, value: Any) -> None:
    with pytest.raises((ValueError, TypeError), match=param):
        make(value)


def test_policy_by_name_unknown() -> None:
    with pytest.raises(ValueError, match="coci"):
        P.by_name("cocci")


@pytest.mark.parametrize("name", ["coci", "young", "checkfreq"])
def test_policy_update_treats_nan_inf_negative_inputs_as_missing(name: str) -> None:
    """NaN/inf losses, negative costs and non-positive step times change nothing under jit."""
    policy = P.by_name(name, **({} if name == "checkfreq" else {"mtbf_s": 60.0}))
    update = jax.jit(policy.update)
    rng = np.random.default_rng(0)
    bad_rows = {5, 9, 13, 21, 50, 77}
    runs = ("bad", "missing", "valid")
    states = {k: policy.init() for k in runs}
    decisions: dict[str, list[bool]] = {k: [] for k in runs}
    for step in range(1, 150):
        loss = float(2.0 / step + 0.01 * rng.standard_normal())
        row = {"loss": loss, "step_time_s": 1.0, "checkpoint_cost_s": 5.0}
        variants = dict.fromkeys(runs, row)
        if step in bad_rows:
            variants["bad"] = {
                "loss": [math.nan, math.inf, -math.inf][step % 3],
                "step_time_s": -1.0,
                "checkpoint_cost_s": -5.0,
            }
            variants["missing"] = {
                "loss": math.nan,
                "step_time_s": math.nan,
                "checkpoint_cost_s": math.nan,
            }
            # The control run sees other valid values: the policy does notice its inputs.
            variants["valid"] = {"loss": loss, "step_time_s": 3.0, "checkpoint_cost_s": 0.5}
        for key, inputs in variants.items():
            save, states[key] = update(states[key], step=step, **inputs)
            decisions[key].append(bool(save))
    assert any(decisions["missing"]), f"{name} never saved: the comparison would be vacuous"
    assert decisions["bad"] == decisions["missing"]
    bad, missing, valid = (jax.tree.leaves(states[k]) for k in runs)
    for a, b in zip(bad, missing, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(c), equal_nan=True)
        for a, c in zip(missing, valid, strict=True)
    )
    assert not any(np.any(np.isinf(np.asarray(x))) for x in bad), "an inf leaked into the state"


def test_plan_rejects_2d_losses() -> None:
    with pytest.raises(ValueError, match="losses"):
        P.plan(np.ones((3, 3)), P.fixed(2), step_time_s=1.0, checkpoint_cost_s=1.0)


def test_save_decision_policy_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="policy"):
        cj.SaveDecisionPolicy("coci")
    with pytest.raises(TypeError, match="metric"):
        cj.SaveDecisionPolicy(P.fixed(1), metric=1)


# -- CLI --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["verify", "{missing}"], 2, "{missing}"),
        (["ls", "{missing}"], 2, "{missing}"),
        (
            ["plan", "{missing}", "--mtbf", "4h", "--ckpt-cost", "20s", "--step-time", "1s"],
            2,
            "{missing}",
        ),
        (
            ["plan", "{csv}", "--mtbf", "4h", "--ckpt-cost", "-20s", "--step-time", "1s"],
            2,
            "ckpt-cost",
        ),
        (["plan", "{csv}", "--mtbf", "0", "--ckpt-cost", "20s", "--step-time", "1s"], 2, "mtbf"),
        (["plan", "{csv}", "--mtbf", "soon", "--ckpt-cost", "20s", "--step-time", "1s"], 2, "mtbf"),
        (["verify", "{foreign}"], 2, "{foreign}"),
        (["ls", "{foreign}"], 2, "{foreign}"),
        (
            ["plan", "{binary}", "--mtbf", "4h", "--ckpt-cost", "2s", "--step-time", "1s"],
            2,
            "{binary}",
        ),
        (
            ["plan", "{csv}", "--mtbf", "-4h", "--ckpt-cost", "20s", "--step-time", "1s"],
            2,
            "must be a positive duration",
        ),
        (
            ["plan", "{csv}", "--mtbf=-4h", "--ckpt-cost", "20s", "--step-time", "1s"],
            2,
            "must be a positive duration",
        ),
    ],
    ids=[
        "verify-missing-dir",
        "ls-missing-dir",
        "plan-missing-csv",
        "plan-negative-cost",
        "plan-zero-mtbf",
        "plan-bad-duration",
        "verify-foreign-dir",
        "ls-foreign-dir",
        "plan-binary-csv",
        "plan-negative-mtbf",
        "plan-negative-mtbf-equals",
    ],
)
def test_cli_bad_input_is_one_line_without_traceback(
    tmp_path: Path, capsys, argv: list[str], code: int, needle: str
) -> None:
    csv = tmp_path / "losses.csv"
    csv.write_text("step,loss\n" + "".join(f"{i},{3.0 / i}\n" for i in range(1, 50)))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    binary = tmp_path / "losses.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    subst = {
        "{missing}": str(tmp_path / "nope"),
        "{csv}": str(csv),
        "{foreign}": str(foreign),
        "{binary}": str(binary),
    }
    argv = [subst.get(a, a) for a in argv]
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == code, (status, err)
    assert subst.get(needle, needle) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# -- CheckpointManager and the striped handler ------------------------------------------------


def _tree() -> dict[str, Any]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.asarray(3, np.int32)}


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


@pytest.fixture
def mngr(tmp_path: Path):
    with cj.CheckpointManager(
        tmp_path / "ckpt", roots=[tmp_path / "r0", tmp_path / "r1"], policy=P.fixed(1000)
    ) as m:
        yield m


def test_manager_creates_missing_directory_and_roots(tmp_path: Path) -> None:
    directory, root = tmp_path / "a" / "b" / "ckpt", tmp_path / "x" / "root"
    with cj.CheckpointManager(directory, roots=[root], policy=P.fixed(1)) as m:
        assert m.save(1, _tree(), loss=1.0)
    assert directory.is_dir() and root.is_dir()


@pytest.mark.parametrize("bad", [123, None, 1.5], ids=["int", "none", "float"])
def test_manager_rejects_wrong_directory_type(bad: Any) -> None:
    with pytest.raises(TypeError, match="directory: expected a path"):
        cj.CheckpointManager(bad, policy=P.fixed(1))


def test_manager_rejects_directory_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"directory: {f} exists and is not a dir"):
        cj.CheckpointManager(f, policy=P.fixed(1))


def test_manager_rejects_wrong_policy_type(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="policy"):
        cj.CheckpointManager(tmp_path / "ckpt", policy="coci")


def test_manager_rejects_duplicate_roots(tmp_path: Path) -> None:
    root = tmp_path / "r0"
    with pytest.raises(ValueError, match="r0"):
        cj.CheckpointManager(
            tmp_path / "ckpt", roots=[root, tmp_path / "." / "r0"], policy=P.fixed(1)
        )


def test_manager_rejects_directory_written_by_something_else(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    (d / "7").mkdir(parents=True)
    (d / "7" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=str(d / "7")):
        cj.CheckpointManager(d, policy=P.fixed(1))


@pytest.mark.parametrize("step", ["3", 1.5, True, None], ids=["str", "float", "bool", "none"])
def test_save_rejects_wrong_step_type(mngr, step: Any) -> None:
    with pytest.raises(TypeError, match="step"):
        mngr.save(step, _tree(), loss=1.0)


def test_save_rejects_step_not_after_latest(mngr) -> None:
    assert mngr.save(5, _tree(), loss=1.0, force=True)
    mngr.wait_until_finished()
    for step in (5, 4):
        with pytest.raises(ValueError, match=f"step: {step}"):
            mngr.save(step, _tree(), loss=1.0, force=True)
    assert mngr.all_steps() == [5]


@pytest.mark.parametrize(
    "loss",
    [math.nan, math.inf, -math.inf, jnp.asarray(math.nan)],
    ids=["nan", "inf", "-inf", "jax-nan"],
)
def test_save_with_nan_inf_loss_still_saves_and_decides(mngr, loss: Any) -> None:
    for step in range(1, 4):
        mngr.save(step, _tree(), loss=loss)
    assert mngr.save(4, _tree(), loss=loss, force=True)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [4]
    assert math.isnan(mngr.measurements.loss) or math.isinf(mngr.measurements.loss)


@pytest.mark.parametrize(
    ("loss", "error"),
    [("x", TypeError), (None, TypeError), (np.ones(2), ValueError)],
    ids=["str", "none", "vector"],
)
def test_save_rejects_wrong_loss(mngr, loss: Any, error: type) -> None:
    with pytest.raises(error, match="loss"):
        mngr.save(1, _tree(), loss=loss)


def test_save_rejects_unsupported_leaf_naming_its_path(tmp_path: Path) -> None:
    tree = {"ok": np.ones(2, np.float32), "bad": {"leaf": object()}}
    d = tmp_path / "run"
    with cj.CheckpointManager(d / "ckpt", roots=[d / "r0", d / "r1"], policy=P.fixed(1000)) as m:
        assert m.save(1, {"ok": np.ones(2, np.float32)}, loss=1.0, force=True)
        m.wait_until_finished()
        with pytest.raises(TypeError, match=r"\['bad'\]\['leaf'\]"):
            m.save(2, tree, loss=1.0, force=True)
        # A failed save leaves the manager usable and lists nothing of it.
        assert m.all_steps() == [1]
        assert m.save(3, {"ok": np.ones(2, np.float32)}, loss=1.0, force=True)
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]


def test_a_failed_save_does_not_hold_up_the_interpreter_exit(tmp_path: Path) -> None:
    """An error inside Orbax's background save once left threads that kept a process from
    exiting for Orbax's 300 s signal timeout: a process whose save fails must exit at once."""
    script = f"""
import numpy as np, cocijax as cj
m = cj.CheckpointManager({str(tmp_path / "ckpt")!r}, roots=[{str(tmp_path / "r0")!r}],
                         policy=cj.policies.fixed(1000))
for step in range(1, 4):
    try:
        m.save(step, {{"bad": object()}}, loss=1.0, force=True)
    except TypeError:
        pass
print("done")
"""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    assert time.monotonic() - start < 60.0  # start-up and three refusals, not a 300 s wait


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda t: {**t, "w": jax.ShapeDtypeStruct((4, 3), np.float32)}, "w"),
        (lambda t: {**t, "w": jax.ShapeDtypeStruct((3, 4), np.int32)}, "w"),
        (lambda t: {"w": t["w"]}, "n"),
        (lambda t: {**t, "extra": jax.ShapeDtypeStruct((2,), np.float32)}, "extra"),
    ],
    ids=["shape", "dtype", "missing-leaf", "extra-leaf"],
)
def test_restore_into_mismatched_target_names_the_leaf(mngr, change, needle: str) -> None:
    assert mngr.save(1, _tree(), loss=1.0, force=True)
    mngr.wait_until_finished()
    with pytest.raises(ValueError, match=needle):
        mngr.restore(1, target=change(_abstract(_tree())))


def test_restore_missing_step_lists_committed_ones(mngr) -> None:
    with pytest.raises(FileNotFoundError, match="no committed step"):
        mngr.restore()
    assert mngr.save(2, _tree(), loss=1.0, force=True)
    mngr.wait_until_finished()
    with pytest.raises(FileNotFoundError, match=r"\[2\]"):
        mngr.restore(3)
    with pytest.raises(FileNotFoundError, match="step 3"):
        mngr.delete(3)


def test_handler_rejects_duplicate_and_file_roots(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="r0"):
        cj.StripedCheckpointHandler(roots=[tmp_path / "r0", tmp_path / "r0"])
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises((ValueError, OSError), match=str(f)):
        cj.StripedCheckpointHandler(roots=[f])


def test_read_only_root_fails_at_construction(tmp_path: Path, read_only_root: Path) -> None:
    with pytest.raises(ValueError, match=str(read_only_root)):
        cj.StripedCheckpointHandler(roots=[tmp_path / "ok", read_only_root])
    with pytest.raises(ValueError, match=str(read_only_root)):
        cj.CheckpointManager(
            tmp_path / "ckpt", roots=[tmp_path / "ok", read_only_root], policy=P.fixed(1)
        )


def test_storage_read_manifest_of_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(storage.CheckpointFormatError, match=str(tmp_path / "nope")):
        storage.read_manifest(tmp_path / "nope")
    assert item_dir(tmp_path, 1).name  # the helper itself does not touch the disk


@pytest.mark.parametrize(
    ("timeout_s", "error"),
    [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError), ("5", TypeError)],
    ids=["zero", "negative", "nan", "str"],
)
def test_close_rejects_a_bad_timeout_and_stays_open(mngr, timeout_s: Any, error: type) -> None:
    assert mngr.save(1, _tree(), loss=1.0, force=True)
    with pytest.raises(error, match="timeout_s"):
        mngr.close(timeout_s=timeout_s)
    assert mngr.save(2, _tree(), loss=1.0, force=True)  # still open
    mngr.close(timeout_s=60.0)  # one process: the save commits well within it
    with cj.CheckpointManager(
        mngr.directory, roots=list(mngr.roots), policy=P.fixed(10)
    ) as reopened:
        assert reopened.all_steps() == [1, 2]
