"""The ``cocijax`` command line: plan a schedule on a loss history, list and verify checkpoints.

Commands::

    cocijax plan LOSSES.csv --mtbf 4h --ckpt-cost 20s --step-time 1.5s [--plot plan.png]
    cocijax ls DIR
    cocijax verify DIR [--step N]
    cocijax bench [write_bench arguments...]

Durations read like ``4h``, ``90min``, ``1h30m``, ``1.5s``; sizes print as KiB/MiB/GiB. Errors
are one line on stderr, never a traceback: exit status 2 for bad arguments or missing inputs,
1 when ``verify`` finds damage or a command fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cocijax import _units

__all__ = ["main"]

POLICY_NAMES = ("coci", "coci_paper", "young", "daly", "checkfreq", "fixed")


class CliError(Exception):
    """A failure reported as one line ``cocijax: error: ...`` with exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``cocijax plan: error: ... (see cocijax plan --help)``."""

    def error(self, message: str):  # type: ignore[override]
        raise CliError(f"{self.prog}: error: {message} (see '{self.prog} --help')", code=2)


def _duration(text: str) -> float:
    try:
        return _units.parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_duration(text: str) -> float:
    value = _duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive duration, got {text!r}")
    return value


def _number(kind: type, expected: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses ``kind`` and checks ``ok``, naming what it expected."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    return parse


_positive_int = _number(int, ">= 1", lambda v: v >= 1)
_nonnegative_int = _number(int, ">= 0", lambda v: v >= 0)
_unit_float = _number(float, "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
_positive_float = _number(float, "a positive number", lambda v: 0 < v < float("inf"))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cocijax`` (exposed for documentation and tests)."""
    parser = _Parser(
        prog="cocijax",
        description="Convergence-aware checkpointing: plan schedules, inspect checkpoints.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    p = sub.add_parser(
        "plan",
        help="schedule and expected overhead of each policy on a recorded loss history",
        description=(
            "Runs each policy over a step,loss CSV (one row = one training step of --step-time; "
            "empty cells and NaN are missing values) and simulates its expected overhead under "
            "failures. Durations accept 4h, 90min, 1h30m, 20s, 1.5s, 250ms."
        ),
    )
    p.add_argument("losses", metavar="LOSSES.csv", help="CSV with a header and step,loss columns")
    p.add_argument(
        "--mtbf",
        type=_positive_duration,
        metavar="DURATION",
        required=True,
        help="mean time between failures, e.g. 4h",
    )
    p.add_argument(
        "--ckpt-cost",
        type=_positive_duration,
        metavar="DURATION",
        required=True,
        help="stall of one checkpoint, e.g. 20s",
    )
    p.add_argument(
        "--step-time",
        type=_positive_duration,
        metavar="DURATION",
        required=True,
        help="seconds of one step (one CSV row), e.g. 1.5s",
    )
    p.add_argument(
        "--recovery",
        type=_duration,
        metavar="DURATION",
        default=0.0,
        help="restart time after a failure, e.g. 2m (default 0s)",
    )
    p.add_argument(
        "--policy",
        choices=(*POLICY_NAMES, "all"),
        default="all",
        help="which policy to plan (default: all; 'fixed' needs --every)",
    )
    p.add_argument(
        "--every",
        type=_positive_int,
        metavar="N",
        default=None,
        help="interval in steps of the 'fixed' policy",
    )
    p.add_argument(
        "--time-weight",
        type=_unit_float,
        metavar="W",
        default=0.25,
        help="value of a plain second against progress, in [0, 1] (default 0.25)",
    )
    p.add_argument(
        "--max-overhead",
        type=_positive_float,
        metavar="FRACTION",
        default=0.05,
        help="checkfreq's bound on the checkpoint stall fraction (default 0.05)",
    )
    p.add_argument(
        "--weibull-shape",
        type=_positive_float,
        metavar="K",
        default=1.0,
        help="shape of the Weibull failure process (1 = Poisson)",
    )
    p.add_argument(
        "--trials",
        type=_positive_int,
        metavar="N",
        default=1000,
        help="simulated jobs per policy (default 1000)",
    )
    p.add_argument("--seed", type=_nonnegative_int, metavar="N", default=0, help="simulator seed")
    p.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="write a figure: loss with checkpoint marks, cumulative checkpoints",
    )

    p = sub.add_parser(
        "ls",
        help="list the steps of a checkpoint directory",
        description="Lists each step with its size, time and checksum status.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--no-verify", action="store_true", help="skip reading every byte")

    p = sub.add_parser(
        "verify",
        help="check every checksum of a checkpoint directory",
        description="Exit status 1 on any problem, naming the leaf and the file.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument(
        "--step", type=_nonnegative_int, metavar="N", default=None, help="only this step"
    )

    sub.add_parser(
        "bench",
        help="run the write benchmark (benchmarks/write_bench.py)",
        description="Runs benchmarks/write_bench.py; arguments after 'bench' are passed on.",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``cocijax`` command line.

    Args:
      argv: the arguments after the program name; defaults to ``sys.argv[1:]``.

    Returns:
      The exit status: 0 on success, 1 on failure (damage found, a command failed), 2 on bad
      arguments or missing inputs.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # `bench` passes everything on untouched, including --help.
        if argv[:1] == ["bench"]:
            from cocijax import _cli_commands

            return _cli_commands.bench(argv[1:])
        args = build_parser().parse_args(argv)
        from cocijax import _cli_commands

        return getattr(_cli_commands, args.command)(args)
    except CliError as e:
        msg = str(e)
        print(msg if msg.startswith("cocijax") else f"cocijax: error: {msg}", file=sys.stderr)
        return e.code
    except SystemExit as e:  # argparse's --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:
        print("cocijax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for users; COCIJAX_DEBUG=1 shows the traceback
        if os.environ.get("COCIJAX_DEBUG"):
            raise
        print(f"cocijax: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
