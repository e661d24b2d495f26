"""Object-storage locations: a prefix in a TensorStore key-value store (``s3://``, ``gs://``).

A root or an item directory is either a local directory (``pathlib.Path``: a plain path or a
``file://`` URL), where the write path uses ``O_DIRECT``, fsync and renames, or a
:class:`KvPath`, a key prefix in one of TensorStore's kvstores, where only what an object store
promises is assumed: a whole object appears at once when its PUT succeeds; there is no rename,
no fsync and no directory. A :class:`KvPath` carries the kvstore options it was opened with
(``endpoint``, ``aws_region``, ``aws_credentials``, ...): they are connection settings, never
written into a manifest, which records only the URL.

Every wait of a :class:`KvPath`'s own operations is bounded by its ``timeout_s``: TensorStore
retries a failing request for minutes by default (``s3_request_retries``: 32 attempts, up to
32 s apart), resolves an S3 bucket's region without any bound, and a server that accepts a
connection but never answers holds a request until curl's low-speed limit. A wait that passes
its deadline raises :class:`StoreTimeoutError` naming the URL; the request is cancelled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import tensorstore as ts

from cocijax import _files

# URL scheme -> TensorStore kvstore driver.
DRIVERS = {"s3": "s3", "gs": "gcs"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# kvstore members a caller may not override through options: they come from the URL.
_FROM_URL = ("driver", "bucket", "path")
# TensorStore's retry resource of each driver, and the short retries a probe uses (when the
# caller set none): a closed port or a missing bucket then fails with its own cause within a
# second, instead of being retried until the deadline hides it.
_RETRIES = {"s3": "s3_request_retries", "gcs": "gcs_request_retries"}
_PROBE_RETRIES = {"max_retries": 3, "initial_delay": "100ms", "max_delay": "1s"}


class StoreTimeoutError(TimeoutError):
    """An object store did not answer within the deadline (names the URL and the wait)."""


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
      timeout_s: the longest any single wait of this path's operations may take (``None``:
        TensorStore's own retries alone bound it).

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
    timeout_s: float | None = None

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

    def with_timeout(self, timeout_s: float | None) -> KvPath:
        """This prefix, each of its waits bounded by ``timeout_s`` seconds."""
        return dataclasses.replace(self, timeout_s=timeout_s)

    def for_probe(self) -> KvPath:
        """This prefix with short request retries (unless its options set them): a probe
        reports why a store cannot be reached within a second, not after minutes of retries."""
        resource = _RETRIES.get(self.driver)
        options = json.loads(self.options)
        context = dict(options.get("context") or {})
        if resource is None or resource in context:
            return self
        context[resource] = _PROBE_RETRIES
        return dataclasses.replace(self, options=json.dumps({**options, "context": context}))

    def wait(self, future: Any, what: str) -> Any:
        """The result of a TensorStore future of this path, waited for at most ``timeout_s``.

        Raises:
          StoreTimeoutError: no result within ``timeout_s`` (the future is cancelled).
        """
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise StoreTimeoutError(
                f"{self.url}: {what}: no answer within {self.timeout_s:g} s (an endpoint that "
                "cannot be reached or does not answer, or requests retried for that long)"
            ) from None

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
        return self.wait(ts.KvStore.open(self.spec(), context=_shared_context()), "open")

    # Synchronous helpers for small objects (manifests, JSON items); pieces go through zarr3.

    def read_bytes(self) -> bytes | None:
        """The object at this key, or ``None`` when it does not exist."""
        parent, name = self.split()
        result = self.wait(parent.open().read(name), "read")
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
        self.wait(parent.open().write(name, data), "write")

    def write_many(self, objects: Mapping[str, bytes]) -> None:
        """Writes objects below this prefix (keys relative to it), all requests in flight at
        once: a handful of small files costs one round trip, not one each."""
        store = self.open()
        for future in [store.write(key, data) for key, data in objects.items()]:
            self.wait(future, "write")

    def read_many(self, keys: Sequence[str]) -> dict[str, bytes | None]:
        """The objects at ``keys`` below this prefix (``None`` where missing), read at once."""
        store = self.open()
        results = [store.read(key) for key in keys]
        return {
            key: None if (r := self.wait(future, "read")).state == "missing" else bytes(r.value)
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
        keys = self.wait(self.open().list(), "list")
        return sorted(k.decode() for k in keys)

    def delete_all(self) -> None:
        """Deletes every key below this prefix (for ``file``, the directory itself too)."""
        if self.driver == "file":
            _files.remove_tree(self.key)  # errors raised, as the object stores' are
            return
        self.wait(self.open().delete_range(ts.KvStore.KeyRange()), "delete")

    def delete(self) -> None:
        """Deletes the object at this key (no error when it does not exist)."""
        parent, name = self.split()
        self.wait(parent.open().delete_range(ts.KvStore.KeyRange(name, name + "\0")), "delete")

    def read_stamped(self) -> tuple[bytes | None, bytes]:
        """The object at this key (``None`` when missing) and its storage generation, for a
        later :meth:`write_if`."""
        parent, name = self.split()
        result = self.wait(parent.open().read(name), "read")
        value = None if result.state == "missing" else bytes(result.value)
        return value, result.stamp.generation

    def write_if(self, data: bytes | None, generation: bytes) -> bytes | None:
        """Writes (or, ``data=None``, deletes) the object at this key only if its generation is
        still ``generation`` (from :meth:`read_stamped`); the new generation, or ``None`` when
        the condition failed.

        TensorStore's ``file`` and ``gcs`` drivers check the condition atomically; its ``s3``
        driver checks it with a HEAD request before an unconditional PUT (TensorStore 0.1.86),
        so two writers may both succeed there: callers read the object back. ``None`` too when
        the server gave a generation TensorStore cannot send back (a GCS emulator).
        """
        parent, name = self.split()
        try:
            stamp = self.wait(parent.open().write(name, data, if_equal=generation), "write")
        except ValueError as e:
            if "Malformed StorageGeneration" in str(e):
                return None  # a generation the server gave that TensorStore cannot send back
            raise
        return stamp.generation or None


@functools.cache
def _shared_context() -> ts.Context:
    return ts.Context()


def probe_writable(path: KvPath, timeout_s: float | None) -> None:
    """Writes and deletes a probe object under ``path`` with short retries, each wait bounded.

    Raises:
      ValueError: the store refused (a missing bucket, missing credentials, an endpoint that
        refuses connections: TensorStore's cause, without the HTTP body).
      StoreTimeoutError: no answer within ``timeout_s``.
    """
    probe = path.for_probe().with_timeout(timeout_s) / f".cocijax-probe-{uuid.uuid4().hex}"
    try:
        # Not empty: a GCS emulator (gcp-storage-emulator) fails an empty media upload.
        probe.write_bytes(b"cocijax")
        probe.delete()
    except ValueError as e:
        raise ValueError(describe_error(e)) from e


# TensorStore status codes of failures that may pass by themselves (a server down for a moment,
# a connection refused, requests retried until TensorStore gave up); the others (NOT_FOUND: a
# missing bucket, PERMISSION_DENIED, INVALID_ARGUMENT, credentials) do not.
_TRANSIENT = ("ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNKNOWN")


def is_transient(error: BaseException) -> bool:
    """Whether a store's error may pass if the request is made again later."""
    if isinstance(error, TimeoutError):
        return True
    return str(error).lstrip().startswith(_TRANSIENT)


def is_missing_bucket(error: BaseException) -> bool:
    """Whether a store's error says that the bucket itself does not exist."""
    text = str(error)
    return "NoSuchBucket" in text or ("NOT_FOUND" in text and "bucket" in text.lower())


def describe_error(error: BaseException) -> str:
    """TensorStore's error in one line: its status and cause, without the HTTP response body."""
    text = str(error).strip()
    for cut in (" [http_response", " [curl_code", " [source locations"):
        text = text.split(cut, 1)[0]
    return text.rstrip(" .")


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
