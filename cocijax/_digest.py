"""A digest of a JSON document kept inside it, for every document cocijax writes.

A checksum over each piece of data catches damaged data, but not a damaged record: a flipped
digit in an inline value, a dtype or a region still parses and would be believed. So the
documents cocijax writes (a storage manifest, a manager's policy item, a PyTorch step's
``cocijax.json``) carry a digest of their own content under :data:`DIGEST_KEY`, and a reader
checks it when it is there (documents written before it existed have none and still read). The
digest is xxh3_64 of the canonical JSON text (sorted keys, no spaces), which a JSON round trip
preserves exactly. Pure Python: the PyTorch manager and the command line use it without JAX.

Examples:
  >>> doc = with_digest({"step": 3, "w": [1.5, None]})
  >>> check_digest(doc)
  True
  >>> doc["step"] = 7
  >>> check_digest(doc)
  False
  >>> check_digest({"step": 3})  # written before digests: nothing to check
  True
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

__all__ = ["DIGEST_KEY", "check_digest", "with_digest"]

DIGEST_KEY = "digest"


def _digest(data: dict[str, Any]) -> int:
    text = json.dumps(
        {k: v for k, v in data.items() if k != DIGEST_KEY}, sort_keys=True, separators=(",", ":")
    )
    return xxhash.xxh3_64_intdigest(text.encode())


def with_digest(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the digest of the rest of it under :data:`DIGEST_KEY`.

    Args:
      data: a JSON-serialisable object (a digest already in it is replaced).

    Returns:
      A new dict: ``data`` and its digest, an unsigned 64-bit integer.

    Raises:
      TypeError: ``data`` is not JSON-serialisable.
    """
    return {**data, DIGEST_KEY: _digest(data)}


def check_digest(data: dict[str, Any]) -> bool:
    """Whether ``data``'s digest matches its content.

    Args:
      data: a decoded JSON object, as :func:`with_digest` made it or as written before digests.

    Returns:
      True when the digest matches or there is none (a document of an older writer); False when
      it does not match, is not an integer, or the content cannot be written back as JSON
      (a 4300-digit integer, nesting too deep).
    """
    if DIGEST_KEY not in data:
        return True
    try:
        return type(data[DIGEST_KEY]) is int and data[DIGEST_KEY] == _digest(data)
    except (TypeError, ValueError, RecursionError):  # content JSON cannot write back
        return False
