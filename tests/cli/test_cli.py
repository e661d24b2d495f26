"""Tests of the ``cocijax`` command line and of its duration/size parsing."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cocijax as cj
from cocijax.cli import _commands, _plan, _units, main

DATA = Path(__file__).resolve().parents[1] / "data"
POLICY_NAMES = cj.policies.names(levels=1)  # what `cocijax plan --policy all` runs
CURVE = DATA / "wrn-40-4_cifar10_loss.csv"
PLAN_ARGS = ["--mtbf", "4h", "--ckpt-cost", "20s", "--step-time", "90s", "--recovery", "2m"]


# ------------------------------------------------------------------------------ units
@pytest.mark.parametrize(
    "text, seconds",
    [
        ("4h", 14400.0),
        ("20s", 20.0),
        ("2m", 120.0),
        ("1.5s", 1.5),
        ("90min", 5400.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("3", 3.0),
        ("1d2h", 93600.0),
        ("2 hours", 7200.0),
    ],
)
def test_parse_duration_examples(text, seconds):
    assert _units.parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "h", "4y", "1h30", "-5s", "1.2.3s", "5s garbage", "nan", "1e400s"]
)
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        _units.parse_duration(text)


@settings(deadline=None)  # pure arithmetic; a loaded CI machine must not flake it
@given(st.integers(0, 30), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59))
def test_parse_duration_adds_terms(d, h, m, s):
    text = f"{d}d{h}h{m}m{s}s"
    assert _units.parse_duration(text) == 86400 * d + 3600 * h + 60 * m + s


@settings(deadline=None)  # pure arithmetic; a loaded CI machine must not flake it
@given(st.floats(1e-3, 1e8, allow_nan=False))
def test_format_duration_round_trips(seconds):
    text = _units.format_duration(seconds)
    back = _units.parse_duration(text)
    # Precision follows magnitude: 3 digits below a minute, then seconds, minutes, hours.
    rel = 0.005 if seconds < 60 else 0.021
    assert abs(back - seconds) <= rel * seconds, text
    assert _units.format_duration(back) == text  # idempotent


@pytest.mark.parametrize(
    "text, n",
    [
        ("4096", 4096),
        ("1.5KiB", 1536),
        ("512MiB", 512 * 2**20),
        ("2G", 2 * 2**30),
        ("10MB", 10**7),
        ("1 GiB", 2**30),
        ("0B", 0),
    ],
)
def test_parse_size_examples(text, n):
    assert _units.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-1KiB", "1e400"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        _units.parse_size(text)


@settings(deadline=None)  # pure arithmetic; a loaded CI machine must not flake it
@given(st.integers(0, 2**50))
def test_format_size_round_trips(n):
    back = _units.parse_size(_units.format_size(n))
    assert back == n if n < 1024 else abs(back - n) <= 0.005 * n


# ------------------------------------------------------------------------------ plan
def _table_rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│|]", line) if c.strip()]
        if cells and cells[0] in (*POLICY_NAMES, _plan.OPTIMAL):
            rows[cells[0]] = cells[1:]
    return rows


def test_plan_table_matches_plan_and_simulator(tmp_path, capsys):
    png = tmp_path / "plan.png"
    argv = ["plan", str(CURVE), *PLAN_ARGS, "--trials", "200", "--every", "20", "--plot", str(png)]
    assert main(argv) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert set(rows) == {*POLICY_NAMES, _plan.OPTIMAL}  # every policy, and the optimum

    losses = np.loadtxt(CURVE, delimiter=",", skiprows=1)[:, 1]
    n = len(losses)
    saves = cj.plan(
        losses,
        cj.policies.young(mtbf_s=14400.0, cost_prior_s=20.0),
        step_time_s=90.0,
        checkpoint_cost_s=20.0,
    )
    res = cj.sim.simulate(
        saves,
        n_steps=n,
        step_time_s=90.0,
        checkpoint_cost_s=20.0,
        recovery_s=120.0,
        mtbf_s=14400.0,
        weights=cj.sim.progress_weights(losses, 0.25),
        trials=200,
        seed=0,
    )
    count, interval, wall, weighted = rows["young"]
    assert int(count) == len(saves)
    assert interval == _units.format_duration(n * 90.0 / len(saves))
    assert wall.startswith(_units.format_duration(res.wall_overhead_s))
    assert weighted == _units.format_duration(res.weighted_overhead_s)
    assert int(rows["fixed"][0]) == n // 20
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plan_reads_missing_and_nan_cells(tmp_path, capsys):
    csv = tmp_path / "gappy.csv"
    lines = ["step,loss"] + [
        f"{i},{'' if i % 7 == 0 else ('nan' if i % 11 == 0 else 2.0 / i)}" for i in range(1, 301)
    ]
    csv.write_text("\n".join(lines) + "\n")
    history = _plan.read_losses(csv)
    assert len(history.losses) == 300 and np.isnan(history.losses[6]) and history.steps[-1] == 300
    assert main(["plan", str(csv), *PLAN_ARGS, "--policy", "coci", "--trials", "50"]) == 0
    assert int(_table_rows(capsys.readouterr().out)["coci"][0]) > 0


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["plan", str(CURVE), "--mtbf", "4y", "--ckpt-cost", "20s", "--step-time", "1s"],
            "--mtbf: unknown duration unit 'y'",
        ),
        (
            ["plan", str(CURVE), "--mtbf", "4h", "--ckpt-cost", "0s", "--step-time", "1s"],
            "--ckpt-cost: must be a positive duration",
        ),
        (["plan", str(CURVE), "--mtbf", "4h"], "required: --ckpt-cost, --step-time"),
        (["plan", "missing.csv", *PLAN_ARGS], "no such file: missing.csv"),
        (["plan", str(CURVE), *PLAN_ARGS, "--policy", "fixed"], "--policy fixed needs --every"),
        (["plan", str(CURVE), *PLAN_ARGS, "--policy", "magic"], "invalid choice: 'magic'"),
        (["plan", str(CURVE), *PLAN_ARGS, "--time-weight", "2"], "must be a number in [0, 1]"),
        (["ls", "no/such/dir"], "no such directory: no/such/dir"),
        (["verify", "no/such/dir"], "no such directory: no/such/dir"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert message in err and err.startswith("cocijax")
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize(
    "content, message",
    [
        ("step,val\n1,2\n", "'loss' column"),
        ("step,loss\n1,0.5\n2,abc\n", ":3: not a number"),
        ("step,loss\n", "no data rows"),
    ],
)
def test_bad_csv_exit_2_naming_the_file(tmp_path, content, message, capsys):
    csv = tmp_path / "bad.csv"
    csv.write_text(content)
    assert main(["plan", str(csv), *PLAN_ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and str(csv) in err


def test_foreign_directory_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "7").mkdir()
    assert main(["ls", str(tmp_path)]) == 2
    assert "is not a cocijax checkpoint directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------ ls, verify
@pytest.fixture
def checkpoints(tmp_path):
    """Two real steps written by cj.CheckpointManager."""
    directory = tmp_path / "ckpt"
    tree = {
        "params": {
            "w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64),
            "b": np.ones(64, np.float32),
        },
        "count": np.int32(3),
    }
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1)) as mngr:
        for step in (1, 2):
            mngr.save(step, tree, loss=1.0)
        mngr.wait_until_finished()
    return directory


def _corrupt_leaf(item_dir: Path, leaf_name: str) -> tuple[str, Path]:
    """Flips one byte of a data file of the leaf whose path mentions ``leaf_name``."""
    manifest = cj.storage.read_manifest(item_dir)
    index = next(i for i, leaf in enumerate(manifest.leaves) if f"'{leaf_name}'" in leaf.path)
    piece = next(p for p in manifest.pieces if p.leaf == index)
    array_dir = manifest.piece_path(piece, item_dir)
    data = max(
        (f for f in array_dir.rglob("*") if f.is_file() and f.name != "zarr.json"),
        key=lambda f: f.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return manifest.leaves[index].path, array_dir


def test_ls_and_verify_intact(checkpoints, capsys):
    assert main(["ls", str(checkpoints)]) == 0
    out = capsys.readouterr().out
    rows = {
        int(line.split("│")[1]): line
        for line in out.splitlines()
        if re.match(r"^│\s*\d+\s*│", line)
    }
    assert sorted(rows) == [1, 2]
    assert all("ok" in line and re.search(r"\d+(\.\d+)? (B|KiB)", line) for line in rows.values())
    assert main(["verify", str(checkpoints)]) == 0
    assert "OK: 2 step(s) verified" in capsys.readouterr().out
    assert main(["verify", str(checkpoints / "1" / "state")]) == 0  # one item directly
    assert "OK: item verified" in capsys.readouterr().out
    assert main(["ls", str(checkpoints), "--no-verify"]) == 0
    assert "ok" not in capsys.readouterr().out


def test_verify_names_damaged_leaf_and_file(checkpoints, capsys):
    leaf_path, array_dir = _corrupt_leaf(checkpoints / "2" / "state", "w")
    assert main(["verify", str(checkpoints)]) == 1
    captured = capsys.readouterr()
    damaged = [line for line in captured.out.splitlines() if line.startswith("step 2")]
    assert damaged and all(leaf_path in line for line in damaged)
    assert any(array_dir.name in line for line in damaged)
    assert "step 1" not in captured.out
    assert "problem(s) in" in captured.err
    # One line per problem: the leaf and the file once each, what is wrong, no TensorStore spec.
    assert all(line.count(leaf_path) == 1 and "tensorstore_spec" not in line for line in damaged)
    assert max(len(line) for line in damaged) < 400
    assert main(["verify", str(checkpoints), "--step", "1"]) == 0
    assert main(["ls", str(checkpoints)]) == 1  # exit 1 means damage, for ls as for verify
    assert "DAMAGED" in capsys.readouterr().out
    assert main(["verify", str(checkpoints), "--step", "9"]) == 2


def test_ls_counts_stripes_on_external_roots(tmp_path, capsys):
    directory, roots = tmp_path / "ckpt", [tmp_path / "r0", tmp_path / "r1"]
    tree = {"w": np.arange(64 * 1024, dtype=np.float32)}  # 256 KiB, all outside `directory`
    with cj.CheckpointManager(directory, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, tree, loss=1.0)
    assert main(["ls", str(directory)]) == 0
    size = re.search(r"│\s*1\s*│\s*([\d.]+ \w+)\s*│", capsys.readouterr().out).group(1)
    assert _units.parse_size(size.replace(" ", "")) >= tree["w"].nbytes


@pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")
def test_ls_lists_a_torch_directory(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    import cocijax.torch as cjt

    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(2)) as mngr:
        for step in range(1, 5):
            mngr.save(step, {"w": torch.arange(1000.0)}, loss=1.0)
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"│\s*2\s*│.*KiB.*n/a", out) and re.search(r"│\s*4\s*│.*KiB.*n/a", out)
    # Nothing damaged: exit 0, and a word that PyTorch checkpoints carry no checksums.
    assert main(["verify", str(tmp_path)]) == 0
    assert "PyTorch checkpoints have no checksums" in capsys.readouterr().out


# ------------------------------------------------------------------------------ bench
def test_bench_forwards_arguments(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "write_bench.py"
    fake.write_text("def main(argv=None):\n    print('ARGS', argv)\n    return 3\n")
    monkeypatch.setattr(_commands, "_find_write_bench", lambda: fake)
    assert main(["bench", "--sizes", "a", "--help"]) == 3
    assert "ARGS ['--sizes', 'a', '--help']" in capsys.readouterr().out


def test_bench_unavailable_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(_commands, "_find_write_bench", lambda: None)
    assert main(["bench"]) == 2  # no source tree: an input problem, not damage
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "benchmarks/write_bench.py" in err


# ------------------------------------------------------------------------------ console script
def test_console_script(tmp_path):
    exe = Path(sys.executable).with_name("cocijax")
    exe = str(exe) if exe.exists() else shutil.which("cocijax")
    assert exe, "the cocijax console script is not installed (pip install -e .)"
    ok = subprocess.run(
        [exe, "plan", str(CURVE), *PLAN_ARGS, "--policy", "young", "--trials", "20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert int(_table_rows(ok.stdout)["young"][0]) > 0
    bad = subprocess.run(
        [exe, "plan", str(CURVE), "--mtbf", "soon"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr
