"""Looking a policy constructor up by name (for the CLI and config files)."""

from __future__ import annotations

from cocijax.policies._base import Policy
from cocijax.policies._classic import checkfreq, daly, fixed, young
from cocijax.policies._coci import coci
from cocijax.policies._levels import coci_two_level, young_two_level
from cocijax.policies._paper import coci_paper

CONSTRUCTORS = {
    "fixed": fixed,
    "young": young,
    "daly": daly,
    "checkfreq": checkfreq,
    "coci": coci,
    "coci_paper": coci_paper,
    "young_two_level": young_two_level,
    "coci_two_level": coci_two_level,
}
# The constructors of two-level policies (``Policy.levels == 2``).
TWO_LEVEL = ("young_two_level", "coci_two_level")


def names(levels: int | None = None) -> tuple[str, ...]:
    """The names :func:`by_name` knows.

    Args:
      levels: 1 or 2 for only the policies of that many levels (``Policy.levels``); ``None``
        for all.

    Example:
      >>> import cocijax as cj
      >>> cj.policies.names(levels=1)
      ('fixed', 'young', 'daly', 'checkfreq', 'coci', 'coci_paper')
      >>> cj.policies.names(levels=2)
      ('young_two_level', 'coci_two_level')
    """
    if levels not in (None, 1, 2):
        raise ValueError(f"levels: expected 1, 2 or None, got {levels!r}.")
    return tuple(k for k in CONSTRUCTORS if levels is None or (k in TWO_LEVEL) == (levels == 2))


def by_name(name: str, **kwargs) -> Policy:
    """Builds the policy called ``name`` with keyword arguments ``kwargs``.

    Args:
      name: one of ``'fixed'``, ``'young'``, ``'daly'``, ``'checkfreq'``, ``'coci'``,
        ``'coci_paper'``, or of the two-level ``'young_two_level'``, ``'coci_two_level'``
        (case-insensitive; ``-`` counts as ``_``).
      **kwargs: passed to the constructor.

    Returns:
      The :class:`Policy`.

    Raises:
      ValueError: for an unknown name, or arguments the constructor does not take.

    Example:
      >>> import cocijax as cj
      >>> policy = cj.policies.by_name("young", mtbf_s=3600.0)
    """
    key = str(name).strip().lower().replace("-", "_")
    if key not in CONSTRUCTORS:
        raise ValueError(f"Unknown policy name {name!r}; expected one of {sorted(CONSTRUCTORS)}.")
    try:
        return CONSTRUCTORS[key](**kwargs)
    except TypeError as e:
        raise ValueError(f"Bad arguments for policy {key!r}: {e}") from None
