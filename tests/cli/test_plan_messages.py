"""What ``cocijax plan`` tells a first user: a directory given for the CSV, a bare number of
seconds, and what the columns and the hindsight optimum of its table mean."""

from __future__ import annotations

from pathlib import Path

from cocijax.cli import _plan, _units, main

CURVE = Path(__file__).resolve().parents[1] / "data" / "wrn-40-4_cifar10_loss.csv"
JOB = ["--ckpt-cost", "20s", "--step-time", "90s", "--policy", "young", "--trials", "20"]


def _row(out: str, policy: str) -> list[str]:
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if cells and cells[0] == policy:
            return cells[1:]
    raise AssertionError(f"no row {policy!r} in:\n{out}")


def test_a_directory_given_as_the_csv_says_what_plan_expects(tmp_path, capsys):
    (tmp_path / "1").mkdir()  # a checkpoint directory, say
    assert main(["plan", str(tmp_path), "--mtbf", "4h", *JOB]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{tmp_path} is a directory: plan expects a CSV file of losses" in err
    assert "'cocijax ls' and 'cocijax verify' take checkpoint directories" in err


def test_a_bare_number_is_seconds_and_the_note_says_how_it_was_read(capsys):
    assert main(["plan", str(CURVE), "--mtbf", "14400", *JOB]) == 0
    bare = capsys.readouterr()
    assert bare.err.strip() == "cocijax: note: --mtbf 14400 has no unit: read as 14400 seconds = 4h"
    assert main(["plan", str(CURVE), "--mtbf=4h", *JOB]) == 0
    with_unit = capsys.readouterr()
    assert with_unit.err == ""
    assert _row(bare.out, "young") == _row(with_unit.out, "young")
    assert main(["plan", str(CURVE), "--mtbf", "4h", *JOB[:2], "--step-time", "2"]) == 0
    assert capsys.readouterr().err.strip() == (
        "cocijax: note: --step-time 2 has no unit: read as 2 seconds"
    )
    assert main(["plan", "--help"]) == 0
    assert "a bare number is seconds (a note on stderr" in " ".join(capsys.readouterr().out.split())


def test_the_table_says_what_its_columns_and_the_hindsight_optimum_mean(capsys):
    assert main(["plan", str(CURVE), "--mtbf", "4h", *JOB]) == 0
    out = capsys.readouterr().out
    optimum = _row(out, _plan.OPTIMAL)
    assert "weighted" in _plan.OPTIMAL
    legend = out[out.index("└") :]
    assert "wall overhead: expected time lost to saves, redone steps and restarts" in legend
    assert "weighted overhead: the same, each redone step weighted by the loss" in legend
    assert "hindsight optimum: least weighted overhead" in legend
    # What the last line explains, on this curve: the optimum loses more wall time than
    # Young's schedule, and less weighted time.
    young = _row(out, "young")
    wall, weighted = (
        [_units.parse_duration(row[i].split()[0]) for row in (optimum, young)] for i in (2, 3)
    )
    assert wall[0] > wall[1] and weighted[0] < weighted[1], (optimum, young)
