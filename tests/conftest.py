"""Test configuration shared by the whole suite.

Eight simulated CPU devices let sharding tests run on a machine without accelerators; the flag
must be set before JAX initialises its backend, hence here and not in a fixture.

JAX's persistent compilation cache is shared by the test processes and every child they start
(children inherit the environment): the suite compiles the same policy updates and training
steps in hundreds of processes. A size limit turns on the cache's file lock, which makes one
cache safe to share between processes (``filelock``).
"""

import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# In the user's cache, as pip keeps its downloads: a later run (a new clone too) reuses it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cocijax-tests/jax"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2**31))


import contextlib
import dataclasses
import json
import logging
import shutil
import socket
import subprocess
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    """Sets environment variables for a session fixture; puts the old values back after."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in variables.items():
            patch.setenv(name, value)
        yield


@dataclasses.dataclass
class S3Bucket:
    """A bucket on the test's real S3 server (moto) on 127.0.0.1.

    Attributes:
      endpoint: the server's URL.
      name: the bucket, fresh for each test.
      client: a boto3 client for the server (to look at or damage objects from outside).
    """

    endpoint: str
    name: str
    client: object

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.name}/{prefix}".rstrip("/")

    @property
    def options(self) -> dict:
        """The kvstore options cocijax takes for this server (retries short: tests wait less)."""
        return {
            "endpoint": self.endpoint,
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
            "context": {
                "s3_request_retries": {
                    "max_retries": 3,
                    "initial_delay": "10ms",
                    "max_delay": "100ms",
                }
            },
        }

    def options_of_a_server_that_is_down(self) -> dict:
        """:attr:`options` with an endpoint on 127.0.0.1 where nothing listens."""
        return self.options_via(f"http://127.0.0.1:{free_port()}")

    def options_via(self, endpoint: str) -> dict:
        """:attr:`options` with another endpoint (e.g. a :class:`StoreProxy` in front)."""
        return {**self.options, "endpoint": endpoint}

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix``, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=prefix
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto's ThreadedMotoServer) on a free port of 127.0.0.1.

    The environment gets dummy credentials (TensorStore reads them from there, as from any
    AWS credential chain), and empty AWS config files so that neither TensorStore nor boto3
    looks at the machine's. Stopped at the end of the session.
    """
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    empty = tmp_path_factory.mktemp("aws") / "empty"
    empty.write_text("")
    env = {
        "AWS_ACCESS_KEY_ID": "cocijax-test",
        "AWS_SECRET_ACCESS_KEY": "cocijax-test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(empty),
        "AWS_SHARED_CREDENTIALS_FILE": str(empty),
    }
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with _environment(env):
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        try:
            yield endpoint, client
        finally:
            server.stop()


@pytest.fixture
def s3(s3_server) -> S3Bucket:
    """A fresh bucket on the session's S3 server."""
    endpoint, client = s3_server
    name = f"cocijax-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return S3Bucket(endpoint, name, client)


@pytest.fixture
def s3_proxy(s3):
    """A TCP proxy on 127.0.0.1 in front of the S3 server (``store_proxy.StoreProxy``): a test
    takes the server down (``down()``), makes it accept and never answer (``hang()``) or brings
    it back (``up()``); ``s3.options_via(proxy.endpoint)`` goes through it. Closed after."""
    from store_proxy import StoreProxy

    proxy = StoreProxy(int(s3.endpoint.rsplit(":", 1)[1]))
    try:
        yield proxy
    finally:
        proxy.close()


@dataclasses.dataclass
class GcsBucket:
    """A bucket on the test's GCS emulator (``gcp-storage-emulator``) on 127.0.0.1.

    TensorStore's ``gcs`` driver finds the emulator through ``TENSORSTORE_GCS_HTTP_URL`` (set
    for the session), so no kvstore options are needed.
    """

    name: str
    options: None = None

    def url(self, prefix: str = "") -> str:
        return f"gs://{self.name}/{prefix}".rstrip("/")


def _listing_with_offsets(ls):
    """The emulator's object listing, also honouring ``startOffset``/``endOffset``.

    gcp-storage-emulator ignores those two parameters of the GCS JSON API's ``objects.list``
    (the first name listed, and the name before which listing stops). TensorStore's ``gcs``
    driver sends them for every list and every ``delete_range``, so without them a listing of
    ``gs://b/run/1/`` answers with ``run/2/...`` too, and a deletion of one prefix deletes its
    neighbours. This keeps GCS's documented meaning: ``startOffset <= name < endOffset``.
    """

    def handler(request, response, storage, *args, **kwargs):
        start = (request.query.get("startOffset") or [None])[0]
        end = (request.query.get("endOffset") or [None])[0]

        class InRange:
            def __getattr__(self, name):
                return getattr(storage, name)

            def get_file_list(self, *a, **k):
                files, prefixes = storage.get_file_list(*a, **k)
                kept = [
                    f
                    for f in files
                    if (start is None or f["name"] >= start) and (end is None or f["name"] < end)
                ]
                return kept, prefixes

        return ls(request, response, InRange(), *args, **kwargs)

    return handler


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS emulator (gcp-storage-emulator, in memory) on a free port of 127.0.0.1.

    TensorStore is pointed at it with ``TENSORSTORE_GCS_HTTP_URL`` and given a fixed token
    (``GOOGLE_AUTH_TOKEN_FOR_TESTING``) so that it looks for no Google credentials. The
    emulator's listing is completed first (see :func:`_listing_with_offsets`).
    """
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    objects = pytest.importorskip("gcp_storage_emulator.handlers.objects")
    completed = 0
    for _, handlers in emulator.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is objects.ls:
                handlers[method] = _listing_with_offsets(objects.ls)
                completed += 1
    if not completed:  # TensorStore aborts the process on the listing left as it is
        pytest.skip("this gcp-storage-emulator has no objects.ls handler to complete")
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # each 404 otherwise
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    env = {
        "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{port}",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "cocijax-test",
    }
    with _environment(env):
        try:
            yield env["TENSORSTORE_GCS_HTTP_URL"]
        finally:
            server.stop()


@pytest.fixture
def gcs(gcs_server) -> GcsBucket:
    """A fresh bucket on the session's GCS emulator (created through its JSON API)."""
    name = f"cocijax-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(
        f"{gcs_server}/storage/v1/b?project=cocijax-test",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200, answer.read()
    return GcsBucket(name)


@pytest.fixture
def memory() -> Iterator[Path]:
    """A fresh folder on the shared-memory tmpfs, removed afterwards (skipped without one)."""
    from cocijax.core._memory import find_tmpfs

    tmpfs = find_tmpfs()
    if tmpfs is None:
        pytest.skip("no shared-memory tmpfs on this machine")
    path = Path(tempfile.mkdtemp(dir=tmpfs, prefix="cocijax-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test only; skipped where mounting is not allowed."""
    yield from _mount_tmpfs(tmp_path / "tmpfs", "size=8m")


@pytest.fixture
def read_only_root(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs: root ignores permission bits, so only a read-only mount stops it."""
    yield from _mount_tmpfs(tmp_path / "ro", "ro,size=1m")


def _mount_tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        # A lazy unmount still detaches the mount if a file in it is open somewhere.
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
