"""Test configuration shared by the whole suite.

Eight simulated CPU devices let sharding tests run on a machine without accelerators; the flag
must be set before JAX initialises its backend, hence here and not in a fixture.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import dataclasses
import logging
import socket
import uuid

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        return {**self.options, "endpoint": f"http://127.0.0.1:{free_port()}"}

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
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        yield endpoint, client
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(s3_server) -> S3Bucket:
    """A fresh bucket on the session's S3 server."""
    endpoint, client = s3_server
    name = f"cocijax-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return S3Bucket(endpoint, name, client)
