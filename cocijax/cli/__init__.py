"""The ``cocijax`` command line: plan a schedule on a loss history, list and verify checkpoints.

Commands::

    cocijax plan LOSSES.csv --mtbf 4h --ckpt-cost 20s --step-time 1.5s [--plot plan.png]
    cocijax ls DIR|URL [--endpoint URL] [--region NAME]
    cocijax verify DIR|URL [--step N] [--endpoint URL] [--region NAME]
    cocijax bench [write_bench arguments...]

Durations read like ``4h``, ``90min``, ``1h30m``, ``1.5s``; a bare number is seconds. Errors are
one line on stderr, never a traceback. Exit status (see ``_errors``): 0 when the command did
what was asked, 1 when damage was found, 2 for bad arguments or an input that is not what the
command needs.

This module builds the parser without importing JAX (``cocijax --help`` answers at once); the
commands (``_commands``) import it when they run.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator, Sequence

from cocijax import _validate
from cocijax.cli import _units
from cocijax.cli._errors import EXIT_BAD_INPUT, CliError

__all__ = ["build_parser", "main"]

# Options whose value is a duration: a negative one ("-4h") must reach the parser as a value.
_DURATION_OPTIONS = ("--mtbf", "--ckpt-cost", "--step-time", "--recovery")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``cocijax plan: error: ... (see cocijax plan --help)``."""

    def error(self, message: str):  # type: ignore[override]
        raise CliError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


class _PolicyNames:
    """The names ``cocijax.policies.by_name`` knows, looked up only when argparse needs them.

    ``cocijax.policies`` imports JAX; the choices of ``--policy`` are only read when ``plan``
    runs or prints its help, never for ``cocijax --help``.
    """

    def _names(self) -> tuple[str, ...]:
        from cocijax import policies

        return (*policies.names(levels=1), "all")

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


def _duration(text: str, *, positive: bool) -> float:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must be a positive duration, got {text!r}")
    try:
        value = _units.parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if positive and value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive duration, got {text!r}")
    return value


def _number(rule: _validate.Rule):
    """An argparse ``type=`` parsing a number that follows ``rule`` (shared with the library)."""

    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        wrong = _validate.problem(value, rule)
        if wrong:
            raise argparse.ArgumentTypeError(wrong.replace(f"{value!r}", text))
        return int(value) if rule.integer else value

    return parse


def _bare_seconds_hint(argv: list[str]) -> None:
    """Notes on stderr that a unitless duration is seconds (``--mtbf 4`` is 4 s, not 4 h).

    A bare number is accepted: the note shows how it was read, so that ``--mtbf 4`` meant as
    hours is caught while ``--mtbf 14400`` is confirmed as 4 h.
    """
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        value = (value or (argv[i + 1] if i + 1 < len(argv) else "")).strip()
        if name in _DURATION_OPTIONS and re.fullmatch(r"\d+(\.\d*)?", value):
            shown = _units.format_duration(float(value))
            same = "" if shown == f"{value}s" else f" = {shown}"
            print(
                f"cocijax: note: {name} {value} has no unit: read as {value} seconds{same}",
                file=sys.stderr,
            )


def _join_negative_durations(argv: list[str]) -> list[str]:
    """``--mtbf -4h`` -> ``--mtbf=-4h``: argparse would take ``-4h`` for an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        negative = i + 1 < len(argv) and re.match(r"-\.?\d", argv[i + 1])
        if argv[i] in _DURATION_OPTIONS and negative:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _add_object_store(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint",
        metavar="URL",
        help="S3-compatible server for s3:// roots or DIR (credentials: the AWS environment "
        "variables or profile, as TensorStore reads them)",
    )
    p.add_argument("--region", metavar="NAME", help="the S3 region (aws_region)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cocijax`` (exposed for documentation and tests)."""
    parser = _Parser(
        prog="cocijax",
        description="Convergence-aware checkpointing: plan schedules, inspect checkpoints.",
        epilog="Exit status: 0 done, 1 damage found, 2 bad arguments or input.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    _add_plan(sub)
    p = sub.add_parser(
        "ls",
        help="list the steps of a checkpoint directory",
        description="Lists each step with its size, time and checksum status. Exit status 1 "
        "when a step is damaged, 2 when DIR is not a cocijax checkpoint directory.",
    )
    p.add_argument(
        "directory", metavar="DIR", help="a checkpoint directory, or a durable tier's URL"
    )
    p.add_argument("--no-verify", action="store_true", help="skip reading every byte")
    _add_object_store(p)
    p = sub.add_parser(
        "verify",
        help="check every checksum of a checkpoint directory",
        description="Reads every piece and checks its checksum; one line per problem (leaf, "
        "file, what is wrong). Exit status 1 on any problem, 2 when DIR is not a cocijax "
        "checkpoint directory; PyTorch steps have no checksums and are listed as such.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument(
        "--step", type=_number(_validate.at_least(0)), metavar="N", default=None, help="only N"
    )
    _add_object_store(p)
    sub.add_parser(
        "bench",
        help="run the write benchmark (benchmarks/write_bench.py)",
        description="Runs benchmarks/write_bench.py; arguments after 'bench' are passed on "
        "(--quick for a short run, --write to record it in BENCHMARKS.md).",
        add_help=False,
    )
    return parser


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="schedule and expected overhead of each policy on a recorded loss history",
        description=(
            "Runs each policy over a step,loss CSV (one row = one training step of --step-time; "
            "empty cells and NaN are missing values), simulates its expected overhead under "
            "failures (wall, and weighted by the loss progress redone) and shows the schedule "
            "of least weighted overhead in hindsight. Durations accept 4h, 90min, 1h30m, 20s, "
            "1.5s, 250ms; a bare number is seconds (a note on stderr says how it was read)."
        ),
    )
    p.add_argument("losses", metavar="LOSSES.csv", help="CSV with a header and step,loss columns")
    positive = lambda text: _duration(text, positive=True)
    for flag, what in (
        ("--mtbf", "mean time between failures, e.g. 4h"),
        ("--ckpt-cost", "stall of one checkpoint, e.g. 20s"),
        ("--step-time", "seconds of one step (one CSV row), e.g. 1.5s"),
    ):
        p.add_argument(flag, type=positive, metavar="DURATION", required=True, help=what)
    p.add_argument(
        "--recovery",
        type=lambda text: _duration(text, positive=False),
        metavar="DURATION",
        default=0.0,
        help="restart time after a failure, e.g. 2m (default 0s)",
    )
    p.add_argument(
        "--policy",
        choices=_PolicyNames(),
        default="all",
        metavar="NAME",
        help="which policy to plan: coci, young, daly, checkfreq, fixed, coci_paper or all "
        "(default; 'fixed' needs --every)",
    )
    for flag, rule, default, what in (
        ("--every", _validate.at_least(1), None, "interval in steps of the 'fixed' policy"),
        ("--time-weight", _validate.UNIT, 0.25, "value of a plain second, in [0, 1]"),
        ("--max-overhead", _validate.POSITIVE, 0.05, "checkfreq's bound on the stall fraction"),
        ("--weibull-shape", _validate.POSITIVE, 1.0, "Weibull shape of failures (1 = Poisson)"),
        ("--trials", _validate.at_least(1), 1000, "simulated jobs per policy"),
        ("--seed", _validate.at_least(0), 0, "simulator seed"),
    ):
        p.add_argument(flag, type=_number(rule), metavar="N", default=default, help=what)
    p.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="write a figure (needs matplotlib: pip install 'cocijax[plot]')",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``cocijax`` command line.

    Args:
      argv: the arguments after the program name; defaults to ``sys.argv[1:]``.

    Returns:
      The exit status: 0 done, 1 damage found, 2 bad arguments or input (see ``_errors``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # `bench` passes everything on untouched, including --help.
        if argv[:1] == ["bench"]:
            from cocijax.cli import _commands

            return _commands.bench(argv[1:])
        argv = _join_negative_durations(argv)
        args = build_parser().parse_args(argv)
        if args.command == "plan":
            _bare_seconds_hint(argv)
        from cocijax.cli import _commands

        return getattr(_commands, args.command)(args)
    except CliError as e:
        msg = str(e)
        print(msg if msg.startswith("cocijax") else f"cocijax: error: {msg}", file=sys.stderr)
        return e.code
    except SystemExit as e:  # argparse's --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_BAD_INPUT)
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
