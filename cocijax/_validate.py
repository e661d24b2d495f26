"""The argument rules shared by the policies, the managers and the command line.

Each rule says once what it expects, in words, and how to test it, so that a policy factory, a
manager and a ``cocijax`` option accept the same values and word their errors the same way:
``<name> must be <expected>, got <value>``. Pure Python: the command line imports it without
JAX.

Examples:
  >>> check("mtbf_s", 3600, POSITIVE)
  3600.0
  >>> check("every", 4.0, at_least(1))
  4
  >>> check("time_weight", 2, UNIT)
  Traceback (most recent call last):
  ...
  ValueError: time_weight must be a number in [0, 1], got 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "NONNEGATIVE",
    "POSITIVE",
    "UNIT",
    "Rule",
    "at_least",
    "check",
    "problem",
]


class Rule(NamedTuple):
    """What a number must be.

    Attributes:
      expected: the rule in words, completing "must be ..." (e.g. ``"a positive integer"``).
      ok: the test, on a finite float.
      integer: only numbers equal to an integer pass (``3`` and ``3.0``, not ``3.5``).
    """

    expected: str
    ok: Callable[[float], bool]
    integer: bool = False


POSITIVE = Rule("a positive finite number", lambda v: v > 0)
NONNEGATIVE = Rule("a non-negative finite number", lambda v: v >= 0)
UNIT = Rule("a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)


def at_least(minimum: int) -> Rule:
    """An integer >= ``minimum`` (``"a positive integer"`` for 1)."""
    words = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    return Rule(words, lambda v: v >= minimum, integer=True)


def problem(value: Any, rule: Rule) -> str | None:
    """``"must be <expected>, got <value>"`` when ``value`` breaks ``rule``, else ``None``.

    Strings, ``None`` and booleans are never numbers here, even when ``float`` would take them.
    """
    ok = not isinstance(value, bool | str | bytes) and value is not None
    if ok:
        try:
            v = float(value)
        except (TypeError, ValueError):
            ok = False
        else:
            ok = math.isfinite(v) and rule.ok(v) and (not rule.integer or v == int(v))
    return None if ok else f"must be {rule.expected}, got {value!r}"


def check(name: str, value: Any, rule: Rule) -> Any:
    """``value`` as a float (an int for integer rules) if it follows ``rule``.

    Raises:
      ValueError: naming ``name``, the rule and the value.
    """
    wrong = problem(value, rule)
    if wrong is not None:
        raise ValueError(f"{name} {wrong}.")
    return int(value) if rule.integer else float(value)
