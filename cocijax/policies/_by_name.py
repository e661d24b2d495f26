"""Looking a policy constructor up by name (for the CLI and config files)."""

from __future__ import annotations

from cocijax.policies._base import Policy
from cocijax.policies._classic import checkfreq, daly, fixed, young
from cocijax.policies._coci import coci
from cocijax.policies._paper import coci_paper

CONSTRUCTORS = {
    "fixed": fixed,
    "young": young,
    "daly": daly,
    "checkfreq": checkfreq,
    "coci": coci,
    "coci_paper": coci_paper,
}


def names() -> tuple[str, ...]:
    """The names :func:`by_name` knows.

    Example:
      >>> import cocijax as cj
      >>> cj.policies.names()
      ('fixed', 'young', 'daly', 'checkfreq', 'coci', 'coci_paper')
    """
    return tuple(CONSTRUCTORS)


def by_name(name: str, **kwargs) -> Policy:
    """Builds the policy called ``name`` with keyword arguments ``kwargs``.

    Args:
      name: one of ``'fixed'``, ``'young'``, ``'daly'``, ``'checkfreq'``, ``'coci'``,
        ``'coci_paper'`` (case-insensitive; ``-`` counts as ``_``).
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
