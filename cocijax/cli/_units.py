"""Human-friendly durations (``4h``, ``1h30m``, ``1.5s``) and sizes (``512MiB``) for the CLI.

A bare number is seconds (durations) or bytes (sizes). ``m`` is minutes, never months: a
checkpoint interval is never measured in months, and ``2m`` is how people write two minutes.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_duration", "format_size", "parse_duration", "parse_size"]

_DURATION_UNITS = {
    "ms": 1e-3,
    "msec": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}

# Binary units are what `ls -h` and `du -h` print; decimal ones are accepted for disks sold in GB.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_DURATION_TERM = re.compile(rf"\s*({_NUMBER})\s*([a-zA-Z]*)")
_SIZE = re.compile(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*")


def parse_duration(text: str | float | int) -> float:
    """Parses a duration such as ``4h``, ``20s``, ``1.5s``, ``90min`` or ``1h30m`` into seconds.

    Args:
      text: the duration; a bare number means seconds. Terms may be combined (``1h30m``).

    Returns:
      The duration in seconds (a non-negative float).

    Raises:
      ValueError: when ``text`` is not a duration, naming the offending text.

    Examples:
      >>> parse_duration("1h30m")
      5400.0
      >>> parse_duration("250ms")
      0.25
    """
    if isinstance(text, int | float):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"duration must be a finite number >= 0, got {text!r}")
        return float(text)
    s = text.strip()
    total, pos, terms = 0.0, 0, 0
    while pos < len(s):
        m = _DURATION_TERM.match(s, pos)
        if m is None or m.end() == pos:
            break
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit == "" and terms > 0:
            raise ValueError(f"missing unit after {m.group(1)!r} in {text!r} (e.g. '1h30m')")
        if unit not in _DURATION_UNITS and unit != "":
            raise ValueError(
                f"unknown duration unit {m.group(2)!r} in {text!r}; use ms, s, m/min, h or d "
                "(e.g. '4h', '1h30m', '1.5s')"
            )
        total += value * _DURATION_UNITS.get(unit, 1.0)
        pos, terms = m.end(), terms + 1
        if unit == "":
            break
    if terms == 0 or s[pos:].strip() or not math.isfinite(total):
        raise ValueError(f"not a duration: {text!r} (expected e.g. '4h', '20s', '1h30m', '1.5s')")
    return total


def parse_size(text: str | int) -> int:
    """Parses a size such as ``512MiB``, ``1.5GiB``, ``10MB`` or ``4096`` into bytes.

    ``K``/``M``/``G``/``T`` alone are binary (like ``ls -h``); ``KB``/``MB``/... are decimal.

    Args:
      text: the size; a bare number means bytes.

    Returns:
      The size in bytes, rounded to the nearest integer.

    Raises:
      ValueError: when ``text`` is not a size, naming the offending text.

    Examples:
      >>> parse_size("1.5KiB")
      1536
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text!r}")
        return text
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS or not math.isfinite(float(m.group(1))):
        raise ValueError(f"not a size: {text!r} (expected e.g. '512MiB', '1.5GiB', '4096')")
    return round(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def format_duration(seconds: float) -> str:
    """Formats seconds for people: ``250ms``, ``1.5s``, ``2m05s``, ``1h30m``, ``2d3h``.

    Precision follows magnitude (three significant digits below a minute; whole seconds below
    an hour; whole minutes above), and ``parse_duration`` reads back every output for a finite,
    non-negative duration.

    Args:
      seconds: the duration in seconds; NaN and infinities are returned as ``nan``/``inf``.

    Returns:
      A short string.

    Examples:
      >>> format_duration(5400)
      '1h30m'
    """
    if not math.isfinite(seconds):
        return "nan" if math.isnan(seconds) else ("inf" if seconds > 0 else "-inf")
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1.0:
        ms = float(f"{seconds * 1e3:.3g}")
        if ms < 1000:
            return f"{ms:g}ms"
        seconds = 1.0
    if seconds < 59.95:
        return f"{float(f'{seconds:.3g}'):g}s"
    if seconds < 3600 - 0.5:
        m, s = divmod(round(seconds), 60)
        return f"{m}m{s:02d}s" if s else f"{m}m"
    total_min = round(seconds / 60)
    if total_min < 24 * 60:
        h, m = divmod(total_min, 60)
        return f"{h}h{m:02d}m" if m else f"{h}h"
    d, rest = divmod(total_min, 24 * 60)
    h = round(rest / 60)
    if h == 24:
        d, h = d + 1, 0
    return f"{d}d{h}h" if h else f"{d}d"


def format_size(num_bytes: float) -> str:
    """Formats a byte count with binary units: ``512 B``, ``1.5 KiB``, ``3.25 GiB``.

    Args:
      num_bytes: the size in bytes.

    Returns:
      A short string with three significant digits, which ``parse_size`` reads back.

    Examples:
      >>> format_size(1536)
      '1.5 KiB'
    """
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1023.5 or unit == "TiB":
            if unit == "B":
                return f"{round(value)} B"
            return f"{float(f'{value:.3g}'):g} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")
