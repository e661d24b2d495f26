"""A digest of a JSON document kept inside it, for every document cocijax writes.

A checksum over each piece of data catches damaged data, but not a damaged record: a flipped
digit in an inline value, a dtype or a region still parses and would be believed. So the
documents cocijax writes (a storage manifest, a manager's policy item, a PyTorch step's
``cocijax.json``) carry a digest of their own content under :data:`DIGEST_KEY`, and a reader
checks it when it is there (documents written before it existed have none and still read). The
digest is xxh3_64 of the canonical JSON text (sorted keys, no spaces), which a JSON round trip
preserves exactly. Pure Python: the PyTorch manager and the command line use it without JAX.

A document written as :func:`canonical_bytes` (that text with the digest appended last) can be
checked without parsing it (:func:`bytes_match_digest`): opening a directory checks every
step's manifest, and parsing one of a thousand leaves costs far more than hashing its bytes.

Examples:
  >>> doc = with_digest({"step": 3, "w": [1.5, None]})
  >>> check_digest(doc)
  True
  >>> doc["step"] = 7
  >>> check_digest(doc)
  False
  >>> check_digest({"step": 3})  # written before digests: nothing to check
  True
  >>> raw = canonical_bytes({"w": [1.5, None], "step": 3})
  >>> raw.startswith(b'{"step":3,"w":[1.5,null],"digest":'), bytes_match_digest(raw)
  (True, True)
  >>> bytes_match_digest(raw.replace(b"1.5", b"2.5"))
  False
"""

from __future__ import annotations

import json
import re
from typing import Any

import xxhash

__all__ = [
    "DIGEST_KEY",
    "bytes_match_digest",
    "canonical_bytes",
    "check_digest",
    "with_digest",
]

DIGEST_KEY = "digest"


# The end of a document written by canonical_bytes: its digest, the last key.
_DIGEST_TAIL = re.compile(rb',"' + DIGEST_KEY.encode() + rb'":(\d{1,20})\}\Z')


def _canonical(data: dict[str, Any]) -> str:
    return json.dumps(
        {k: v for k, v in data.items() if k != DIGEST_KEY}, sort_keys=True, separators=(",", ":")
    )


def _digest(data: dict[str, Any]) -> int:
    return xxhash.xxh3_64_intdigest(_canonical(data).encode())


def canonical_bytes(data: dict[str, Any]) -> bytes:
    """The file of ``data`` with its digest: the canonical text, the digest appended last.

    Any JSON reader reads it as :func:`with_digest`'s document, and :func:`bytes_match_digest`
    checks it without parsing.

    Raises:
      TypeError: ``data`` is not JSON-serialisable.
    """
    text = _canonical(data).encode()
    if text == b"{}":
        raise ValueError("canonical_bytes: an empty document has nothing to digest.")
    return b'%s,"%s":%d}' % (text[:-1], DIGEST_KEY.encode(), xxhash.xxh3_64_intdigest(text))


def bytes_match_digest(raw: bytes) -> bool:
    """Whether ``raw`` is a :func:`canonical_bytes` file as written, unchanged; no parse.

    False says only that this check cannot tell: the bytes were changed, or written otherwise
    (an older writer, another tool), and a reader parses them and :func:`check_digest` instead.
    """
    tail = _DIGEST_TAIL.search(raw, max(len(raw) - 32, 0))
    if tail is None:
        return False
    hasher = xxhash.xxh3_64(memoryview(raw)[: tail.start()])
    hasher.update(b"}")
    return hasher.intdigest() == int(tail.group(1))


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
