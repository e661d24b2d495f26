"""Object-storage locations: a prefix in a TensorStore key-value store (``s3://``, ``gs://``).

A root or an item directory is either a local directory (``pathlib.Path``: a plain path or a
``file://`` URL), where the write path uses ``O_DIRECT``, fsync and renames, or a
:class:`KvPath`, a key prefix in one of TensorStore's kvstores, where only what an object store
promises is assumed: a whole object appears at once when its PUT succeeds; there is no rename,
no fsync and no directory. A :class:`KvPath` carries the kvstore options it was opened with
(``endpoint``, ``aws_region``, ``aws_credentials``, ...): they are connection settings, never
written into a manifest, which records only the URL.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import tensorstore as ts

# URL scheme -> TensorStore kvstore driver.
DRIVERS = {"s3": "s3", "gs": "gcs"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# kvstore members a caller may not override through options: they come from the URL.
_FROM_URL = ("driver", "bucket", "path")


def is_url(value: Any) -> bool:
    """Whether ``value`` is a string with a URL scheme (``s3://``, ``file://``, ...)."""
    return isinstance(value, str) and _URL.match(value) is not None


@dataclasses.dataclass(frozen=True, eq=False)
class KvPath:
    """A key prefix in a TensorStore kvstore, used like a directory path.

    Two :class:`KvPath` are equal when their URLs are (options are connection settings).

    Attributes:
      driver: the TensorStore kvstore driver (``"s3"``, ``"gcs"``, or ``"file"``).
      bucket: the bucket (``""`` for ``"file"``).
      key: the key prefix inside the bucket, without leading or trailing ``/`` (for
        ``"file"``, the absolute directory).
      options: further kvstore spec members, as JSON text (hashable).

    Example:
      >>> p = KvPath.parse("s3://bucket/run42", {"endpoint": "http://127.0.0.1:9000"})
      >>> (p / "7" / "state").url
      's3://bucket/run42/7/state'
      >>> (p / "x").spec()["path"], (p / "x").spec()["endpoint"]
      ('run42/x/', 'http://127.0.0.1:9000')
    """

    driver: str
    bucket: str
    key: str
    options: str = "{}"

    @classmethod
    def parse(cls, value: str | os.PathLike, options: Mapping[str, Any] | None = None) -> KvPath:
        """A :class:`KvPath` for a ``s3://``/``gs://`` URL, or a local path (``file`` driver).

        Raises:
          ValueError: an unsupported URL scheme, a URL without a bucket, or options that
            TensorStore's kvstore spec does not accept (names the option and the URL).
        """
        if isinstance(value, KvPath):
            return value if options is None else value.with_options(options)
        if not is_url(value):
            path = pathlib.Path(value).expanduser().absolute()
            return cls("file", "", str(path), _options_json(options, str(path), "file"))
        scheme = _URL.match(value).group(1).lower()
        parsed = urllib.parse.urlparse(value)
        if scheme == "file":
            return cls.parse(pathlib.Path(urllib.parse.unquote(parsed.path)), options)
        if scheme not in DRIVERS:
            raise ValueError(
                f"{value!r}: unsupported URL scheme {scheme!r}; a root is a local path, a "
                "file:// URL, or an object-store URL (s3://bucket/prefix, gs://bucket/prefix)."
            )
        if not parsed.netloc:
            raise ValueError(f"{value!r}: no bucket; write {scheme}://BUCKET/PREFIX.")
        key = parsed.path.strip("/")
        driver = DRIVERS[scheme]
        out = cls(driver, parsed.netloc, key, _options_json(options, value, driver))
        out.spec()  # TensorStore checks the bucket name and every option now, not at first use
        return out

    def with_options(self, options: Mapping[str, Any] | None) -> KvPath:
        return dataclasses.replace(self, options=_options_json(options, self.url, self.driver))

    @property
    def url(self) -> str:
        if self.driver == "file":
            return self.key
        scheme = next(s for s, d in DRIVERS.items() if d == self.driver)
        return f"{scheme}://{self.bucket}/{self.key}".rstrip("/")

    @property
    def is_local(self) -> bool:
        """Whether this is a local directory (the ``file`` driver)."""
        return self.driver == "file"

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, part: str) -> KvPath:
        part = str(part).strip("/")
        key = f"{self.key.rstrip('/')}/{part}" if self.key else part
        return dataclasses.replace(self, key=key)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"KvPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KvPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec (JSON) of this prefix, as a directory (path ends in /).

        Raises:
          ValueError: TensorStore refuses the spec (e.g. an unknown option; names the URL).
        """
        spec: dict[str, Any] = {**json.loads(self.options), "driver": self.driver}
        if self.driver == "file":
            spec["path"] = self.key.rstrip("/") + "/"
        else:
            spec["bucket"] = self.bucket
            spec["path"] = f"{self.key}/" if self.key else ""
        try:
            ts.KvStore.Spec(spec)
        except ValueError as e:
            raise ValueError(f"{self.url}: TensorStore refuses the kvstore spec: {e}.") from e
        return spec

    def open(self) -> ts.KvStore:
        """Opens the kvstore at this prefix (keys are relative to it), in one context shared by
        the process: its resources (connections, the credential provider) are made once."""
        return ts.KvStore.open(self.spec(), context=_shared_context()).result()

    # Synchronous helpers for small objects (manifests, JSON items); pieces go through zarr3.

    def read_bytes(self) -> bytes | None:
        """The object at this key, or ``None`` when it does not exist."""
        parent, name = self.split()
        result = parent.open().read(name).result()
        return None if result.state == "missing" else bytes(result.value)

    def read_text(self) -> str:
        """The object at this key as text (``Path.read_text``'s contract).

        Raises:
          FileNotFoundError: no object at this key.
        """
        data = self.read_bytes()
        if data is None:
            raise FileNotFoundError(f"no object at {self.url}")
        return data.decode()

    def write_bytes(self, data: bytes) -> None:
        """Writes the object at this key (a whole object: it appears at once or not at all)."""
        parent, name = self.split()
        parent.open().write(name, data).result()

    def write_many(self, objects: Mapping[str, bytes]) -> None:
        """Writes objects below this prefix (keys relative to it), all requests in flight at
        once: a handful of small files costs one round trip, not one each."""
        store = self.open()
        for future in [store.write(key, data) for key, data in objects.items()]:
            future.result()

    def read_many(self, keys: Sequence[str]) -> dict[str, bytes | None]:
        """The objects at ``keys`` below this prefix (``None`` where missing), read at once."""
        store = self.open()
        results = [store.read(key) for key in keys]
        return {
            key: None if (r := future.result()).state == "missing" else bytes(r.value)
            for key, future in zip(keys, results, strict=True)
        }

    def split(self) -> tuple[KvPath, str]:
        head, _, name = self.key.rstrip("/").rpartition("/")
        if self.driver == "file":
            head = head or "/"
        return dataclasses.replace(self, key=head), name

    def list(self) -> list[str]:
        """Every key below this prefix, relative to it, sorted."""
        if self.driver == "file" and not pathlib.Path(self.key).is_dir():
            return []
        keys = self.open().list().result()
        return sorted(k.decode() for k in keys)

    def delete_all(self) -> None:
        """Deletes every key below this prefix (for ``file``, the directory itself too)."""
        if self.driver == "file":
            shutil.rmtree(self.key, ignore_errors=True)
            return
        self.open().delete_range(ts.KvStore.KeyRange()).result()

    def delete(self) -> None:
        """Deletes the object at this key (no error when it does not exist)."""
        parent, name = self.split()
        parent.open().delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()


@functools.cache
def _shared_context() -> ts.Context:
    return ts.Context()


def _options_json(options: Mapping[str, Any] | None, where: str, driver: str) -> str:
    if not options:
        return "{}"
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise TypeError(
            f"options for {where}: expected a dict of TensorStore kvstore spec members "
            f"(e.g. {{'endpoint': 'http://127.0.0.1:9000', 'aws_region': 'us-east-1'}}), "
            f"got {options!r:.80}."
        )
    bad = [k for k in options if k in _FROM_URL]
    if bad:
        raise ValueError(
            f"options for {where}: {', '.join(map(repr, bad))} come from the URL itself; "
            "give only connection settings (endpoint, aws_region, aws_credentials, ...)."
        )
    if driver == "file":
        return "{}"  # a local directory needs no connection settings
    hint = {"region": "aws_region", "credentials": "aws_credentials", "endpoint_url": "endpoint"}
    for wrong, right in hint.items():
        if wrong in options:
            raise ValueError(
                f"options for {where}: unknown option {wrong!r}; TensorStore calls it {right!r}."
            )
    try:
        return json.dumps(dict(options), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"options for {where}: must be JSON values ({e}).") from e


def location(value: Any, options: Mapping[str, Any] | None = None) -> pathlib.Path | KvPath:
    """A root or item directory: ``Path`` when local (a path or ``file://``), else :class:`KvPath`.

    Raises:
      ValueError: an unsupported URL scheme or options TensorStore refuses.
    """
    if isinstance(value, KvPath):
        return pathlib.Path(value.key) if value.is_local else value
    if isinstance(value, os.PathLike) or not is_url(value):
        return pathlib.Path(value)
    path = KvPath.parse(value, options)
    return pathlib.Path(path.key) if path.is_local else path


def kvstore_spec(where: pathlib.Path | KvPath) -> dict[str, Any]:
    """The kvstore spec of a directory, local or not (its path ends in /, as a prefix)."""
    if isinstance(where, KvPath):
        return where.spec()
    return {"driver": "file", "path": f"{str(where).rstrip('/')}/"}
